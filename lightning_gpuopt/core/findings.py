"""Known slow patterns in users' training code, each decided from measured numbers.

A :class:`Finding` names one pattern (``kind``), what was measured (``message``), where it is (``where``: an
attribute, a hook, a ``file:line``; ``None``: the whole run), the fix with its value (``fix``) and the numbers
(``figures``), each logged as ``gpuopt/finding/<kind>/<figure>`` (``-`` in the kind becomes ``_``). The probes
(``callbacks/_detect*.py``) measure on a few sampled steps; these functions decide. Kinds and their figures:

* ``"graph-kept"`` -- a module attribute holds a growing autograd graph (``self.total_loss += loss``): ``attributes``,
  ``graph_nodes``, ``graph_nodes_per_step``, ``memory_growth_bytes``, ``memory_growth_bytes_per_step`` (memory known);
* ``"host-sync"`` -- card-to-host reads (``.item()``, ``if loss > 0:``) in warm-up steps 1 and 2, by ``file:line``:
  ``syncs_per_step``, ``user_syncs_per_step``, ``lightning_syncs_per_step``, ``lines``;
* ``"slow-hook"`` -- a callback or module hook takes a large share of training time: ``seconds``, ``calls``,
  ``ms_per_call``, ``share``, ``suggested_every_n``;
* ``"checkpoint-time"`` -- checkpoint saves take a large share of the fit: ``saves``, ``seconds``, ``ms_per_save``,
  ``share``, ``suggested_interval``, ``checkpoint_mb``;
* ``"data-parallel"`` -- ``nn.DataParallel`` inside the module: ``wrappers``;
* ``"oversubscribed"`` -- intra-op threads x processes exceed the cores: ``threads``, ``cores``, ``suggested_threads``;
* ``"tf32-off"`` -- float32 matmuls without TF32 on a card with TF32 tensor cores: ``compute_capability``;
* ``"cudnn-benchmark-off"`` -- convolutions on fixed input shapes, ``cudnn.benchmark`` off: ``convolutions``;
* ``"channels-last"`` -- convolutions under mixed precision in NCHW: ``convolutions_nchw``, ``input_nchw``;
* ``"slow-disk"`` -- the dataset's files read slower than training consumes them: ``read_mb_s``, ``needed_mb_s``,
  ``data_wait_fraction``, ``files_read``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

FINDING_KINDS = ("graph-kept", "host-sync", "slow-hook", "checkpoint-time", "data-parallel", "oversubscribed",
                 "tf32-off", "cudnn-benchmark-off", "channels-last", "slow-disk")  # fmt: skip
#: shares of training time from which a hook, checkpoint saving is a finding; the share the fix brings it to
SLOW_HOOK_SHARE = CHECKPOINT_SHARE = 0.10
TARGET_SHARE = 0.02
DISK_MARGIN = 1.5  #: the dataset's files are slow when read below this many times the rate training needs


@dataclass
class Finding:
    """One slow pattern found in a run (fields: module docstring)."""

    kind: str
    message: str
    fix: str
    where: Optional[str] = None
    figures: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"Finding kind={self.kind!r} is not one of {', '.join(FINDING_KINDS)}")


def graph_kept(
    steps: Sequence[int],
    graph_nodes: Mapping[str, Sequence[int]],
    live_bytes: Sequence[Optional[int]] = (),
    containers: Sequence[str] = (),
) -> Optional[Finding]:
    """Attributes whose autograd graph (``graph_nodes[path][i]`` nodes as ``steps[i]`` starts) is held at two or more
    samples and grows; ``live_bytes[i]``: allocated memory (only reported); ``containers``: list/tuple/dict paths."""
    found: list[tuple[str, list[int], list[int], Optional[int]]] = []
    for path, nodes in graph_nodes.items():
        held = [i for i, count in enumerate(nodes) if count > 0]
        if len(held) < 2 or nodes[held[-1]] <= nodes[held[0]]:
            continue
        known = [i for i in held if i < len(live_bytes) and live_bytes[i] is not None]
        growth = live_bytes[known[-1]] - live_bytes[known[0]] if len(known) >= 2 else None  # type: ignore[operator]
        found.append((path, [steps[i] for i in held], [nodes[i] for i in held], growth))
    if not found:
        return None
    found.sort(key=lambda item: item[2][-1] - item[2][0], reverse=True)
    path, held_steps, nodes, growth = found[0]
    span = max(1, held_steps[-1] - held_steps[0])
    others = f" (also {', '.join(f'`{item[0]}`' for item in found[1:])})" if len(found) > 1 else ""
    figures = {"attributes": float(len(found)), "graph_nodes": float(nodes[-1])}
    figures["graph_nodes_per_step"] = (nodes[-1] - nodes[0]) / span
    memory = ""
    if growth is not None:
        figures |= {"memory_growth_bytes": float(growth), "memory_growth_bytes_per_step": growth / span}
        memory = f"; live memory at step start grew by {growth / 2**20:.1f} MiB over those steps"
    counts, starts = " → ".join(map(str, nodes)), ", ".join(map(str, held_steps))
    message = f"`{path}`{others} holds a tensor with an autograd graph (grad_fn) between steps, and the graph grows:"
    message += f" {counts} autograd nodes at the starts of steps {starts}{memory}. Every step's graph stays reachable"
    message += " from the module, so memory and the time of a backward through it grow over the run"
    fix = "keep no graph across steps: accumulate `loss.detach()` (or `loss.item()` at epoch end) instead of `loss`:"
    fix += f" `self.{path}.append(loss.detach())`" if path in containers else f" `self.{path} += loss.detach()`"
    where = ", ".join(item[0] for item in found)
    return Finding("graph-kept", message, fix, where, figures)


def host_sync(
    steps: Sequence[int], user_reads: Sequence[int], lightning_reads: Sequence[int], lines: Mapping[str, int]
) -> Optional[Finding]:
    """Card-to-host reads: ``user_reads[i]`` and ``lightning_reads[i]`` in step ``steps[i]``; ``lines``: the user's
    ``file:line`` and their counts. Found from one user read per step."""
    if not steps:
        return None
    user, lightning = sum(user_reads) / len(steps), sum(lightning_reads) / len(steps)
    if user < 1:
        return None
    per_line = sorted(lines.items(), key=lambda item: item[1], reverse=True)
    shown = ", ".join(f"{line} ({count / len(steps):g}/step)" for line, count in per_line)
    where = ", ".join(line for line, _ in per_line) or None
    lightning_note = f" (and {lightning:g} by Lightning itself)" if lightning else ""
    figures = {"syncs_per_step": user + lightning, "user_syncs_per_step": user}
    figures |= {"lightning_syncs_per_step": lightning, "lines": float(len(lines))}
    message = f"{user:g} read(s) from the GPU to the host per step in your code{lightning_note}, over steps"
    message += f" {', '.join(map(str, steps))}: each (`.item()`, `float(t)`, `.cpu()`, `bool(t)`, `if loss > 0:`) waits"
    message += " until the GPU has finished every queued kernel, so the host cannot queue ahead"
    fix = f"at {where or 'those lines'}: keep the values as tensors on the GPU; log them with"
    fix += " `self.log(name, value, on_step=True)` (read once every log_every_n_steps), take `.item()` only every N"
    fix += " steps or at epoch end, and branch with tensor ops (`torch.where`) instead of `if tensor:`"
    return Finding("host-sync", message + (f"; at {shown}" if shown else ""), fix, where, figures)


def data_parallel(wrapped: Sequence[str]) -> Optional[Finding]:
    """``nn.DataParallel`` found at the module paths ``wrapped`` (``""`` is the module itself)."""
    if not wrapped:
        return None
    names = ", ".join(f"`{path or 'the LightningModule itself'}`" for path in wrapped)
    message = f"nn.DataParallel wraps {names}: one process drives every GPU, scatters each batch and gathers the"
    message += " outputs on GPU 0 every step, under the GIL"
    fix = "remove the nn.DataParallel wrapper and let Lightning replicate the model: Trainer(strategy='ddp', devices=N)"
    where = ", ".join(path or "<module>" for path in wrapped)
    return Finding("data-parallel", message, fix, where, {"wrappers": float(len(wrapped))})


def oversubscription(threads_per_process: int, processes: int, cores: int) -> Optional[Finding]:
    """Intra-op threads x processes on the host against its usable cores."""
    wanted = threads_per_process * processes
    if cores < 1 or wanted <= cores:
        return None
    fair = max(1, cores // max(1, processes))
    message = f"{processes} process(es) x {threads_per_process} intra-op threads = {wanted} threads on {cores} usable"
    message += " core(s): threads wait for each other and each op gets slower"
    fix = f"torch.set_num_threads({fair}) in each process (or OMP_NUM_THREADS={fair}): {processes} processes x"
    figures = {"threads": float(wanted), "cores": float(cores), "suggested_threads": float(fair)}
    return Finding("oversubscribed", message, f"{fix} {fair} threads = {processes * fair} cores", None, figures)


def tf32_off(capability: Optional[tuple[int, int]], matmul_precision: str, precision: str) -> Optional[Finding]:
    """A ``32-true`` run's float32 matmuls at precision ``"highest"`` on a card with TF32 (capability >= 8.0)."""
    if capability is None or capability < (8, 0) or matmul_precision != "highest" or precision not in ("32-true", "32"):
        return None
    message = f"float32 matmuls run in full precision on a card of compute capability {capability[0]}.{capability[1]}"
    message += " whose TF32 tensor cores do them several times faster"
    message += " (torch.get_float32_matmul_precision() is 'highest')"
    fix = "torch.set_float32_matmul_precision('high') before Trainer(...): float32 matmuls on TF32 tensor cores"
    return Finding("tf32-off", message, fix, None, {"compute_capability": capability[0] + capability[1] / 10})


