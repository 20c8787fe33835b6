"""Known slow patterns in users' training code, each found from measured numbers.

A :class:`Finding` names one pattern (``kind``), says what was measured (``message``, with the
numbers, and ``figures``, the same numbers as a dict), where it is (``where``: an attribute, a
hook, a ``file:line``), and what to change, with the value (``fix``). ``DataWaitMonitor``
collects them in ``report.findings``; the functions here only decide, from figures its
callback side measured on a few sampled steps, so each is tested on numbers as well as on a
real run with and without the pattern.

Kinds (:data:`FINDING_KINDS`):

* ``"graph-kept"`` -- a module attribute holds a tensor with ``grad_fn`` between steps and its
  autograd graph grows step over step (``self.total_loss += loss``, ``self.outputs.append(loss)``),
  scanned at the starts of steps 2, 4, 8, 16, ... and after the last step. Figures: ``attributes``
  (how many attributes do it), ``graph_nodes`` (autograd nodes held at the last sample, of the
  attribute growing most), ``graph_nodes_per_step`` (its growth per step), and where the device
  tells live memory (CUDA, the simulated card) ``memory_growth_bytes`` and
  ``memory_growth_bytes_per_step`` (memory handed out at step start, first to last sample);
* ``"host-sync"`` -- ``.item()``, ``float(t)``, ``.cpu()``, ``bool(t)``, ``if loss > 0:``: reads from
  the card to the host per step, counted on a CUDA device (real or simulated) in warm-up steps 1
  and 2 and named by the user's ``file:line``; a host-only run has none. Figures:
  ``syncs_per_step`` (all reads), ``user_syncs_per_step`` (from the user's code; found from 1),
  ``lightning_syncs_per_step`` (Lightning's own, 0 for a plain module with step logging, the
  progress bar and a logger), ``lines`` (distinct source lines);
* ``"slow-hook"`` -- a callback or module hook takes a large share of training time;
* ``"checkpoint-time"`` -- saving checkpoints takes a large share of training time;
* ``"data-parallel"`` -- ``nn.DataParallel`` inside the module;
* ``"oversubscribed"`` -- intra-op threads x processes on the host exceed its cores;
* ``"tf32-off"`` -- float32 matmuls without TF32 on a card with TF32 tensor cores;
* ``"cudnn-benchmark-off"`` -- convolutions with fixed input shapes and ``cudnn.benchmark`` off;
* ``"channels-last"`` -- convolutions under mixed precision with weights or inputs not in
  ``channels_last``;
* ``"slow-disk"`` -- the dataset's files read slower than training consumes them.

Example::

    >>> finding = oversubscription(threads_per_process=8, processes=4, cores=16)
    >>> finding.kind, finding.fix
    ('oversubscribed', 'torch.set_num_threads(4) in each process (or OMP_NUM_THREADS=4): 4 processes x 4 threads = 16 cores')

Figures of the hook, checkpoint and disk findings, each logged as ``gpuopt/finding/<kind>/<figure>``
(``-`` in the kind becomes ``_``):

* ``slow_hook/seconds``, ``calls``, ``ms_per_call`` -- the hook's total wall time over the run (its
  calls inside validation not counted, checkpoint saves it made taken out), its calls, and the mean
  per call; ``share`` -- seconds / training time (train start to end, validation excluded);
  ``suggested_every_n`` -- the interval (steps, or epochs for a hook run once an epoch) of the fix.
  With several slow hooks, the figures are the last one's (each is a finding in ``report.findings``).
* ``checkpoint_time/saves``, ``seconds``, ``ms_per_save`` -- ``trainer.save_checkpoint`` calls and
  their time (validation included); ``share`` -- seconds / the fit's time from train start to end;
  ``suggested_interval`` -- the first saver's new interval (steps, epochs or seconds, as it is set);
  ``checkpoint_mb`` -- the size of the last file a ``ModelCheckpoint`` wrote (when there is one).
* ``slow_disk/read_mb_s`` -- MB/s reading a sample of the dataset's files (page cache dropped first);
  ``needed_mb_s`` -- MB/s training consumed them (bytes per sample x samples per second, this host's
  processes); ``data_wait_fraction`` -- the run's data wait share of a step; ``files_read``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

FINDING_KINDS = (
    "graph-kept",
    "host-sync",
    "slow-hook",
    "checkpoint-time",
    "data-parallel",
    "oversubscribed",
    "tf32-off",
    "cudnn-benchmark-off",
    "channels-last",
    "slow-disk",
)


@dataclass
class Finding:
    """One slow pattern found in a run, with its numbers and the fix.

    Example::

        >>> Finding("data-parallel", "nn.DataParallel wraps `backbone`", "use DDP", where="backbone").kind
        'data-parallel'
    """

    #: one of :data:`FINDING_KINDS`
    kind: str
    #: what was measured, with the numbers
    message: str
    #: what to change, with the value
    fix: str
    #: where: a module attribute, a hook, a ``file:line``; ``None`` when it is the whole run
    where: Optional[str] = None
    #: the measured numbers behind the message (also logged as ``gpuopt/finding/<kind>/<name>``)
    figures: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"Finding kind={self.kind!r} is not one of {', '.join(FINDING_KINDS)}")


def metric_key(kind: str, name: str) -> str:
    """The logged metric key of figure ``name`` of a finding of ``kind``.

    >>> metric_key("host-sync", "syncs_per_step")
    'gpuopt/finding/host_sync/syncs_per_step'
    """
    return f"gpuopt/finding/{kind.replace('-', '_')}/{name}"


def findings_metrics(findings: Sequence[Finding]) -> dict[str, float]:
    """The ``gpuopt/*`` metrics of ``findings``: their count and every figure of each.

    >>> findings_metrics([oversubscription(8, 1, 2)])["gpuopt/findings"]
    1.0
    """
    metrics = {"gpuopt/findings": float(len(findings))}
    for finding in findings:
        for name, value in finding.figures.items():
            metrics[metric_key(finding.kind, name)] = float(value)
    return metrics


def finding_lines(findings: Sequence[Finding]) -> list[str]:
    """The findings as the report table's notes: the measurement, then the fix.

    >>> finding_lines([])
    []
    """
    lines = []
    for finding in findings:
        where = f" [{finding.where}]" if finding.where else ""
        lines.append(f"  • {finding.kind}{where}: {finding.message}")
        lines.append(f"      fix: {finding.fix}")
    return lines


# ------------------------------------------------------------------- inside the steps


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def graph_kept(
    steps: Sequence[int],
    graph_nodes: Mapping[str, Sequence[int]],
    live_bytes: Sequence[Optional[int]] = (),
    containers: Sequence[str] = (),
) -> Optional[Finding]:
    """Module attributes that hold an autograd graph between steps, and whether it grows.

    ``steps`` are the sampled step starts; ``graph_nodes[path][i]`` the autograd nodes reachable
    from what attribute ``path`` held at the start of ``steps[i]`` (0: no graph);
    ``live_bytes[i]`` the memory the device had handed out then (``None`` where it cannot tell,
    the host); ``containers`` the paths that are lists, tuples or dicts. An attribute is found
    when it holds a graph at two or more sampled steps and that graph grows from the first of
    them to the last (live memory alone is no evidence: the optimizer, caches and the data
    move it too; its growth over those steps is reported where known).

    >>> graph_kept([2, 4, 8], {"total_loss": [9, 17, 33]}).where
    'total_loss'
    >>> graph_kept([2, 4, 8], {"last_loss": [9, 9, 9]}) is None  # one step's graph, not growing
    True
    """
    found: list[tuple[str, list[int], list[int], Optional[int]]] = []
    for path, nodes in graph_nodes.items():
        held = [i for i, count in enumerate(nodes) if count > 0]
        if len(held) < 2:
            continue
        first, last = held[0], held[-1]
        known = [i for i in held if i < len(live_bytes) and live_bytes[i] is not None]
        growth = live_bytes[known[-1]] - live_bytes[known[0]] if len(known) >= 2 else None  # type: ignore[operator]
        if nodes[last] > nodes[first]:
            found.append((path, [steps[i] for i in held], [nodes[i] for i in held], growth))
    if not found:
        return None
    found.sort(key=lambda item: item[2][-1] - item[2][0], reverse=True)
    path, held_steps, nodes, growth = found[0]
    span = max(1, held_steps[-1] - held_steps[0])
    shown = " → ".join(str(count) for count in nodes)
    memory = f"; live memory at step start grew by {_mib(growth)} over those steps" if growth is not None else ""
    others = f" (also {', '.join(f'`{item[0]}`' for item in found[1:])})" if len(found) > 1 else ""
    name = path.rsplit(".", 1)[-1]
    owner = "self." + path.rsplit(".", 1)[0] + "." if "." in path else "self."
    example = f"`{owner}{name}.append(loss.detach())`" if path in containers else f"`{owner}{name} += loss.detach()`"
    figures = {
        "attributes": float(len(found)),
        "graph_nodes": float(nodes[-1]),
        "graph_nodes_per_step": (nodes[-1] - nodes[0]) / span,
    }
    if growth is not None:
        figures["memory_growth_bytes"] = float(growth)
        figures["memory_growth_bytes_per_step"] = growth / span
    return Finding(
        "graph-kept",
        f"`{path}`{others} holds a tensor with an autograd graph (grad_fn) between steps, and the graph grows:"
        f" {shown} autograd nodes at the starts of steps {', '.join(map(str, held_steps))}{memory}. Every step's"
        " graph stays reachable from the module, so memory and the time of a backward through it grow over the run",
        f"keep no graph across steps: accumulate `loss.detach()` (or `loss.item()` at epoch end) instead of `loss`:"
        f" {example}",
        where=", ".join(item[0] for item in found),
        figures=figures,
    )


def host_sync(
    steps: Sequence[int],
    user_reads: Sequence[int],
    lightning_reads: Sequence[int],
    lines: Mapping[str, int],
) -> Optional[Finding]:
    """Reads from the card to the host (each waits for the card to finish its queue) per step.

    ``user_reads[i]``/``lightning_reads[i]`` are the reads counted in step ``steps[i]`` made from
    the user's code and from Lightning's own; ``lines`` the user's ``file:line`` with their
    counts over those steps. Found when the user's code reads at least once per step on average:
    Lightning's own reads are the baseline every run has.

    >>> host_sync([1, 2], [2, 2], [0, 0], {"train.py:41": 4}).where
    'train.py:41'
    >>> host_sync([1, 2], [0, 0], [1, 1], {}) is None
    True
    """
    if not steps:
        return None
    user = sum(user_reads) / len(steps)
    lightning = sum(lightning_reads) / len(steps)
    if user < 1:
        return None
    per_line = sorted(lines.items(), key=lambda item: item[1], reverse=True)
    shown = ", ".join(f"{line} ({count / len(steps):g}/step)" for line, count in per_line)
    where = ", ".join(line for line, _ in per_line) or None
    lightning_note = f" (and {lightning:g} by Lightning itself)" if lightning else ""
    return Finding(
        "host-sync",
        f"{user:g} read(s) from the GPU to the host per step in your code{lightning_note}, over steps"
        f" {', '.join(map(str, steps))}: each (`.item()`, `float(t)`, `.cpu()`, `bool(t)`, `if loss > 0:`)"
        f" waits until the GPU has finished every queued kernel, so the host cannot queue ahead"
        + (f"; at {shown}" if shown else ""),
        f"at {where or 'those lines'}: keep the values as tensors on the GPU; log them with"
        " `self.log(name, value, on_step=True)` (read once every log_every_n_steps), take `.item()` only every N"
        " steps or at epoch end, and branch with tensor ops (`torch.where`) instead of `if tensor:`",
        where=where,
        figures={
            "syncs_per_step": user + lightning,
            "user_syncs_per_step": user,
            "lightning_syncs_per_step": lightning,
            "lines": float(len(lines)),
        },
    )


# ------------------------------------------------------------------- the module and the host


def data_parallel(wrapped: Sequence[str]) -> Optional[Finding]:
    """``nn.DataParallel`` found at the module paths ``wrapped`` (``""`` is the module itself).

    >>> data_parallel(["encoder"]).where
    'encoder'
    >>> data_parallel([]) is None
    True
    """
    if not wrapped:
        return None
    names = ", ".join(f"`{path or 'the LightningModule itself'}`" for path in wrapped)
    return Finding(
        "data-parallel",
        f"nn.DataParallel wraps {names}: one process drives every GPU, scatters each batch and gathers the"
        " outputs on GPU 0 every step, under the GIL",
        "remove the nn.DataParallel wrapper and let Lightning replicate the model: Trainer(strategy='ddp', devices=N)",
        where=", ".join(path or "<module>" for path in wrapped),
        figures={"wrappers": float(len(wrapped))},
    )


def oversubscription(threads_per_process: int, processes: int, cores: int) -> Optional[Finding]:
    """Intra-op threads x processes on the host against its usable cores.

    >>> oversubscription(threads_per_process=1, processes=2, cores=2) is None
    True
    """
    wanted = threads_per_process * processes
    if cores < 1 or wanted <= cores:
        return None
    fair = max(1, cores // max(1, processes))
    return Finding(
        "oversubscribed",
        f"{processes} process(es) x {threads_per_process} intra-op threads = {wanted} threads on {cores} usable"
        f" core(s): threads wait for each other and each op gets slower",
        f"torch.set_num_threads({fair}) in each process (or OMP_NUM_THREADS={fair}): {processes} processes x"
        f" {fair} threads = {processes * fair} cores",
        figures={"threads": float(wanted), "cores": float(cores), "suggested_threads": float(fair)},
    )


# ---------------------------------------------------------------------------------- CUDA


def tf32_off(capability: Optional[tuple[int, int]], matmul_precision: str, precision: str) -> Optional[Finding]:
    """float32 matmuls in full precision on a card with TF32 tensor cores (compute capability >= 8.0).

    ``matmul_precision`` is ``torch.get_float32_matmul_precision()``; ``precision`` the Trainer's.
    Under mixed precision most matmuls run in 16 bits anyway, so only ``32-true`` counts.

    >>> tf32_off((8, 0), "highest", "32-true").fix
    "torch.set_float32_matmul_precision('high') before Trainer(...): float32 matmuls on TF32 tensor cores"
    >>> tf32_off((7, 0), "highest", "32-true") is None  # a V100 has no TF32
    True
    """
    if capability is None or capability < (8, 0) or matmul_precision != "highest" or precision not in ("32-true", "32"):
        return None
    return Finding(
        "tf32-off",
        f"float32 matmuls run in full precision on a card of compute capability {capability[0]}.{capability[1]}"
        " whose TF32 tensor cores do them several times faster (torch.get_float32_matmul_precision() is 'highest')",
        "torch.set_float32_matmul_precision('high') before Trainer(...): float32 matmuls on TF32 tensor cores",
        figures={"compute_capability": capability[0] + capability[1] / 10},
    )


def cudnn_benchmark_off(benchmark: bool, convolutions: int, input_shapes_seen: int) -> Optional[Finding]:
    """Convolutions on fixed input shapes with ``torch.backends.cudnn.benchmark`` off.

    ``input_shapes_seen`` is the number of distinct batch shapes over the sampled steps (1: fixed).

    >>> cudnn_benchmark_off(False, convolutions=12, input_shapes_seen=1).fix
    'Trainer(benchmark=True): cuDNN times its algorithms once per input shape and keeps the fastest'
    >>> cudnn_benchmark_off(False, convolutions=12, input_shapes_seen=3) is None  # shapes vary: autotuning repeats
    True
    """
    if benchmark or convolutions == 0 or input_shapes_seen != 1:
        return None
    return Finding(
        "cudnn-benchmark-off",
        f"{convolutions} convolution(s) run on one fixed input shape with torch.backends.cudnn.benchmark off:"
        " cuDNN uses its heuristic choice of algorithm, not the fastest",
        "Trainer(benchmark=True): cuDNN times its algorithms once per input shape and keeps the fastest",
        figures={"convolutions": float(convolutions)},
    )


def channels_last(
    precision: str, not_channels_last: Sequence[str], inputs_not_channels_last: bool
) -> Optional[Finding]:
    """2-D convolutions under mixed precision whose weights (``not_channels_last``: module paths) or
    4-D inputs are in NCHW: tensor-core kernels want NHWC and every convolution pays a transpose.

    >>> channels_last("16-mixed", ["stem.conv"], inputs_not_channels_last=True).where
    'stem.conv'
    >>> channels_last("32-true", ["stem.conv"], True) is None
    True
    """
    if "mixed" not in precision and precision not in ("16-true", "bf16-true"):
        return None
    if not not_channels_last and not inputs_not_channels_last:
        return None
    what = []
    if not_channels_last:
        what.append(f"{len(not_channels_last)} Conv2d weight(s)")
    if inputs_not_channels_last:
        what.append("the 4-D batch")
    shown = ", ".join(not_channels_last[:3]) + (
        f" and {len(not_channels_last) - 3} more" if len(not_channels_last) > 3 else ""
    )
    return Finding(
        "channels-last",
        f"{' and '.join(what)} in NCHW (contiguous) memory format under {precision}: tensor-core convolution kernels"
        " work in NHWC, so each convolution transposes its input and output",
        "model = model.to(memory_format=torch.channels_last) in the LightningModule's __init__ or setup(), and"
        " x = x.to(memory_format=torch.channels_last) for 4-D inputs in training_step",
        where=shown or None,
        figures={"convolutions_nchw": float(len(not_channels_last)), "input_nchw": float(inputs_not_channels_last)},
    )


# ----------------------------------------------------------------- hooks, checkpoints, disk

#: share of training time from which one hook is a ``"slow-hook"`` finding
SLOW_HOOK_SHARE = 0.10
#: share of the fit's time from which saving checkpoints is a ``"checkpoint-time"`` finding
CHECKPOINT_SHARE = 0.10
#: the share the suggested setting brings a slow hook or checkpoint saving down to
TARGET_SHARE = 0.02
#: the dataset's files are slow when their read throughput is below this many times the rate training needs
DISK_MARGIN = 1.5


def nice_ceil(value: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... not below ``value`` (an interval a user would write).

    >>> [nice_ceil(v) for v in (0.3, 1, 1.2, 3, 7.5, 11, 49, 51)]
    [1, 1, 2, 5, 10, 20, 50, 100]
    """
    if value != value or value == float("inf"):
        raise ValueError(f"nice_ceil({value}) needs a finite number")
    nice = 1
    while nice < value:
        nice = _next_nice(nice)
    return nice


def _next_nice(nice: int) -> int:
    digits = str(nice)
    lead, zeros = int(digits[0]), 10 ** (len(digits) - 1)
    return {1: 2, 2: 5, 5: 10}[lead] * zeros


def reduction_factor(seconds: float, total_s: float, target: float = TARGET_SHARE) -> float:
    """How many times fewer calls bring ``seconds`` out of ``total_s`` down to ``target`` of the (shorter) total.

    >>> round(reduction_factor(10.0, 100.0, 0.02), 1)  # 10 s of 100 s -> 1.84 s of 91.84 s
    5.4
    """
    rest = total_s - seconds
    if seconds <= 0:
        return 1.0
    if rest <= 0:
        return float("inf")
    return seconds * (1 - target) / (target * rest)


def _share_after(seconds: float, total_s: float, factor: float) -> float:
    rest = max(0.0, total_s - seconds)
    after = seconds / factor
    return after / (rest + after) if rest + after > 0 else 0.0


def slow_hook(
    hook: str,
    total_s: float,
    calls: int,
    train_s: float,
    epochs: int = 1,
    in_module: bool = False,
    threshold: float = SLOW_HOOK_SHARE,
    target: float = TARGET_SHARE,
) -> Optional[Finding]:
    """One hook (``hook``: ``"<Callback or module class>.<hook name>"``) that ran ``calls`` times for
    ``total_s`` seconds of ``train_s`` seconds of training (from ``on_train_start`` to ``on_train_end``,
    validation excluded, the hook's own calls inside validation not counted).

    Found from ``threshold`` (10%: a tenth of the run in one piece of bookkeeping is worth a line of
    code; below it the step itself is the better lever). Called more often than once an epoch, the fix
    runs it every ``N`` steps, ``N`` (1, 2, 5, 10, ...) bringing it to about ``target`` (2%) of training
    time; once an epoch or less, every ``N`` epochs.

    >>> finding = slow_hook("SlowHook.on_train_batch_end", total_s=5.0, calls=100, train_s=10.0)
    >>> finding.figures["share"], finding.figures["suggested_every_n"]
    (0.5, 50.0)
    >>> slow_hook("SlowHook.on_train_batch_end", total_s=0.5, calls=100, train_s=10.0) is None
    True
    """
    if calls < 1 or train_s <= 0 or total_s <= 0:
        return None
    share = total_s / train_s
    if share < threshold:
        return None
    per_call = total_s / calls
    every = nice_ceil(reduction_factor(total_s, train_s, target)) if total_s < train_s else max(2, nice_ceil(calls))
    every = max(2, every)
    after = _share_after(total_s, train_s, every)
    owner = "self" if in_module else "trainer"
    name = hook.rsplit(".", 1)[-1]
    if calls > max(1, epochs):
        fix = (
            f"run it every {every} steps: `if {owner}.global_step % {every} == 0:` around its work in `{name}`"
            f" (about {after:.1%} of training time)"
        )
        if name != "on_train_epoch_end":
            fix += ", or move the work to on_train_epoch_end"
    else:
        fix = (
            f"run it every {every} epochs: `if {owner}.current_epoch % {every} == 0:` around its work in `{name}`"
            f" (about {after:.1%} of training time)"
        )
    return Finding(
        "slow-hook",
        f"{hook} took {total_s:.2f} s over {calls} call(s) ({per_call * 1e3:.1f} ms each), {share:.0%} of training"
        f" time ({train_s:.2f} s from train start to end, validation excluded)",
        fix,
        where=hook,
        figures={
            "seconds": float(total_s),
            "calls": float(calls),
            "ms_per_call": per_call * 1e3,
            "share": float(share),
            "suggested_every_n": float(every),
        },
    )


@dataclass
class CheckpointSaver:
    """What saved checkpoints in a run: a ``ModelCheckpoint`` (its settings) or a hook calling
    ``trainer.save_checkpoint`` (``model_checkpoint=False``)."""

    #: ``"ModelCheckpoint(every_n_train_steps=1)"``, or the hook: ``"MyCallback.on_train_batch_end"``
    name: str
    #: ``trainer.save_checkpoint`` calls and their total seconds
    saves: int
    seconds: float
    model_checkpoint: bool = True
    every_n_train_steps: Optional[int] = None
    every_n_epochs: Optional[int] = None
    train_time_interval_s: Optional[float] = None
    save_last: Optional[object] = None
    save_weights_only: bool = False


def checkpoint_time(
    savers: Sequence[CheckpointSaver],
    fit_s: float,
    steps: int,
    checkpoint_bytes: Optional[int] = None,
    optimizer_bytes: int = 0,
    parameter_bytes: int = 0,
    threshold: float = CHECKPOINT_SHARE,
    target: float = TARGET_SHARE,
) -> Optional[Finding]:
    """Checkpoint saving (every ``trainer.save_checkpoint`` of ``savers``) against ``fit_s``, the fit's
    time from ``on_train_start`` to ``on_train_end`` (validation included: saves also happen there),
    over ``steps`` training steps.

    Found from ``threshold`` (10%, as a slow hook). The fix scales each saver's interval
    (``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``; for a hook, a step
    interval) up to a 1-2-5 value bringing saving to about ``target`` (2%); with ``save_last=True``
    it also names ``save_last="link"`` (the last checkpoint as a link, not a second file), and with an
    optimizer state at least as large as the weights (``optimizer_bytes`` >= ``parameter_bytes``),
    ``save_weights_only=True`` (when resuming the optimizer is not needed).

    >>> saver = CheckpointSaver("ModelCheckpoint(every_n_train_steps=1)", saves=100, seconds=5.0, every_n_train_steps=1)
    >>> checkpoint_time([saver], fit_s=10.0, steps=100).fix
    'ModelCheckpoint(every_n_train_steps=1 → 50) (about 2.0% of training time)'
    """
    saves = sum(saver.saves for saver in savers)
    seconds = sum(saver.seconds for saver in savers)
    if saves < 1 or fit_s <= 0 or seconds <= 0:
        return None
    share = seconds / fit_s
    if share < threshold:
        return None
    factor = reduction_factor(seconds, fit_s, target) if seconds < fit_s else float(max(2, saves))
    changes: list[str] = []
    suggested: Optional[int] = None
    scales: list[float] = []
    for saver in savers:
        if saver.saves < 1:
            continue
        if saver.model_checkpoint:
            if saver.every_n_train_steps:
                new = nice_ceil(saver.every_n_train_steps * factor)
                setting = f"every_n_train_steps={saver.every_n_train_steps} → {new}"
                scales.append(new / saver.every_n_train_steps)
                suggested = suggested or new
            elif saver.train_time_interval_s:
                new = nice_ceil(saver.train_time_interval_s * factor)
                setting = (
                    f"train_time_interval=timedelta(seconds={saver.train_time_interval_s:g}) → timedelta(seconds={new})"
                )
                scales.append(new / saver.train_time_interval_s)
                suggested = suggested or new
            else:
                current = saver.every_n_epochs or 1
                new = nice_ceil(current * factor)
                setting = f"every_n_epochs={current} → {new}"
                scales.append(new / current)
                suggested = suggested or new
            extras = []
            if saver.save_last is True:
                extras.append('save_last=True → "link"')
            if not saver.save_weights_only and parameter_bytes > 0 and optimizer_bytes >= parameter_bytes:
                extras.append("save_weights_only=True")
            changes.append(f"ModelCheckpoint({', '.join([setting, *extras])})")
        else:
            interval = max(1.0, steps / saver.saves) if steps else 1.0
            new = nice_ceil(interval * factor)
            changes.append(
                f"in {saver.name}, save every {new} steps: `if trainer.global_step % {new} == 0:`"
                " around trainer.save_checkpoint(...)"
            )
            scales.append(new / interval)
            suggested = suggested or new
    after = _share_after(seconds, fit_s, max(1.0, min(scales, default=1.0)))
    fix = "; ".join(changes) + f" (about {after:.1%} of training time)"
    if any("save_weights_only" in change for change in changes):
        fix += (
            f"; the optimizer state is {optimizer_bytes / 1e6:.1f} MB against {parameter_bytes / 1e6:.1f} MB of"
            " weights, and a weights-only checkpoint cannot resume the optimizer"
        )
    size = f", {checkpoint_bytes / 1e6:.1f} MB each" if checkpoint_bytes else ""
    figures = {
        "saves": float(saves),
        "seconds": float(seconds),
        "ms_per_save": 1e3 * seconds / saves,
        "share": float(share),
    }
    if suggested is not None:
        figures["suggested_interval"] = float(suggested)
    if checkpoint_bytes:
        figures["checkpoint_mb"] = checkpoint_bytes / 1e6
    return Finding(
        "checkpoint-time",
        f"{saves} checkpoint save(s) took {seconds:.2f} s ({1e3 * seconds / saves:.0f} ms each{size}), {share:.0%} of"
        f" the fit's time from train start to end ({fit_s:.2f} s, {steps} steps)",
        fix,
        where=", ".join(saver.name for saver in savers if saver.saves) or None,
        figures=figures,
    )


def slow_disk(
    read_mb_s: float,
    needed_mb_s: float,
    data_wait_fraction: Optional[float],
    data_wait_high: float,
    directory: str,
    files_read: int,
    mb_read: float,
    filesystem: Optional[str] = None,
    margin: float = DISK_MARGIN,
    bytes_per_sample: Optional[float] = None,
    samples_per_second: Optional[float] = None,
) -> Optional[Finding]:
    """The dataset's files (under ``directory``) read at ``read_mb_s`` (``files_read`` of them,
    ``mb_read`` MB, page cache dropped first) against ``needed_mb_s``, the rate training consumes
    them (``bytes_per_sample`` x ``samples_per_second``, both optional: only shown).

    Found when the read is slower than ``margin`` (1.5) x the needed rate -- a disk barely faster
    than training leaves no headroom for seeks, other readers or the next, faster epoch -- and the
    run waits for data at least ``data_wait_high`` of each step (an input-bound run: otherwise a
    slow disk costs nothing).

    >>> slow_disk(80.0, 100.0, 0.6, 0.2, "/data/imagenet", files_read=32, mb_read=64.0).fix.split(":")[0]
    'copy the dataset to a local SSD or to /dev/shm (RAM)'
    >>> slow_disk(80.0, 100.0, 0.05, 0.2, "/data/imagenet", 32, 64.0) is None  # not input-bound
    True
    """
    if read_mb_s <= 0 or needed_mb_s <= 0 or data_wait_fraction is None:
        return None
    if read_mb_s >= margin * needed_mb_s or data_wait_fraction < data_wait_high:
        return None
    in_memory = filesystem in ("tmpfs", "ramfs")
    where_from = f" ({filesystem}: already in memory)" if in_memory else (f" ({filesystem})" if filesystem else "")
    fix = (
        f"copy the dataset to a local SSD or to /dev/shm (RAM): `cp -r {directory} /dev/shm/` (if it fits) and point"
        " the dataset there"
    )
    if in_memory:
        fix = "the files are already in memory: read them in more DataLoader workers (raise num_workers)"
    rate = ""
    if bytes_per_sample and samples_per_second:
        rate = f" ({bytes_per_sample / 1e3:.1f} kB a sample x {samples_per_second:.0f} samples/s)"
    return Finding(
        "slow-disk",
        f"the dataset's files under {directory}{where_from} read at {read_mb_s:.1f} MB/s ({files_read} file(s),"
        f" {mb_read:.1f} MB, page cache dropped first) while training consumes {needed_mb_s:.1f} MB/s{rate} and"
        f" waits for data {data_wait_fraction:.0%} of each step (input-bound from {data_wait_high:.0%})",
        fix,
        where=directory,
        figures={
            "read_mb_s": float(read_mb_s),
            "needed_mb_s": float(needed_mb_s),
            "data_wait_fraction": float(data_wait_fraction),
            "files_read": float(files_read),
        },
    )
