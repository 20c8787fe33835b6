"""Choose ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and ``pin_memory`` by timing the real loader.

:func:`tune_loader` walks ``num_workers`` through 0, 1, 2, 4, ... up to the usable cores (past them while the
workers wait on I/O), times the contenders again and picks the cheapest setting within ``tolerance`` of the best;
the user's is kept unless the choice is :data:`CLEAR_MARGIN` faster. See docs/dataloader-tuner.md.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> data = TensorDataset(torch.randn(256, 8))
    >>> build = lambda setting: DataLoader(data, batch_size=32, **setting.loader_kwargs())
    >>> tune_loader(build, usable_cpus=1, batches=4, max_seconds=10.0).num_workers  # preloaded tensors
    0
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from resource import RUSAGE_CHILDREN, getrusage
from typing import Callable, Iterator, Optional

import psutil
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_gpuopt.core.op_memory import leaves

IO_BOUND_WORKERS_PER_CORE = 4  #: workers per usable core worth trying when they wait on I/O
CLEAR_MARGIN = 0.10  #: how much faster than the user's setting a choice must be to replace it
_Run = Callable[["LoaderSetting"], "LoaderTiming"]  #: times a candidate's loader
_Choose = Callable[[list["LoaderTiming"]], tuple["LoaderTiming", str]]  #: the choice among timings, and why


@dataclass(frozen=True)
class LoaderSetting:
    """One candidate: the ``DataLoader`` arguments the tuner sets."""

    num_workers: int
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = False
    pin_memory: bool = False

    def loader_kwargs(self) -> dict:
        """Keyword arguments for ``DataLoader`` (valid for ``num_workers=0`` too)."""
        workers = self.num_workers
        return {
            "num_workers": workers,
            "prefetch_factor": (self.prefetch_factor or 2) if workers else None,
            "persistent_workers": self.persistent_workers and workers > 0,
            "pin_memory": self.pin_memory,
        }

    def describe(self) -> str:
        """``'num_workers=0, pin_memory=False'``: the arguments that apply."""
        kwargs = self.loader_kwargs().items()
        return ", ".join(f"{k}={v}" for k, v in kwargs if self.num_workers or k in ("num_workers", "pin_memory"))

    def short(self) -> str:
        """``'8 workers, prefetch 2, persistent'``-style label for tables."""
        workers = self.num_workers
        text = f"{workers} worker{'s' if workers > 1 else ''}, prefetch {self.prefetch_factor or 2}"
        text = text + (", persistent" if self.persistent_workers else "") if workers else "main process (0 workers)"
        return text + (", pinned" if self.pin_memory else "")

    @property
    def cost(self) -> tuple[int, int]:
        """Cheaper = fewer worker processes, then fewer batches held in memory."""
        return (self.num_workers, self.num_workers * (self.prefetch_factor or 2))


@dataclass
class LoaderTiming:
    """What timing one candidate measured."""

    setting: LoaderSetting
    batches: int
    samples: int
    startup_s: float
    seconds: float
    samples_per_second: float
    worker_cpu_fraction: Optional[float]
    stopped_early: bool = False
    #: without workers: the main thread's computing share of the loading time (below 0.5: waits on I/O)
    loading_cpu_fraction: Optional[float] = None

    @property
    def batch_s(self) -> float:
        """Steady-state seconds per batch."""
        return self.samples / max(self.batches, 1) / max(self.samples_per_second, 1e-9)


@dataclass
class LoaderTuneResult:
    """The chosen setting and every candidate's figures (samples/s in steady state)."""

    num_workers: int
    prefetch_factor: Optional[int]
    persistent_workers: bool
    pin_memory: bool
    samples_per_second: float
    baseline: Optional[LoaderTiming]
    candidates: list[LoaderTiming] = field(default_factory=list)
    target_samples_per_second: Optional[float] = None
    usable_cpus: int = 1
    seconds: float = 0.0
    reason: str = ""
    settled: bool = True  #: False when repeated timings kept changing the choice (a busy machine)

    @property
    def setting(self) -> LoaderSetting:
        return LoaderSetting(self.num_workers, self.prefetch_factor, self.persistent_workers, self.pin_memory)

    @property
    def speedup(self) -> Optional[float]:
        base = self.baseline.samples_per_second if self.baseline is not None else 0.0
        return self.samples_per_second / base if base > 0 else None