def cudnn_benchmark_off(benchmark: bool, convolutions: int, input_shapes_seen: int) -> Optional[Finding]:
    """Convolutions on one fixed batch shape over the sampled steps with ``cudnn.benchmark`` off."""
    if benchmark or convolutions == 0 or input_shapes_seen != 1:
        return None
    message = f"{convolutions} convolution(s) run on one fixed input shape with torch.backends.cudnn.benchmark off:"
    message += " cuDNN uses its heuristic choice of algorithm, not the fastest"
    fix = "Trainer(benchmark=True): cuDNN times its algorithms once per input shape and keeps the fastest"
    return Finding("cudnn-benchmark-off", message, fix, None, {"convolutions": float(convolutions)})


def channels_last(
    precision: str, not_channels_last: Sequence[str], inputs_not_channels_last: bool
) -> Optional[Finding]:
    """2-D convolutions under mixed precision whose weights (``not_channels_last``: paths) or 4-D inputs are NCHW."""
    reduced = "mixed" in precision or precision in ("16-true", "bf16-true")
    if not reduced or not (not_channels_last or inputs_not_channels_last):
        return None
    weights = [f"{len(not_channels_last)} Conv2d weight(s)"] if not_channels_last else []
    what = " and ".join(weights + (["the 4-D batch"] if inputs_not_channels_last else []))
    more = f" and {len(not_channels_last) - 3} more" if len(not_channels_last) > 3 else ""
    message = f"{what} in NCHW (contiguous) memory format under {precision}: tensor-core convolution kernels"
    message += " work in NHWC, so each convolution transposes its input and output"
    fix = "model = model.to(memory_format=torch.channels_last) in the LightningModule's __init__ or setup(), and"
    fix += " x = x.to(memory_format=torch.channels_last) for 4-D inputs in training_step"
    figures = {"convolutions_nchw": float(len(not_channels_last)), "input_nchw": float(inputs_not_channels_last)}
    return Finding("channels-last", message, fix, ", ".join(not_channels_last[:3]) + more or None, figures)


