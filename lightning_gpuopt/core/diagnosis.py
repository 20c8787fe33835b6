"""What bounds a run and what to change, from its measured step totals: :class:`DataWaitReport`.

:func:`diagnose` is a pure function of the totals, the settings in use (:class:`RunSettings`) and the limits
(:class:`Thresholds`); each recommendation reads ``setting=current → suggested: measured reason``. The verdicts
(``"input-bound"``, ``"host-bound"``, ``"compute-bound"``, ``"balanced"``) and their rules: docs/data-wait-monitor.md.
The report (``DataWaitMonitor.report``, the ``"data_wait"`` section of ``gpuopt_report.json``) holds them
with the job's totals, each rank's, the settings, the NVML usage of every GPU, rank 0's timeline and findings."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Optional, Sequence, cast

from lightning_gpuopt.core.checks import check_number
from lightning_gpuopt.core.findings import Finding
from lightning_gpuopt.core.loader import IO_BOUND_WORKERS_PER_CORE
from lightning_gpuopt.core.nvml import GpuUsage
from lightning_gpuopt.core.timing import StepTimeline, StepTotals


@dataclass(frozen=True)
class Thresholds:
    """Limits of the verdict rules (``DataWaitMonitor``'s arguments); the first five are fractions in (0, 1). A
    visible GPU below ``idle_gpu_util`` (%) is idle while another is at least at ``busy_gpu_util``."""

    data_wait_high: float = 0.2
    data_wait_low: float = 0.05
    gpu_idle_high: float = 0.15
    host_overhead_high: float = 0.25
    straggler_slowdown: float = 0.2
    idle_gpu_util: float = 5.0
    busy_gpu_util: float = 20.0

    def __post_init__(self) -> None:
        for limit in fields(self)[:5]:
            value, example = getattr(self, limit.name), f"{limit.name}={limit.default}"
            check_number(limit.name, value, example, low=0, high=1, low_inclusive=False, high_inclusive=False)
        if not self.data_wait_low < self.data_wait_high:
            pair = f"`data_wait_low` ({self.data_wait_low}) must be below `data_wait_high` ({self.data_wait_high})"
            raise ValueError(f"{pair}, e.g. data_wait_low=0.05, data_wait_high=0.2.")
        if not 0 <= self.idle_gpu_util < self.busy_gpu_util <= 100:
            pair = f"`idle_gpu_util` ({self.idle_gpu_util}) and `busy_gpu_util` ({self.busy_gpu_util})"
            raise ValueError(
                f"{pair} must be percentages with 0 <= idle_gpu_util < busy_gpu_util <= 100, e.g. 5 and 20."
            )


@dataclass(frozen=True)
class RunSettings:
    """The settings the run uses, as far as they could be read (``None``: unknown)."""

    device_type: str
    num_workers: Optional[int] = None
    pin_memory: Optional[bool] = None
    persistent_workers: Optional[bool] = None
    prefetch_factor: Optional[int] = None
    batch_size: Optional[int] = None
    usable_cpus: int = 1
    processes_per_host: int = 1
    precision: Optional[str] = None
    num_devices: int = 1
    epochs: int = 1
    worker_startup_s: list[float] = field(default_factory=list)  #: seconds from each epoch's start to its first batch

    cpus_per_process = property(lambda self: max(1, self.usable_cpus // max(1, self.processes_per_host)))


@dataclass(frozen=True)
class Diagnosis:
    """The verdict, its reason, the recommendations, the straggler rank and the idle GPUs (NVML indices)."""

    verdict: str
    reason: str
    recommendations: list[str] = field(default_factory=list)
    straggler_rank: Optional[int] = None
    idle_gpus: list[int] = field(default_factory=list)


def _pct(fraction: Optional[float]) -> str:
    return f"{(fraction or 0.0) * 100:.0f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def classify(totals: StepTotals, thresholds: Thresholds) -> tuple[str, str]:
    """The verdict and a one-line reason with the figures behind it."""
    wait_share, idle, step = totals.data_wait_fraction or 0.0, totals.gpu_idle_fraction, _ms(totals.step_time_s)
    wait = f"data wait is {_pct(wait_share)} of the step ({_ms(totals.data_wait_per_step_s)} of {step})"
    starved = idle is not None and idle >= thresholds.gpu_idle_high
    if wait_share >= thresholds.data_wait_high and (idle is None or starved):
        return "input-bound", wait + (f"; the GPU is idle {_pct(idle)} of the time" if idle is not None else "")
    if starved:
        why = f"the GPU is idle {_pct(idle)} of the time while {wait}: the host does not enqueue work fast enough"
        return "host-bound", f"{why} (Python overhead, synchronisations such as .item(), small kernels)"
    host = (totals.transfer_fraction or 0.0) + (totals.other_fraction or 0.0)
    if idle is None and host >= thresholds.host_overhead_high:
        outside = f"{_pct(host)} of the step ({_ms(host * totals.step_time_s)}) is spent outside data loading"
        parts = f"batch transfer {_pct(totals.transfer_fraction)}, hooks/logging/other {_pct(totals.other_fraction)}"
        return "host-bound", f"{outside} and compute ({parts})"
    if wait_share <= thresholds.data_wait_low or idle is not None:
        return "compute-bound", wait + (f"; the GPU is busy {_pct(1 - idle)} of the time" if idle is not None else "")
    return "balanced", f"{wait}: loading and compute both matter"


def workers_to_keep_up(totals: StepTotals, num_workers: int) -> int:
    """Workers needed so loading keeps pace with the rest of the step (before any core cap): with ``W`` workers
    a batch takes ``f = W·(wait + rest)`` per worker (``f = wait`` when ``W = 0``), so ``ceil(f / rest)``."""
    wait = totals.data_wait_per_step_s
    rest = max(totals.step_time_s - wait, 1e-6)
    per_batch = wait if num_workers == 0 else num_workers * (wait + rest)
    return max(num_workers + 1, math.ceil(per_batch / rest))


def _workers_advice(totals: StepTotals, run: RunSettings, core_text: str) -> str:
    cores, workers, loader_cpu = run.cpus_per_process, run.num_workers or 0, totals.loader_cpu_fraction
    needed = workers_to_keep_up(totals, workers)
    wait = f"the step waits {_ms(totals.data_wait_per_step_s)} of {_ms(totals.step_time_s)} for its batch"
    # in the main process, the CPU time spent fetching tells computing from waiting on I/O
    io_bound = run.num_workers == 0 and loader_cpu is not None and loader_cpu < 0.5
    cap = IO_BOUND_WORKERS_PER_CORE * cores if io_bound else cores
    if workers > 0 and loader_cpu is not None and loader_cpu >= 0.3:
        # with workers, the main thread's CPU time while it waits is spent receiving their batches
        larger = f" (batch_size={run.batch_size} → {2 * run.batch_size})" if run.batch_size else ""
        per_batch = _ms(loader_cpu * totals.data_wait_per_step_s)
        busy = f"the main process is busy {_pct(loader_cpu)} of that wait ({per_batch} per batch) receiving batches"
        more = "from the workers; more workers cannot shorten that, fewer and larger batches amortise it"
        return f"num_workers={run.num_workers}: {wait}, and {busy} {more}{larger}."
    if workers < cap:
        suggested = min(needed, cap)
        need = f"~{needed} would keep up; " if needed > suggested else ""
        why = f"{need}{core_text}"
        if io_bound and suggested > cores:
            why = f"{need}loading waits on I/O: the main process used {_pct(loader_cpu)} of a CPU while fetching,"
            why += f" so workers beyond the {core_text} help"
        return f"num_workers={run.num_workers} → {suggested} ({why}): {wait}."
    uses = f"{'uses all' if run.num_workers == cores else 'already exceeds the'} {core_text}"
    computes = "if loading computes (decoding, augmentation), make it cheaper (cache decoded samples, augment on"
    more = f"the GPU) or add cores; if it waits on storage or network, more workers help: try num_workers={2 * workers}"
    return f"num_workers={run.num_workers} {uses} and {wait}: {computes} {more}."


def recommend(totals: StepTotals, verdict: str, run: RunSettings) -> list[str]:
    """Concrete changes, each naming the setting, its value now, the value to try and why."""
    advice: list[str] = []
    on_gpu, cores, transfer = run.device_type == "cuda", run.cpus_per_process, totals.transfer_fraction or 0.0
    shared = f" per process ({run.usable_cpus} shared by {run.processes_per_host} processes)"
    core_text = f"{cores} usable CPU core{'s' if cores != 1 else ''}" + (shared if run.processes_per_host > 1 else "")
    if verdict in ("input-bound", "balanced") and run.num_workers is not None:
        advice.append(_workers_advice(totals, run, core_text))
    if on_gpu and run.pin_memory is False and (verdict in ("input-bound", "host-bound") or transfer >= 0.05):
        why = f"host-to-device copies take {_pct(transfer)} of the step; pinned memory lets them run asynchronously"
        advice.append(f"pin_memory=False → True: {why}.")
    startup = totals.training_share(totals.worker_startup_s) or 0.0
    if run.num_workers and run.persistent_workers is False and run.epochs > 1 and startup >= 0.02:
        starts = run.worker_startup_s
        cost = f"loader start-up costs {sum(starts) / len(starts):.2f} s at each of {len(starts)} epoch starts"
        advice.append(f"persistent_workers=False → True: {cost} ({_pct(startup)} of training time).")
    if verdict == "host-bound" and run.batch_size:
        overhead = f"per-step host overhead ({_ms(totals.per_step(totals.transfer_s + totals.other_s))})"
        why = "is paid once per step, so a larger batch amortises it (BatchSizeSearch finds the largest that fits)"
        advice.append(f"batch_size={run.batch_size} → {2 * run.batch_size}: {overhead} {why}.")
    if verdict == "compute-bound" and on_gpu and run.precision in ("32-true", "32", None):
        faster = "mixed precision runs matrix products on tensor cores at several times fp32 throughput"
        bottleneck = f"precision={run.precision or '32-true'!r} → 'bf16-mixed': the GPU is the bottleneck"
        advice.append(f"{bottleneck} and {faster}.")
    return advice


def find_idle_gpus(gpus: Sequence[GpuUsage], thresholds: Thresholds) -> list[int]:
    """Visible GPUs idle while another visible GPU worked (NVML indices: a GPU with utilisation is a whole one)."""
    visible = [gpu for gpu in gpus if gpu.visible and gpu.util_mean is not None]
    if not any((gpu.util_mean or 0.0) >= thresholds.busy_gpu_util for gpu in visible):
        return []
    return [cast(int, gpu.index) for gpu in visible if (gpu.util_mean or 0.0) < thresholds.idle_gpu_util]


def _idle_gpu_advice(gpus: Sequence[GpuUsage], idle: Sequence[int], run: RunSettings) -> str:
    busy = [gpu for gpu in gpus if gpu.visible and gpu.index not in idle and gpu.util_mean is not None]
    busy_text, many = ", ".join(f"GPU {gpu.index} at {gpu.util_mean:.0f}%" for gpu in busy), len(idle) > 1
    idle_text = f"GPU{'s' if many else ''} {', '.join(map(str, idle))} {'are' if many else 'is'} visible but idle"
    fix = f"while {busy_text} works; train on all of them (DDP) or hide the idle ones with CUDA_VISIBLE_DEVICES"
    return f"devices={run.num_devices} → {sum(gpu.visible for gpu in gpus)}: {idle_text} {fix}."


def find_straggler(arrival_s: Sequence[float], thresholds: Thresholds, step_time_s: float) -> Optional[int]:
    """The index of the slowest rank to reach the gradient sync (``arrival_s``: per rank, per step) when it is
    ``straggler_slowdown`` slower than the median of the others and the gap is at least 5% of the step."""
    if len(arrival_s) < 2:
        return None
    slowest = max(range(len(arrival_s)), key=lambda rank: arrival_s[rank])
    others = statistics.median(t for rank, t in enumerate(arrival_s) if rank != slowest)
    excess = arrival_s[slowest] - others
    return slowest if excess > thresholds.straggler_slowdown * others and excess >= 0.05 * step_time_s else None


def _straggler_advice(rank: int, slowest: int, arrival_s: Sequence[float], data_wait_s: Sequence[float]) -> str:
    median = statistics.median(t for r, t in enumerate(arrival_s) if r != slowest)
    waits = statistics.median(t for r, t in enumerate(data_wait_s) if r != slowest)
    cause = "its forward pass: check that device's clocks, temperature and other processes on it"
    if data_wait_s[slowest] - waits > 0.5 * (arrival_s[slowest] - median):
        cause = "its dataloader: check that host's workers, CPU contention and storage"
    takes = f"it takes {_ms(arrival_s[slowest])} per step to reach the gradient synchronisation against {_ms(median)}"
    wait = f"for the others (data wait {_ms(data_wait_s[slowest])} vs {_ms(waits)})"
    return f"rank {rank} is a straggler: {takes} {wait}; every rank waits for it. The gap is in {cause}."


def diagnose(
    totals: StepTotals,
    run: RunSettings,
    thresholds: Thresholds,
    gpus: Sequence[GpuUsage] = (),
    ranks: Sequence[StepTotals] = (),
) -> Diagnosis:
    """Verdict, reason and recommendations from the job's ``totals``, every GPU's NVML usage and each rank's."""
    if not totals.steps:
        return Diagnosis("balanced", "no training step was measured")
    verdict, reason = classify(totals, thresholds)
    recommendations = recommend(totals, verdict, run)
    idle = find_idle_gpus(gpus, thresholds)
    if idle:
        recommendations.append(_idle_gpu_advice(gpus, idle, run))
    measured = [rank for rank, figures in enumerate(ranks) if figures.steps]
    arrival = [ranks[rank].arrival_per_step_s for rank in measured]
    slowest = find_straggler(arrival, thresholds, totals.step_time_s)
    if slowest is not None:
        waits = [ranks[rank].data_wait_per_step_s for rank in measured]
        recommendations.append(_straggler_advice(measured[slowest], slowest, arrival, waits))
    return Diagnosis(verdict, reason, recommendations, None if slowest is None else measured[slowest], idle)


class Spread(NamedTuple):
    """Minimum, mean and maximum of one figure over ranks."""

    min: float
    mean: float
    max: float


@dataclass(frozen=True)
class DataWaitReport:
    """What ``DataWaitMonitor`` measured and concluded, the same on every rank (fields: module docstring)."""

    diagnosis: Diagnosis
    totals: StepTotals
    ranks: list[StepTotals]
    settings: RunSettings
    thresholds: Thresholds
    warmup_steps: int = 0
    device: str = "cpu"
    gpus: list[GpuUsage] = field(default_factory=list)
    timeline: Optional[StepTimeline] = None
    findings: list[Finding] = field(default_factory=list)

    verdict = property(lambda self: self.diagnosis.verdict, doc="The diagnosis's verdict (``str``).")
    verdict_reason = property(lambda self: self.diagnosis.reason, doc="Its reason, with the figures (``str``).")
    recommendations = property(lambda self: self.diagnosis.recommendations, doc="Its changes to try (``list[str]``).")
    data_wait_fraction = property(lambda self: self.totals.data_wait_fraction, doc="Of the job's totals.")
    gpu_idle_fraction = property(lambda self: self.totals.gpu_idle_fraction, doc="Of the job's totals.")
    world_size = property(lambda self: len(self.ranks), doc="The ranks that reported (``int``).")

    @property
    def rank_spread(self) -> dict[str, Spread]:
        """Under DDP, min/mean/max over the ranks that measured a step of four per-rank figures."""
        measured = [figures for figures in self.ranks if figures.steps]
        if len(self.ranks) < 2 or not measured:
            return {}
        names = ("step_time_s", "data_wait_per_step_s", "arrival_per_step_s", "samples_per_second")
        values = {name: [getattr(figures, name) or 0.0 for figures in measured] for name in names}
        return {name: Spread(min(v), statistics.fmean(v), max(v)) for name, v in values.items()}


def data_wait_report(
    ranks: Sequence[StepTotals],
    settings: RunSettings,
    thresholds: Thresholds,
    gpus: Sequence[GpuUsage] = (),
    warmup_steps: int = 0,
    device: str = "cpu",
    timeline: Optional[StepTimeline] = None,
) -> DataWaitReport:
    """Combine each rank's totals (in rank order) and diagnose them (findings: none yet): the job's seconds, steps
    and utilisation are their means over the ranks that measured a step, its samples their sum."""
    measured = [figures for figures in ranks if figures.steps] or list(ranks)
    utils = [figures.gpu_util_mean for figures in measured if figures.gpu_util_mean is not None]
    names = [name for name in StepTotals.__dataclass_fields__ if name.endswith("_s")]
    seconds = {name: statistics.fmean(getattr(figures, name) for figures in measured) for name in names}
    util = statistics.fmean(utils) if utils else None
    steps, samples = round(statistics.fmean(f.steps for f in measured)), sum(f.samples for f in measured)
    totals = StepTotals(steps, samples, gpu_util_mean=util, **seconds)
    report = (list(ranks), settings, thresholds, warmup_steps, device, list(gpus), timeline)
    return DataWaitReport(diagnose(totals, settings, thresholds, gpus, ranks), totals, *report)