def cgroup_cpu_quota() -> Optional[float]:
    """The cgroup CPU limit in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); ``None`` without one."""
    cgroup = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError, ValueError):
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us, period_us = (int((cgroup / "cpu" / f"cpu.cfs_{name}_us").read_text()) for name in ("quota", "period"))
        return None if quota_us <= 0 else quota_us / period_us
    return None


def usable_cpu_count(within_quota: bool = True) -> int:
    """CPU cores this process may keep busy: its affinity, at most the cgroup quota rounded up."""
    getter = getattr(os, "sched_getaffinity", None)
    affinity = len(getter(0)) if getter is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota() if within_quota else None
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


def _child_pids() -> Optional[set[int]]:
    """This process's children (the loader's workers); None when the platform does not list them."""
    with contextlib.suppress(psutil.Error):
        return {child.pid for child in psutil.Process().children()}
    return None


def _scheduled_seconds(paths: list[str]) -> Optional[tuple[float, float]]:
    """(seconds on a CPU, seconds in a run queue) summed over ``schedstat`` files (Linux; psutil lacks the wait)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        rows = [Path(path).read_text().split() for path in paths]
        return sum(int(row[0]) for row in rows) / 1e9, sum(int(row[1]) for row in rows) / 1e9
    return None


def _cpu_fraction(cpu_s: float, waiting_s: float, workers: int, elapsed_s: float) -> float:
    """The share of the time ``workers`` could run (``elapsed_s``, less run-queue waits) they spent computing."""
    return min(1.0, cpu_s / max(workers * elapsed_s - waiting_s, 1e-9))


def batch_samples(batch: object) -> Optional[int]:
    """Samples in a batch: the leading dimension of its first tensor (depth-first); ``None`` without one.

    >>> batch_samples(({"x": torch.zeros(8, 3)}, torch.zeros(8)))
    8
    """
    return next((int(leaf.shape[0]) for leaf in leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim()), None)


def time_loader(
    loader: DataLoader,
    setting: LoaderSetting,
    batches: int,
    give_up_after_s: Optional[Callable[[int], float]] = None,
    max_seconds: float = math.inf,
    min_seconds: float = 0.0,
    consume: Optional[Callable[[object], None]] = None,
) -> LoaderTiming:
    """Time ``loader``: start-up to the first batch, then the steady rate past the batches the workers queue at once,
    each batch given to ``consume``; it stops past ``max_seconds``, or early past ``give_up_after_s(fetched)``."""
    workers = setting.num_workers
    fill = workers * (setting.prefetch_factor or 2) if workers else 1
    wanted = max(batches, fill + 8)
    cpu_before = sum(getrusage(RUSAGE_CHILDREN)[:2])
    threads_before, children_before = set(threading.enumerate()), _child_pids()
    started, iterator = time.perf_counter(), iter(loader)
    scheduled: Optional[tuple[float, float]]
    main_thread = [f"/proc/self/task/{threading.get_native_id()}/schedstat"]
    main_before = _scheduled_seconds(main_thread) if not workers else None
    first_ready = fill_ready = started
    samples = steady_samples = fetched = 0
    consumed = [0.0, 0.0, 0.0]  # the step's wall, CPU and run-queue seconds (main thread)
    stopped_early = False
    try:
        for batch in iterator:
            if consume is not None:
                step_started, before = time.perf_counter(), _scheduled_seconds(main_thread) or (0.0, 0.0)
                consume(batch)
                after = _scheduled_seconds(main_thread) or before
                spent_s = [time.perf_counter() - step_started, *(end - start for end, start in zip(after, before))]
                consumed = [total + spent for total, spent in zip(consumed, spent_s)]
            now, size = time.perf_counter(), batch_samples(batch) or 1
            samples, fetched = samples + size, fetched + 1
            if fetched == 1:
                first_ready = now
            if fetched == fill:
                fill_ready = now
            elif fetched > fill:
                steady_samples += size
            spent = now - started
            if (fetched >= wanted and spent >= min_seconds) or (fetched >= fill + 2 and spent > max_seconds):
                break
            # judged from the first batch on: a slow start is timed apart, and persistent workers pay it once
            if stopped_early := give_up_after_s is not None and now - first_ready > give_up_after_s(fetched):
                break
    finally:
        ended = time.perf_counter()
        main_after = _scheduled_seconds(main_thread) if main_before is not None else None
        children, scheduled = _child_pids(), None
        if workers and children is not None and children_before is not None:
            scheduled = _scheduled_seconds([f"/proc/{pid}/schedstat" for pid in children - children_before])
        # joined workers count in RUSAGE_CHILDREN; torch leaves its queue feeder threads running, and one alive
        # at the next fork() can hold a lock the new worker inherits locked: that worker deadlocks
        if (shutdown := getattr(iterator, "_shutdown_workers", None)) is not None:
            shutdown()
        deadline = time.monotonic() + 5.0
        for thread in set(threading.enumerate()) - threads_before:
            if thread.name.startswith("QueueFeederThread"):
                thread.join(max(0.0, deadline - time.monotonic()))
        del iterator
    elapsed = ended - started
    steady = fetched >= fill + 2 and ended > fill_ready  # else too few batches for a steady state: the overall rate
    rate = steady_samples / (ended - fill_ready) if steady else samples / max(elapsed, 1e-9)
    worker_cpu = loading_cpu = None
    if workers:  # without schedstat: CPU time of the reaped workers over their wall time
        reaped = (sum(getrusage(RUSAGE_CHILDREN)[:2]) - cpu_before, 0.0)
        worker_cpu = _cpu_fraction(*(scheduled or reaped), workers, elapsed)
    if main_before is not None and main_after is not None:
        on_cpu, waiting = (end - start - step for end, start, step in zip(main_after, main_before, consumed[1:]))
        loading_cpu = _cpu_fraction(max(0.0, on_cpu), waiting, 1, elapsed - consumed[0])
    startup = first_ready - started
    return LoaderTiming(setting, fetched, samples, startup, elapsed, rate, worker_cpu, stopped_early, loading_cpu)


def tune_loader(
    build: Callable[[LoaderSetting], DataLoader],
    usable_cpus: int,
    batches: int = 16,
    max_seconds: float = 10.0,
    tolerance: float = 0.05,
    target_samples_per_second: Optional[float] = None,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    max_workers: Optional[int] = None,
    baseline: Optional[LoaderSetting] = None,
    on_timed: Optional[Callable[[LoaderTiming], None]] = None,
    consume: Optional[Callable[[object], None]] = None,
) -> LoaderTuneResult:
    """Time the loaders ``build`` makes for candidate settings (see the module docstring) and choose one;
    ``baseline`` (the user's setting) is timed first and ``consume`` (the training step) runs on each batch."""
    started = time.perf_counter()
    max_workers = max_workers if max_workers is not None else IO_BOUND_WORKERS_PER_CORE * max(1, usable_cpus)
    timings: list[LoaderTiming] = []
    grown = 1 + tolerance

    def best() -> Optional[LoaderTiming]:
        return max((t for t in timings if not t.stopped_early), key=lambda t: t.samples_per_second, default=None)

    def give_up(fetched: int) -> float:
        leader = best()
        return math.inf if leader is None else 2.0 * (leader.startup_s + fetched * leader.batch_s) + 0.05

    def run(setting: LoaderSetting) -> LoaderTiming:
        with warnings.catch_warnings():  # torch warns whenever workers outnumber cores: that is what is measured
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            timing = time_loader(build(setting), setting, batches, give_up, max_seconds / 4, 0.25, consume)
        timings.append(timing)
        if on_timed is not None:
            on_timed(timing)
        return timing

    def walking() -> bool:  # no new candidate past 70% of max_seconds: the rest confirms the choice
        return time.perf_counter() - started <= 0.7 * max_seconds

    baseline_timing = run(baseline) if baseline is not None else None
    previous: Optional[LoaderTiming] = None
    # 0, 1, 2, 4, ... below usable_cpus, then usable_cpus
    counts = [0, *(1 << i for i in range(max(usable_cpus - 1, 0).bit_length())), max(1, usable_cpus)]
    for workers in counts:  # grows while it runs, when the workers wait on I/O
        if workers > max_workers or (timings and not walking()):  # one is always timed
            break
        setting = LoaderSetting(workers, 2 if workers else None, persistent_workers and workers > 0, pin_memory)
        timing = next((t for t in timings if t.setting == setting), None) or run(setting)
        if target_samples_per_second and timing.samples_per_second >= target_samples_per_second:
            break
        # one worker only moves loading off the main process, so growth is judged from two workers on
        grew = previous is None or timing.samples_per_second > grown * previous.samples_per_second
        if workers >= 2 and not grew and previous is not None and time.perf_counter() - started <= max_seconds:
            # one disturbed timing must not end the walk: both timed once more, the faster kept
            previous, timing = _faster(previous, run(previous.setting)), _faster(timing, run(setting))
            grew = timing.samples_per_second > grown * previous.samples_per_second
        if workers >= 2 and not grew:
            break
        previous = timing
        # waiting on I/O, judged without workers when timed: workers also idle when the main process falls behind
        alone = [t.loading_cpu_fraction for t in timings if t.loading_cpu_fraction is not None]
        fraction = max(alone) if alone else timing.worker_cpu_fraction
        if workers == counts[-1] and fraction is not None and fraction < 0.5 and workers * 2 <= max_workers:
            counts.append(workers * 2)  # more workers than cores still help
    leader = best()
    if leader is not None and leader.setting.num_workers > 0 and walking():
        deeper = LoaderSetting(leader.setting.num_workers, 4, leader.setting.persistent_workers, pin_memory)
        if all(t.setting != deeper for t in timings):
            run(deeper)
    choose = lambda timed: _choose(timed, tolerance, target_samples_per_second, baseline)  # noqa: E731
    chosen, reason, settled = _settled(timings, run, choose, started + max_seconds, baseline)
    return LoaderTuneResult(
        **vars(chosen.setting),
        samples_per_second=chosen.samples_per_second,
        baseline=baseline_timing,
        candidates=_fastest_each(timings),
        target_samples_per_second=target_samples_per_second,
        usable_cpus=usable_cpus,
        seconds=time.perf_counter() - started,
        reason=reason,
        settled=settled,
    )


def _faster(kept: LoaderTiming, timing: LoaderTiming) -> LoaderTiming:
    """Of two timings of one setting, the less disturbed: a finished one, then the faster."""
    return max(kept, timing, key=lambda t: (not t.stopped_early, t.samples_per_second))  # a tie keeps ``kept``


def _fastest_each(timings: list[LoaderTiming]) -> list[LoaderTiming]:
    """Each setting once, with its least disturbed timing."""
    fastest: dict[LoaderSetting, LoaderTiming] = {}
    for timing in timings:
        fastest[timing.setting] = _faster(fastest[timing.setting], timing) if timing.setting in fastest else timing
    return list(fastest.values())


def _choose(
    timings: list[LoaderTiming], tolerance: float, target: Optional[float], yours: Optional[LoaderSetting] = None
) -> tuple[LoaderTiming, str]:
    """The cheapest timing keeping up with ``target``, else within ``tolerance`` of the best (or ``yours``), and why."""
    timings = _fastest_each(timings)
    finished = [t for t in timings if not t.stopped_early] or timings
    top = max(t.samples_per_second for t in finished)
    if target and any(t.samples_per_second >= target for t in finished):
        pool = [t for t in finished if t.samples_per_second >= target]
        reason = f"the cheapest setting that keeps up with training ({target:,.0f} samples/s)"
    else:
        pool = [t for t in finished if t.samples_per_second >= (1 - tolerance) * top]
        reason = f"the cheapest setting within {tolerance:.0%} of the best ({top:,.0f} samples/s)"
    chosen = min(pool, key=lambda t: t.setting.cost)
    kept = next((t for t in timings if t.setting == yours and t is not chosen), None)
    gain = chosen.samples_per_second / max(kept.samples_per_second, 1e-9) if kept is not None else math.inf
    if kept is not None and gain < 1 + CLEAR_MARGIN:
        return kept, f"yours kept, the choice being {gain:.2f}x it (under {1 + CLEAR_MARGIN:g}x); {reason}"
    return chosen, reason


def _settled(
    timings: list[LoaderTiming], run: _Run, choose: _Choose, deadline: float, yours: Optional[LoaderSetting]
) -> tuple[LoaderTiming, str, bool]:
    """``(chosen, reason, settled)``: the contenders (half the best or more) timed again, up to 3 rounds in turn,
    until the choice stays; if not, ``yours`` is kept when it won once (or none was retimed) and is 2/3 of it."""
    chosen, reason = choose(timings)
    changes = [chosen.setting]
    for round_index in range(3):
        if time.perf_counter() > deadline:
            break
        finished = [t for t in _fastest_each(timings) if not t.stopped_early]
        if not finished:
            return chosen, reason, True
        top = max(t.samples_per_second for t in finished)
        contenders = [t.setting for t in finished if t.samples_per_second >= 0.5 * top]
        for setting in reversed(contenders) if round_index % 2 == 0 else contenders:
            run(setting)  # appended to ``timings``
        again, reason = choose(timings)
        if again.setting == chosen.setting:
            return again, reason, True
        chosen = again
        changes.append(chosen.setting)
    if len(changes) > 1:
        steps = " → ".join(f"{setting.num_workers} workers" for setting in changes)
        reason += f"; uncertain: repeated timings kept changing the choice ({steps}), the machine is busy"
    else:
        reason += "; unconfirmed: `max_seconds` ran out before the choice was timed twice"
    kept = next((t for t in _fastest_each(timings) if t.setting == yours != chosen.setting), None)
    doubtful = len(changes) == 1 or yours in changes  # timed once, or the user's setting won a round
    if kept is not None and doubtful and chosen.samples_per_second < 1.5 * kept.samples_per_second:
        return kept, f"yours kept: {reason}", False
    return chosen, reason, False


def oversubscription(intra_op_threads: int, workers: int, worker_cpu_fraction: float | None, cores: int) -> str | None:
    """A warning when the model's intra-op threads and busy workers want more cores than there are (CPU training)."""
    busy = workers * (worker_cpu_fraction if worker_cpu_fraction is not None else 1.0)
    threads = max(1, cores - math.ceil(busy))
    if workers == 0 or intra_op_threads + busy <= 1.1 * cores or threads >= intra_op_threads:
        return None  # within 10% of the cores, or nothing left to lower
    wanted = f"{intra_op_threads} intra-op threads for the model and the {workers} loader workers keep ~{busy:.1f} cores busy"
    return f"oversubscription: torch runs {wanted}, {intra_op_threads + busy:.1f} > {cores} usable cores; call torch.set_num_threads({threads}) so neither stalls the other."


def _sample_size(sample: object) -> int:
    """Elements in one sample: the total ``numel`` of its tensors and arrays, through tuples, lists and dicts."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if hasattr(sample, "size") and hasattr(sample, "shape") and not callable(sample.size):  # numpy arrays
        return int(sample.size)
    items = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    return sum(_sample_size(item) for item in items)


@dataclass
class ProbedSizes:
    """Sample sizes seen by :func:`largest_samples_first`: the probed indices, largest first."""

    order: list[int]
    smallest: int
    largest: int
    probed: int
    total: int = 0  # samples in the dataset

    @property
    def complete(self) -> bool:
        return self.probed >= self.total


def largest_samples_first(
    dataset: object, max_probe: Optional[int] = None, max_seconds: float = 5.0
) -> Optional[ProbedSizes]:
    """Every sample's size (seeded random order, within ``max_probe`` and ``max_seconds``), largest first;
    ``None`` when the dataset is not sized and indexable or every sample has the same size.

    >>> largest_samples_first([torch.zeros(4)] * 4095 + [torch.zeros(64)]).order[0]
    4095
    """
    length = 0
    with contextlib.suppress(TypeError):
        length = len(dataset)  # type: ignore[arg-type]
    if length < 2 or type(dataset) is TensorDataset:
        return None
    indices = list(range(length))
    random.Random(0).shuffle(indices)
    deadline = time.perf_counter() + max_seconds
    sizes: list[tuple[int, int]] = []
    for index in indices[: max_probe or length]:
        sizes.append((_sample_size(dataset[index]), index))  # type: ignore[index]
        if time.perf_counter() > deadline:
            break
    smallest, largest = min(sizes)[0], max(sizes)[0]
    if smallest == largest:
        return None
    order = [index for _, index in sorted(sizes, key=lambda pair: -pair[0])]
    return ProbedSizes(order, smallest, largest, len(sizes), length)


class TrialSampler(Sampler[int]):
    """``order`` over and over until ``length``, so every batch of a trial is full.

    >>> list(TrialSampler([0, 1, 2], 5))
    [0, 1, 2, 0, 1]
    """

    def __init__(self, order: list[int], length: int) -> None:
        if not order:
            raise ValueError("TrialSampler needs at least one index")
        self.order, self.length = list(order), length

    def __iter__(self) -> Iterator[int]:
        return (self.order[position % len(self.order)] for position in range(self.length))

    def __len__(self) -> int:
        return self.length