def nice_ceil(value: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... not below ``value`` (finite: an interval a user would write)."""
    nice = 1
    while nice < value:
        nice = nice * 5 // 2 if str(nice)[0] == "2" else nice * 2
    return nice


def _reduction_factor(seconds: float, total_s: float) -> float:
    """How many times fewer calls bring ``0 < seconds < total_s`` down to :data:`TARGET_SHARE` of the (shorter)
    total (10 s of 100 s: 5.4, to 1.84 s of 91.84 s)."""
    return seconds * (1 - TARGET_SHARE) / (TARGET_SHARE * (total_s - seconds))


def _share_after(seconds: float, total_s: float, factor: float) -> float:
    return seconds / factor / (max(0.0, total_s - seconds) + seconds / factor)


def slow_hook(
    hook: str,
    total_s: float,
    calls: int,
    train_s: float,
    epochs: int = 1,
    in_module: bool = False,
    threshold: float = SLOW_HOOK_SHARE,
    sampled: Optional[tuple[int, int]] = None,
) -> Optional[Finding]:
    """``hook`` (``"<class>.<hook>"``) ran ``calls`` times for ``total_s`` of ``train_s`` s of training (``sampled``:
    timed in so many of so many steps, scaled). Found from ``threshold`` of it; the fix runs it every ``N`` steps
    (epochs, for a hook run once an epoch or less), ``N`` a 1-2-5 value bringing it to about :data:`TARGET_SHARE`."""
    if calls < 1 or train_s <= 0 or total_s <= 0 or total_s / train_s < threshold:
        return None
    share, per_call = total_s / train_s, total_s / calls
    every = max(2, nice_ceil(_reduction_factor(total_s, train_s) if total_s < train_s else calls))
    owner, name = "self" if in_module else "trainer", hook.rsplit(".", 1)[-1]
    unit, counter = ("steps", "global_step") if calls > max(1, epochs) else ("epochs", "current_epoch")
    fix = f"run it every {every} {unit}: `if {owner}.{counter} % {every} == 0:` around its work in `{name}`"
    fix += f" (about {_share_after(total_s, train_s, every):.1%} of training time)"
    if unit == "steps" and name != "on_train_epoch_end":
        fix += ", or move the work to on_train_epoch_end"
    figures = {"seconds": float(total_s), "calls": float(calls), "ms_per_call": per_call * 1e3, "share": share}
    message = f"{hook} took {total_s:.2f} s over {calls} call(s) ({per_call * 1e3:.1f} ms each), {share:.1%} of"
    message += f" training time ({train_s:.2f} s from train start to end)"
    if sampled and sampled[0] < sampled[1]:  # a per-step hook, timed in some steps
        message += f"; timed in {sampled[0]} of {sampled[1]} steps and scaled"
    return Finding("slow-hook", message, fix, hook, figures | {"suggested_every_n": float(every)})


@dataclass
class CheckpointSaver:
    """What saved checkpoints: a ``ModelCheckpoint`` (``name`` shows its settings) or a hook calling
    ``trainer.save_checkpoint`` (``model_checkpoint=False``, ``name``: ``"<class>.<hook>"``), and its saves."""

    name: str
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
) -> Optional[Finding]:
    """Saving checkpoints against ``fit_s`` (train start to end, ``steps`` steps). Found from :data:`CHECKPOINT_SHARE`;
    the fix scales each saver's interval to a 1-2-5 value bringing saving to about :data:`TARGET_SHARE`, and names
    ``save_last="link"`` and ``save_weights_only=True`` (when the optimizer state is as large as the weights)."""
    saves, seconds = sum(saver.saves for saver in savers), sum(saver.seconds for saver in savers)
    if saves < 1 or fit_s <= 0 or seconds <= 0 or seconds / fit_s < CHECKPOINT_SHARE:
        return None
    share = seconds / fit_s
    factor = _reduction_factor(seconds, fit_s) if seconds < fit_s else float(max(2, saves))
    changes, scales = list[str](), list[float]()
    suggested: Optional[int] = None
    for saver in (saver for saver in savers if saver.saves >= 1):
        if not saver.model_checkpoint:
            current = max(1.0, steps / saver.saves) if steps else 1.0
            new = nice_ceil(current * factor)
            every = f"save every {new} steps: `if trainer.global_step % {new} == 0:`"
            changes.append(f"in {saver.name}, {every} around trainer.save_checkpoint(...)")
        else:
            if saver.every_n_train_steps:
                current, setting = saver.every_n_train_steps, "every_n_train_steps={} → {}"
            elif saver.train_time_interval_s:
                current = saver.train_time_interval_s
                setting = "train_time_interval=timedelta(seconds={:g}) → timedelta(seconds={})"
            else:
                current, setting = saver.every_n_epochs or 1, "every_n_epochs={} → {}"
            new = nice_ceil(current * factor)
            extras = ['save_last=True → "link"'] if saver.save_last is True else []
            if not saver.save_weights_only and parameter_bytes > 0 and optimizer_bytes >= parameter_bytes:
                extras.append("save_weights_only=True")
            changes.append(f"ModelCheckpoint({', '.join([setting.format(current, new), *extras])})")
        scales.append(new / current)
        suggested = suggested or new
    after = _share_after(seconds, fit_s, max(1.0, min(scales, default=1.0)))
    fix = "; ".join(changes) + f" (about {after:.1%} of training time)"
    if any("save_weights_only" in change for change in changes):
        fix += f"; the optimizer state is {optimizer_bytes / 1e6:.1f} MB against {parameter_bytes / 1e6:.1f} MB of"
        fix += " weights, and a weights-only checkpoint cannot resume the optimizer"
    figures = {"saves": float(saves), "seconds": float(seconds), "ms_per_save": 1e3 * seconds / saves, "share": share}
    if suggested is not None:
        figures["suggested_interval"] = float(suggested)
    if checkpoint_bytes:
        figures["checkpoint_mb"] = checkpoint_bytes / 1e6
    size = f", {checkpoint_bytes / 1e6:.1f} MB each" if checkpoint_bytes else ""
    message = f"{saves} checkpoint save(s) took {seconds:.2f} s ({1e3 * seconds / saves:.0f} ms each{size}),"
    message += f" {share:.1%} of training time ({fit_s:.2f} s from train start to end, {steps} steps)"
    where = ", ".join(saver.name for saver in savers if saver.saves) or None
    return Finding("checkpoint-time", message, fix, where, figures)


def slow_disk(
    read_mb_s: float,
    needed_mb_s: float,
    data_wait_fraction: Optional[float],
    data_wait_high: float,
    directory: str,
    files_read: int,
    mb_read: float,
    filesystem: Optional[str] = None,
    bytes_per_sample: Optional[float] = None,
    samples_per_second: Optional[float] = None,
) -> Optional[Finding]:
    """The dataset's files under ``directory`` read at ``read_mb_s`` against ``needed_mb_s``, the rate training
    consumes them: found below :data:`DISK_MARGIN` x that rate on a run waiting for data ``data_wait_high`` of a step."""
    if read_mb_s <= 0 or needed_mb_s <= 0 or data_wait_fraction is None:
        return None
    if read_mb_s >= DISK_MARGIN * needed_mb_s or data_wait_fraction < data_wait_high:
        return None
    in_memory = filesystem in ("tmpfs", "ramfs")
    where_from = f" ({filesystem}: already in memory)" if in_memory else (f" ({filesystem})" if filesystem else "")
    fix = f"copy the dataset to a local SSD or to /dev/shm (RAM): `cp -r {directory} /dev/shm/` (if it fits) and"
    fix += " point the dataset there"
    if in_memory:
        fix = "the files are already in memory: read them in more DataLoader workers (raise num_workers)"
    rate = ""
    if bytes_per_sample and samples_per_second:
        rate = f" ({bytes_per_sample / 1e3:.1f} kB a sample x {samples_per_second:.0f} samples/s)"
    figures = {"read_mb_s": float(read_mb_s), "needed_mb_s": float(needed_mb_s)}
    figures |= {"data_wait_fraction": float(data_wait_fraction), "files_read": float(files_read)}
    message = f"the dataset's files under {directory}{where_from} read at {read_mb_s:.1f} MB/s ({files_read} file(s),"
    message += f" {mb_read:.1f} MB, page cache dropped first) while training consumes {needed_mb_s:.1f} MB/s{rate} and"
    message += f" waits for data {data_wait_fraction:.0%} of each step (input-bound from {data_wait_high:.0%})"
    return Finding("slow-disk", message, fix, directory, figures)
