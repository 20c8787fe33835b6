"""Verdicts and concrete recommendations from measured step figures.

Given where the step time went (:class:`StepShares`), the loader and run settings in use
(:class:`RunSettings`) and the thresholds (:class:`Thresholds`), :func:`diagnose` names what
bounds the run and what to change, each recommendation in the form
``setting=current → suggested: measured reason``.

Verdicts, checked in this order:

* ``"input-bound"`` -- data wait is at least ``data_wait_high`` of the step time (on a GPU,
  only when the GPU is also idle at least ``gpu_idle_high`` of the time: a wait that
  overlaps GPU work costs nothing);
* ``"host-bound"`` -- on a GPU, it is idle at least ``gpu_idle_high`` of the time although
  data wait is low; on a CPU, transfer plus other host work (hooks, logging, Python) is at
  least ``host_overhead_high`` of the step;
* ``"compute-bound"`` -- data wait is at most ``data_wait_low``;
* ``"balanced"`` -- in between: loading and compute both matter.

Example::

    >>> shares = StepShares(data_wait=0.62, transfer=0.0, compute=0.35, other=0.03, gpu_idle=None,
    ...                     step_time_s=0.1, data_wait_per_step_s=0.062)
    >>> run = RunSettings(device_type="cpu", num_workers=0, pin_memory=False, usable_cpus=2)
    >>> diagnose(shares, run, Thresholds()).verdict
    'input-bound'
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, cast

from lightning_gpuopt.core.checks import check_number
from lightning_gpuopt.core.findings import Finding
from lightning_gpuopt.core.loader import IO_BOUND_WORKERS_PER_CORE
from lightning_gpuopt.core.nvml import GpuUsage
from lightning_gpuopt.core.timing import StepTimeline

VERDICTS = ("input-bound", "compute-bound", "host-bound", "balanced")


@dataclass(frozen=True)
class Thresholds:
    """Limits the verdict rules use; every one a fraction in (0, 1).

    Args:
        data_wait_high: data wait share of the step from which a run is input-bound.
        data_wait_low: data wait share up to which a run is compute-bound.
        gpu_idle_high: GPU idle share from which the GPU is starved.
        host_overhead_high: on CPU, share of transfer + other host work from which a run
            is host-bound.
        straggler_slowdown: a rank is a straggler when it takes this much longer than the
            median of the other ranks to deliver its batch (0.2 = 20% slower).
        idle_gpu_util: a visible GPU whose mean utilisation (%) is below this is idle.
        busy_gpu_util: ... while another visible GPU's mean utilisation (%) is at least this.
    """

    data_wait_high: float = 0.2
    data_wait_low: float = 0.05
    gpu_idle_high: float = 0.15
    host_overhead_high: float = 0.25
    straggler_slowdown: float = 0.2
    idle_gpu_util: float = 5.0
    busy_gpu_util: float = 20.0

    def __post_init__(self) -> None:
        for name, default in (
            ("data_wait_high", 0.2),
            ("data_wait_low", 0.05),
            ("gpu_idle_high", 0.15),
            ("host_overhead_high", 0.25),
            ("straggler_slowdown", 0.2),
        ):
            check_number(
                name, getattr(self, name), f"{name}={default}", low=0, high=1, low_inclusive=False, high_inclusive=False
            )
        if not self.data_wait_low < self.data_wait_high:
            raise ValueError(
                f"`data_wait_low` ({self.data_wait_low}) must be below `data_wait_high` ({self.data_wait_high}),"
                " e.g. data_wait_low=0.05, data_wait_high=0.2."
            )
        if not 0 <= self.idle_gpu_util < self.busy_gpu_util <= 100:
            raise ValueError(
                f"`idle_gpu_util` ({self.idle_gpu_util}) and `busy_gpu_util` ({self.busy_gpu_util}) must be"
                " percentages with 0 <= idle_gpu_util < busy_gpu_util <= 100, e.g. 5 and 20."
            )


@dataclass
class StepShares:
    """Where the measured step time went, as fractions of it, plus two absolute figures."""

    data_wait: float
    transfer: float
    compute: float
    other: float
    gpu_idle: Optional[float]
    step_time_s: float
    data_wait_per_step_s: float
    startup: float = 0.0  # share of all training time spent starting the loader at epoch starts
    # main-thread CPU seconds per second of data wait: loading in the main process (num_workers=0),
    # or receiving batches from workers
    loader_cpu: Optional[float] = None


@dataclass
class RunSettings:
    """The settings the run uses, as far as they could be read (``None`` = unknown)."""

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
    worker_startup_s: list[float] = field(default_factory=list)

    @property
    def cpus_per_process(self) -> int:
        return max(1, self.usable_cpus // max(1, self.processes_per_host))


@dataclass
class Diagnosis:
    verdict: str
    reason: str
    recommendations: list[str]
    straggler_rank: Optional[int] = None


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def classify(shares: StepShares, thresholds: Thresholds) -> tuple[str, str]:
    """The verdict and a one-line reason with the figures behind it."""
    wait = (
        f"data wait is {_pct(shares.data_wait)} of the step"
        f" ({_ms(shares.data_wait_per_step_s)} of {_ms(shares.step_time_s)})"
    )
    gpu_starved = shares.gpu_idle is not None and shares.gpu_idle >= thresholds.gpu_idle_high
    if shares.data_wait >= thresholds.data_wait_high and (shares.gpu_idle is None or gpu_starved):
        idle = f"; the GPU is idle {_pct(shares.gpu_idle)} of the time" if shares.gpu_idle is not None else ""
        return "input-bound", f"{wait}{idle}"
    if gpu_starved and shares.gpu_idle is not None:  # (gpu_starved implies it; said again for mypy)
        return "host-bound", (
            f"the GPU is idle {_pct(shares.gpu_idle)} of the time while {wait}: the host does not"
            " enqueue work fast enough (Python overhead, synchronisations such as .item(), small kernels)"
        )
    host = shares.transfer + shares.other
    if shares.gpu_idle is None and host >= thresholds.host_overhead_high:
        return "host-bound", (
            f"{_pct(host)} of the step ({_ms(host * shares.step_time_s)}) is spent outside data loading and"
            f" compute (batch transfer {_pct(shares.transfer)}, hooks/logging/other {_pct(shares.other)})"
        )
    if shares.data_wait <= thresholds.data_wait_low or (shares.gpu_idle is not None and not gpu_starved):
        busy = f"; the GPU is busy {_pct(1 - shares.gpu_idle)} of the time" if shares.gpu_idle is not None else ""
        return "compute-bound", f"{wait}{busy}"
    return "balanced", f"{wait}: loading and compute both matter"


def workers_to_keep_up(shares: StepShares, num_workers: int) -> int:
    """Workers needed so loading keeps pace with the rest of the step (before any core cap).

    With ``W`` workers a batch takes ``f = W·(wait + rest)`` per worker (``f = wait`` in
    the main process when ``W = 0``); keeping up with ``rest`` needs ``ceil(f / rest)``.
    """
    wait = shares.data_wait_per_step_s
    rest = max(shares.step_time_s - wait, 1e-6)
    per_batch = wait if num_workers == 0 else num_workers * (wait + rest)
    return max(num_workers + 1, math.ceil(per_batch / rest))


def _workers_advice(shares: StepShares, run: RunSettings, core_text: str) -> str:
    cores = run.cpus_per_process
    needed = workers_to_keep_up(shares, run.num_workers or 0)
    wait = f"the step waits {_ms(shares.data_wait_per_step_s)} of {_ms(shares.step_time_s)} for its batch"
    # In the main process (num_workers=0) the CPU time spent fetching tells computing from waiting on I/O.
    io_bound = run.num_workers == 0 and shares.loader_cpu is not None and shares.loader_cpu < 0.5
    cap = IO_BOUND_WORKERS_PER_CORE * cores if io_bound else cores
    receiving = (run.num_workers or 0) > 0 and shares.loader_cpu is not None and shares.loader_cpu >= 0.3
    if receiving:
        # with workers, the main thread's CPU time while it waits is spent receiving batches
        # from them (unpickling, shared-memory handles): more workers cannot shorten it
        cpu_ms = _ms((shares.loader_cpu or 0.0) * shares.data_wait_per_step_s)
        larger = f" (batch_size={run.batch_size} → {2 * run.batch_size})" if run.batch_size else ""
        return (
            f"num_workers={run.num_workers}: {wait}, and the main process is busy {_pct(shares.loader_cpu or 0.0)}"
            f" of that wait ({cpu_ms} per batch) receiving batches from the workers; more workers cannot shorten"
            f" that, fewer and larger batches amortise it{larger}."
        )
    if (run.num_workers or 0) < cap:
        suggested = min(needed, cap)
        need = f"~{needed} would keep up; " if needed > suggested else ""
        if io_bound and suggested > cores:
            why = (
                f"{need}loading waits on I/O: the main process used {_pct(shares.loader_cpu or 0.0)} of a CPU while"
                f" fetching, so workers beyond the {core_text} help"
            )
        else:
            why = f"{need}{core_text}"
        return f"num_workers={run.num_workers} → {suggested} ({why}): {wait}."
    return (
        f"num_workers={run.num_workers} {'uses all' if run.num_workers == cores else 'already exceeds the'}"
        f" {core_text} and {wait}: if loading computes (decoding,"
        " augmentation), make it cheaper (cache decoded samples, augment on the GPU) or add cores; if it waits"
        f" on storage or network, more workers help: try num_workers={2 * (run.num_workers or 0)}."
    )


def recommend(shares: StepShares, verdict: str, run: RunSettings, thresholds: Thresholds) -> list[str]:
    """Concrete changes, each naming the setting, its value now, the value to try and why."""
    advice: list[str] = []
    on_gpu = run.device_type == "cuda"
    cores = run.cpus_per_process
    core_text = f"{cores} usable CPU core{'s' if cores != 1 else ''}" + (
        f" per process ({run.usable_cpus} shared by {run.processes_per_host} processes)"
        if run.processes_per_host > 1
        else ""
    )
    if verdict in ("input-bound", "balanced") and run.num_workers is not None:
        advice.append(_workers_advice(shares, run, core_text))
    if on_gpu and run.pin_memory is False and (verdict in ("input-bound", "host-bound") or shares.transfer >= 0.05):
        advice.append(
            f"pin_memory=False → True: host-to-device copies take {_pct(shares.transfer)} of the step;"
            " pinned memory lets them run asynchronously."
        )
    if run.num_workers and run.persistent_workers is False and run.epochs > 1 and shares.startup >= 0.02:
        startup_total = sum(run.worker_startup_s)
        advice.append(
            f"persistent_workers=False → True: loader start-up costs {startup_total / len(run.worker_startup_s):.2f} s"
            f" at each of {len(run.worker_startup_s)} epoch starts ({_pct(shares.startup)} of training time)."
        )
    if verdict == "host-bound" and run.batch_size:
        advice.append(
            f"batch_size={run.batch_size} → {2 * run.batch_size}: per-step host overhead"
            f" ({_ms((shares.transfer + shares.other) * shares.step_time_s)}) is paid once per step, so a"
            " larger batch amortises it (BatchSizeSearch finds the largest that fits)."
        )
    if verdict == "compute-bound" and on_gpu and run.precision in ("32-true", "32", None):
        advice.append(
            f"precision={run.precision or '32-true'!r} → 'bf16-mixed': the GPU is the bottleneck and mixed"
            " precision runs matrix products on tensor cores at several times fp32 throughput."
        )
    return advice


def find_idle_gpus(gpus: Sequence[GpuUsage], thresholds: Thresholds) -> list[int]:
    """Visible GPUs that sat idle while another visible GPU worked (NVML indices)."""
    visible = [gpu for gpu in gpus if gpu.visible and gpu.util_mean is not None]
    if not any((gpu.util_mean or 0.0) >= thresholds.busy_gpu_util for gpu in visible):  # (never None here)
        return []
    # a whole GPU (the only kind with utilisation) has an NVML index
    return [cast(int, gpu.index) for gpu in visible if (gpu.util_mean or 0.0) < thresholds.idle_gpu_util]


def idle_gpu_advice(gpus: Sequence[GpuUsage], idle: Sequence[int], run: RunSettings) -> Optional[str]:
    if not idle:
        return None
    busy = [gpu for gpu in gpus if gpu.visible and gpu.index not in idle and gpu.util_mean is not None]
    busy_text = ", ".join(f"GPU {gpu.index} at {gpu.util_mean:.0f}%" for gpu in busy)
    visible = sum(gpu.visible for gpu in gpus)
    idle_text = ", ".join(str(i) for i in idle)
    return (
        f"devices={run.num_devices} → {visible}: GPU{'s' if len(idle) > 1 else ''} {idle_text}"
        f" {'are' if len(idle) > 1 else 'is'} visible but idle while {busy_text} works; train on all of them"
        " (DDP) or hide the idle ones with CUDA_VISIBLE_DEVICES."
    )


def find_straggler(arrival_s: Sequence[float], thresholds: Thresholds, step_time_s: float) -> Optional[int]:
    """The rank that takes longest to deliver its batch, when it is a straggler.

    ``arrival_s`` is, per rank, the mean time per step spent before the gradient
    synchronisation (data wait + transfer + forward): under DDP every rank waits for the
    slowest at the all-reduce, so step times are equal and only this part tells them apart.
    A rank is named when it is ``straggler_slowdown`` slower than the median of the other
    ranks and the difference is at least 5% of the step (microseconds of jitter never are).
    """
    if len(arrival_s) < 2:
        return None
    slowest = max(range(len(arrival_s)), key=lambda rank: arrival_s[rank])
    others = statistics.median(t for rank, t in enumerate(arrival_s) if rank != slowest)
    excess = arrival_s[slowest] - others
    if excess > thresholds.straggler_slowdown * others and excess >= 0.05 * step_time_s:
        return slowest
    return None


def straggler_advice(rank: int, arrival_s: Sequence[float], data_wait_s: Sequence[float]) -> str:
    others = [t for r, t in enumerate(arrival_s) if r != rank]
    median = statistics.median(others)
    waits = statistics.median(t for r, t in enumerate(data_wait_s) if r != rank)
    cause = (
        "its dataloader: check that host's workers, CPU contention and storage"
        if data_wait_s[rank] - waits > 0.5 * (arrival_s[rank] - median)
        else "its forward pass: check that device's clocks, temperature and other processes on it"
    )
    return (
        f"rank {rank} is a straggler: it takes {_ms(arrival_s[rank])} per step to reach the gradient"
        f" synchronisation against {_ms(median)} for the others (data wait {_ms(data_wait_s[rank])} vs"
        f" {_ms(waits)}); every rank waits for it. The gap is in {cause}."
    )


def diagnose(
    shares: StepShares,
    run: RunSettings,
    thresholds: Thresholds,
    gpus: Sequence[GpuUsage] = (),
    rank_arrival_s: Sequence[float] = (),
    rank_data_wait_s: Sequence[float] = (),
) -> Diagnosis:
    """Verdict, reason and recommendations for one run's measured figures.

    Args:
        shares: where the step time went (under DDP, the mean over ranks).
        run: the settings in use.
        thresholds: verdict limits.
        gpus: NVML usage per GPU, to flag visible GPUs that sat idle.
        rank_arrival_s: per rank, mean seconds per step before the gradient sync.
        rank_data_wait_s: per rank, mean data wait per step.
    """
    verdict, reason = classify(shares, thresholds)
    recommendations = recommend(shares, verdict, run, thresholds)
    gpu_advice = idle_gpu_advice(gpus, find_idle_gpus(gpus, thresholds), run)
    if gpu_advice:
        recommendations.append(gpu_advice)
    straggler = find_straggler(rank_arrival_s, thresholds, shares.step_time_s)
    if straggler is not None:
        recommendations.append(straggler_advice(straggler, rank_arrival_s, rank_data_wait_s))
    return Diagnosis(verdict, reason, recommendations, straggler)


@dataclass
class RankFigures:
    """One rank's measured sums (seconds unless named otherwise), gathered across ranks."""

    rank: int
    steps: int
    samples: int
    wall_s: float
    data_wait_s: float
    data_wait_cpu_s: float
    transfer_s: float
    compute_s: float
    forward_s: float
    validation_s: float
    checkpoint_s: float
    worker_startup_s: float
    gpu_busy_s: float
    gpu_idle_s: float
    gpu_util_mean: Optional[float]

    def to_vector(self) -> list[float]:
        """All fields as floats (``None`` as NaN), for an all-gather."""
        return [math.nan if value is None else float(value) for value in vars(self).values()]

    @classmethod
    def from_vector(cls, vector: Sequence[float]) -> RankFigures:
        names = list(cls.__dataclass_fields__)
        values: dict[str, Any] = dict(zip(names, vector))
        for name in ("rank", "steps", "samples"):
            values[name] = round(values[name])
        values["gpu_util_mean"] = None if math.isnan(values["gpu_util_mean"]) else values["gpu_util_mean"]
        return cls(**values)

    @property
    def arrival_per_step_s(self) -> float:
        """Mean time per step before the gradient sync: data wait + transfer + forward."""
        return (self.data_wait_s + self.transfer_s + self.forward_s) / self.steps if self.steps else 0.0

    @property
    def data_wait_per_step_s(self) -> float:
        return self.data_wait_s / self.steps if self.steps else 0.0

    @property
    def step_time_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0


