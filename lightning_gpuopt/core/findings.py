"""Known slow patterns in users' training code, each found from measured numbers.

A :class:`Finding` names one pattern (``kind``), says what was measured (``message``, with the
numbers, and ``figures``, the same numbers as a dict), where it is (``where``: an attribute, a
hook, a ``file:line``), and what to change, with the value (``fix``). ``DataWaitMonitor``
collects them in ``report.findings``; the functions here only decide, from figures its
callback side measured on a few sampled steps, so each is tested on numbers as well as on a
real run with and without the pattern.

Kinds (:data:`FINDING_KINDS`):

* ``"graph-kept"`` -- a module attribute holds a tensor with ``grad_fn`` between steps and its
  autograd graph grows step over step (``self.total_loss += loss``);
* ``"host-sync"`` -- ``.item()``, ``.cpu()``, ``bool(tensor)``, ``print(loss)``: device-to-host
  reads per step;
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
from typing import Optional, Sequence

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
