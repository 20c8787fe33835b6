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
    if path in containers:
        example = f"`{owner}{name}.append(loss.detach())`"
    else:
        example = f"`{owner}{name} += loss.detach()`"
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
        "remove the nn.DataParallel wrapper and let Lightning replicate the model: Trainer(strategy='ddp',"
        " devices=N)",
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


def channels_last(precision: str, not_channels_last: Sequence[str], inputs_not_channels_last: bool) -> Optional[Finding]:
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
    shown = ", ".join(not_channels_last[:3]) + (f" and {len(not_channels_last) - 3} more" if len(not_channels_last) > 3 else "")
    return Finding(
        "channels-last",
        f"{' and '.join(what)} in NCHW (contiguous) memory format under {precision}: tensor-core convolution kernels"
        " work in NHWC, so each convolution transposes its input and output",
        "model = model.to(memory_format=torch.channels_last) in the LightningModule's __init__ or setup(), and"
        " x = x.to(memory_format=torch.channels_last) for 4-D inputs in training_step",
        where=shown or None,
        figures={"convolutions_nchw": float(len(not_channels_last)), "input_nchw": float(inputs_not_channels_last)},
    )