@dataclass
class Spread:
    """Minimum, mean and maximum of one figure over ranks."""

    min: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.fmean(values), max(values))


@dataclass
class DataWaitReport:
    """What ``DataWaitMonitor`` measured and concluded. Time sums are per rank (mean over ranks
    under DDP); ``samples_per_second`` is the whole job's."""

    steps: int
    warmup_steps: int
    epochs: int
    world_size: int
    device: str
    wall_s: float
    data_wait_s: float
    transfer_s: float
    compute_s: float
    other_s: float
    validation_s: float
    checkpoint_s: float
    worker_startup_s: float
    step_time_s: Optional[float]
    data_wait_fraction: Optional[float]
    loader_cpu_fraction: Optional[float]
    transfer_fraction: Optional[float]
    compute_fraction: Optional[float]
    other_fraction: Optional[float]
    validation_fraction: Optional[float]
    checkpoint_fraction: Optional[float]
    gpu_idle_fraction: Optional[float]
    gpu_util_mean: Optional[float]
    samples: int
    samples_per_second: Optional[float]
    verdict: str
    verdict_reason: str
    recommendations: list[str]
    settings: RunSettings
    thresholds: Thresholds
    gpus: list[GpuUsage] = field(default_factory=list)
    idle_gpus: list[int] = field(default_factory=list)
    ranks: list[RankFigures] = field(default_factory=list)
    rank_spread: dict[str, Spread] = field(default_factory=dict)
    straggler_rank: Optional[int] = None
    #: this rank's measured steps over training, binned (rank 0's in the JSON report); ``None``: not measured
    timeline: Optional[StepTimeline] = None
    #: known slow patterns found on this rank's sampled steps (rank 0's in the JSON report)
    findings: list[Finding] = field(default_factory=list)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def build_data_wait_report(
    ranks: Sequence[RankFigures],
    run: RunSettings,
    thresholds: Thresholds,
    gpus: Sequence[GpuUsage] = (),
    warmup_steps: int = 0,
    device: str = "cpu",
) -> DataWaitReport:
    """Aggregate per-rank figures, diagnose them, and return the report (same on every rank)."""
    ranks = sorted(ranks, key=lambda figures: figures.rank)
    measured = [figures for figures in ranks if figures.steps > 0] or list(ranks)

    def mean_of(name: str) -> float:
        return _mean([getattr(figures, name) for figures in measured])

    wall = mean_of("wall_s")
    sums = {name: mean_of(name) for name in ("data_wait_s", "transfer_s", "compute_s")}
    loader_cpu = min(1.0, mean_of("data_wait_cpu_s") / sums["data_wait_s"]) if sums["data_wait_s"] > 0 else None
    other = max(0.0, wall - sum(sums.values()))
    validation, checkpoint, startup = mean_of("validation_s"), mean_of("checkpoint_s"), mean_of("worker_startup_s")
    everything = wall + validation + checkpoint + startup
    steps = round(mean_of("steps"))
    gpu_busy, gpu_idle = mean_of("gpu_busy_s"), mean_of("gpu_idle_s")
    gpu_idle_fraction = (
        gpu_idle / (gpu_busy + gpu_idle) if run.device_type == "cuda" and gpu_busy + gpu_idle > 0 else None
    )
    utils = [figures.gpu_util_mean for figures in measured if figures.gpu_util_mean is not None]
    samples = sum(figures.samples for figures in measured)

    def share(seconds: float, total: float) -> Optional[float]:
        return seconds / total if total > 0 else None

    report = DataWaitReport(
        steps=steps,
        warmup_steps=warmup_steps,
        epochs=run.epochs,
        world_size=len(ranks),
        device=device,
        wall_s=wall,
        data_wait_s=sums["data_wait_s"],
        transfer_s=sums["transfer_s"],
        compute_s=sums["compute_s"],
        other_s=other,
        validation_s=validation,
        checkpoint_s=checkpoint,
        worker_startup_s=startup,
        step_time_s=wall / steps if steps else None,
        data_wait_fraction=share(sums["data_wait_s"], wall),
        loader_cpu_fraction=loader_cpu,
        transfer_fraction=share(sums["transfer_s"], wall),
        compute_fraction=share(sums["compute_s"], wall),
        other_fraction=share(other, wall),
        validation_fraction=share(validation, everything),
        checkpoint_fraction=share(checkpoint, everything),
        gpu_idle_fraction=gpu_idle_fraction,
        gpu_util_mean=_mean(utils) if utils else None,
        samples=samples,
        samples_per_second=samples / wall if wall > 0 and samples else None,
        verdict="balanced",
        verdict_reason="no training step was measured",
        recommendations=[],
        settings=run,
        thresholds=thresholds,
        gpus=list(gpus),
        ranks=list(ranks),
    )
    if len(ranks) > 1:
        report.rank_spread = {
            "step_time_s": Spread.of([figures.step_time_s for figures in measured]),
            "data_wait_per_step_s": Spread.of([figures.data_wait_per_step_s for figures in measured]),
            "arrival_per_step_s": Spread.of([figures.arrival_per_step_s for figures in measured]),
            "samples_per_second": Spread.of(
                [figures.samples / figures.wall_s if figures.wall_s else 0.0 for figures in measured]
            ),
        }
    if not steps or report.step_time_s is None:
        return report
    shares = StepShares(
        data_wait=report.data_wait_fraction or 0.0,
        transfer=report.transfer_fraction or 0.0,
        compute=report.compute_fraction or 0.0,
        other=report.other_fraction or 0.0,
        gpu_idle=gpu_idle_fraction,
        step_time_s=report.step_time_s,
        data_wait_per_step_s=report.data_wait_s / steps,
        startup=startup / everything if everything > 0 else 0.0,
        loader_cpu=loader_cpu,
    )
    diagnosis = diagnose(
        shares,
        run,
        thresholds,
        gpus,
        rank_arrival_s=[figures.arrival_per_step_s for figures in measured],
        rank_data_wait_s=[figures.data_wait_per_step_s for figures in measured],
    )
    report.verdict, report.verdict_reason = diagnosis.verdict, diagnosis.reason
    report.recommendations = diagnosis.recommendations
    report.idle_gpus = find_idle_gpus(gpus, thresholds)
    report.straggler_rank = None if diagnosis.straggler_rank is None else measured[diagnosis.straggler_rank].rank
    return report
