"""Choose ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and ``pin_memory`` by
timing the real loader.

:func:`time_loader` iterates a ``DataLoader`` for a bounded number of batches and measures
its start-up (``iter()`` + first batch: worker start-up included), its steady throughput,
and -- from the CPU time of the worker processes once they exit -- whether the workers
compute or wait on I/O. :func:`tune_loader` walks ``num_workers`` through a geometric set
(0, 1, 2, 4, ...) up to the usable CPU cores (:func:`usable_cpu_count`: the affinity within the
cgroup CPU quota), and past them only while the workers are
measured waiting on I/O and throughput still grows; it stops a candidate early once it is
clearly slower than the best, stops walking once throughput stops growing or keeps up with
the target, tries ``prefetch_factor=4`` on the best, and picks the cheapest setting within
``tolerance`` of the best throughput (or the cheapest that keeps up with the target).

Example::

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> data = TensorDataset(torch.randn(256, 8))
    >>> def build(setting):
    ...     return DataLoader(data, batch_size=32, **setting.loader_kwargs())
    >>> result = tune_loader(build, usable_cpus=1, batches=4, max_seconds=10.0)
    >>> result.num_workers  # preloaded tensors: workers cannot beat the main process by much
    0
"""

from __future__ import annotations

import math
import os
import random
import resource
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import psutil
import torch
from torch.utils.data import DataLoader, Sampler

#: workers per usable core worth trying when the workers are measured waiting on I/O (asleep
#: most of the time); the same bound in DataWaitMonitor's advice and DataLoaderTuner's search
IO_BOUND_WORKERS_PER_CORE = 4


@dataclass(frozen=True)
class LoaderSetting:
    """One candidate: the ``DataLoader`` arguments the tuner sets."""

    num_workers: int
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = False
    pin_memory: bool = False

    def loader_kwargs(self) -> dict:
        """Keyword arguments for ``DataLoader`` (valid for ``num_workers=0`` too)."""
        if self.num_workers == 0:
            return {
                "num_workers": 0,
                "prefetch_factor": None,
                "persistent_workers": False,
                "pin_memory": self.pin_memory,
            }
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor or 2,
            "persistent_workers": self.persistent_workers,
            "pin_memory": self.pin_memory,
        }

    def describe(self) -> str:
        if self.num_workers == 0:
            return f"num_workers=0, pin_memory={self.pin_memory}"
        return (
            f"num_workers={self.num_workers}, prefetch_factor={self.prefetch_factor or 2},"
            f" persistent_workers={self.persistent_workers}, pin_memory={self.pin_memory}"
        )

    def short(self) -> str:
        """``'8 workers, prefetch 2, persistent'``-style label for tables."""
        if self.num_workers == 0:
            text = "main process (0 workers)"
        else:
            text = (
                f"{self.num_workers} worker{'s' if self.num_workers > 1 else ''}, prefetch {self.prefetch_factor or 2}"
            )
            text += ", persistent" if self.persistent_workers else ""
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
    #: without workers: the share of the loading time the main thread spent computing, run-queue
    #: waits on a busy machine taken out (Linux); below 0.5 the loader mostly waits on I/O
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
    #: False when repeated timings kept changing the choice (a busy machine): the choice is uncertain
    settled: bool = True

    @property
    def setting(self) -> LoaderSetting:
        return LoaderSetting(self.num_workers, self.prefetch_factor, self.persistent_workers, self.pin_memory)

    @property
    def speedup(self) -> Optional[float]:
        if self.baseline is None or self.baseline.samples_per_second <= 0:
            return None
        return self.samples_per_second / self.baseline.samples_per_second


def cgroup_cpu_quota() -> Optional[float]:
    """The cgroup CPU limit in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); ``None`` without one.
    Read here because psutil has no reading of a cgroup CPU quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as handle:
            quota, period = handle.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with (
            open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as quota_file,
            open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as period_file,
        ):
            quota_us, period_us = int(quota_file.read()), int(period_file.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cpu_count(within_quota: bool = True) -> int:
    """CPU cores this process may keep busy: its CPU affinity (``len(os.sched_getaffinity(0))``, not
    ``os.cpu_count()``: a scheduler or ``taskset`` may give it fewer), at most the cgroup CPU quota
    (:func:`cgroup_cpu_quota`, rounded up), past which the process is throttled: under
    ``docker run --cpus=1`` on a 16-core host this is 1, not 16. The one core count of the package:
    the loader tuner, the data-wait monitor, its oversubscription finding and the doctor's thread
    check count it; the doctor's core check, which reports the affinity and the quota apart, passes
    ``within_quota=False`` for the affinity alone.

    Not Lightning's ``lightning.fabric.utilities.data.suggested_max_num_workers``: it counts the
    affinity only, ignoring a cgroup quota, and subtracts one core for the main process, whose cost
    the loader tuner measures (it times ``num_workers=0`` too) rather than assumes.

    Example::

        >>> 1 <= usable_cpu_count() <= usable_cpu_count(within_quota=False) <= (os.cpu_count() or 1)
        True
    """
    getter = getattr(os, "sched_getaffinity", None)
    affinity = len(getter(0)) if getter is not None else (os.cpu_count() or 1)
    if not within_quota:
        return affinity
    quota = cgroup_cpu_quota()
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _child_pids() -> Optional[set[int]]:
    """This process's children (not their children: the loader's workers), from psutil; None when
    the platform does not list them."""
    try:
        return {child.pid for child in psutil.Process().children()}
    except psutil.Error:
        return None


def _scheduled_seconds(pids: set[int]) -> Optional[tuple[float, float]]:
    """(seconds on a CPU, seconds waiting in a run queue for one) summed over ``pids``, from
    ``/proc/<pid>/schedstat`` (Linux); None when unreadable. Not psutil: its ``cpu_times()`` has
    no run-queue wait time.

    A worker that waits for a core on a busy machine is not waiting on I/O: the time it sat in a
    run queue is taken out before its CPU share is judged, so other work on the machine does not
    make a CPU-bound loader look I/O-bound.
    """
    on_cpu = waiting = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/schedstat") as file:
                fields = file.read().split()
            on_cpu, waiting = on_cpu + int(fields[0]), waiting + int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return on_cpu / 1e9, waiting / 1e9


def _thread_scheduled_seconds() -> Optional[tuple[float, float]]:
    """(seconds on a CPU, seconds waiting in a run queue) of the calling thread (Linux), else None.
    Not psutil: it has no run-queue wait time."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as file:
            fields = file.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def worker_cpu_fraction(cpu_s: float, waiting_s: float, workers: int, elapsed_s: float) -> float:
    """The share of the time a worker could run that it spent computing, 0..1.

    >>> worker_cpu_fraction(cpu_s=0.5, waiting_s=1.0, workers=2, elapsed_s=1.0)  # busy machine, CPU-bound
    0.5
    >>> worker_cpu_fraction(cpu_s=0.1, waiting_s=0.0, workers=2, elapsed_s=1.0)  # sleeping on I/O
    0.05
    """
    runnable_or_sleeping = max(workers * elapsed_s - waiting_s, 1e-9)
    return min(1.0, cpu_s / runnable_or_sleeping)


def batch_samples(batch: object) -> Optional[int]:
    """Samples in a batch: the leading dimension of its first tensor (depth-first through
    tuples, lists and dicts); ``None`` when it holds no tensor with a dimension.

    >>> import torch
    >>> batch_samples(({"x": torch.zeros(8, 3)}, torch.zeros(8)))
    8

    Not Lightning's ``extract_batch_size`` (the callbacks use it where a batch must have a size): this
    module has no Lightning import, and here a batch without a sized tensor is ``None`` ("unknown":
    no line is fitted), where Lightning raises, or counts a 0-dim tensor as one sample.
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = batch_samples(item)
        if found is not None:
            return found
    return None


def _shutdown(iterator: Iterator, threads_before: set[threading.Thread], timeout_s: float = 5.0) -> None:
    """Stop the iterator's workers and wait for the queue-feeder threads it started.

    Joining the workers puts their CPU time in ``RUSAGE_CHILDREN``. torch closes its queues
    without joining their feeder threads; one still running at the next ``fork()`` (the next
    candidate, or the training loader) can hold a lock the forked worker inherits locked, and
    that worker then deadlocks before it loads anything. So they are joined here.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - threads_before:
        if thread.name.startswith("QueueFeederThread"):
            thread.join(max(0.0, deadline - time.monotonic()))


def time_loader(
    loader: DataLoader,
    setting: LoaderSetting,
    batches: int,
    give_up_after_s: Optional[Callable[[int], float]] = None,
    max_seconds: float = math.inf,
    min_seconds: float = 0.0,
) -> LoaderTiming:
    """Time ``loader``: start-up to the first batch, then the steady rate.

    ``iter()`` queues ``W x prefetch_factor`` batches at once, and the workers, forked one after
    another, start loading them at different times: those batches are pipeline fill. The steady
    rate is timed over the batches after them, and at least fill + 8 batches are fetched. When
    the loader ends first (a short epoch), the rate over everything, start-up included, is the
    honest figure and is returned instead.

    Args:
        loader: the loader built with ``setting``.
        batches: batches to time at least.
        give_up_after_s: maps batches fetched so far to the elapsed time beyond which this
            candidate is clearly worse than the best so far, and is stopped.
        max_seconds: stop after this long, once two batches have been timed past the fill.
        min_seconds: keep fetching past ``batches`` until this long has passed (a steadier
            figure for fast loaders).
    """
    fill = setting.num_workers * (setting.prefetch_factor or 2) if setting.num_workers else 1
    wanted = max(batches, fill + 8)
    cpu_before = _children_cpu_s()
    threads_before = set(threading.enumerate())
    children_before = _child_pids()
    started = time.perf_counter()
    iterator = iter(loader)
    scheduled: Optional[tuple[float, float]] = None
    main_thread_before = _thread_scheduled_seconds() if not setting.num_workers else None
    first_ready = fill_ready = started
    samples = steady_samples = fetched = 0
    stopped_early = False
    try:
        for batch in iterator:
            now = time.perf_counter()
            size = batch_samples(batch) or 1
            samples += size
            fetched += 1
            if fetched == 1:
                first_ready = now
            if fetched == fill:
                fill_ready = now
            elif fetched > fill:
                steady_samples += size
            if (fetched >= wanted and now - started >= min_seconds) or (
                fetched >= fill + 2 and now - started > max_seconds
            ):
                break
            # judged from the first batch on: a slow start (forking workers on a busy machine) is
            # timed apart, and persistent workers pay it once
            if give_up_after_s is not None and now - first_ready > give_up_after_s(fetched):
                stopped_early = True
                break
    finally:
        ended = time.perf_counter()
        main_thread_after = _thread_scheduled_seconds() if main_thread_before is not None else None
        children = _child_pids()
        if setting.num_workers and children is not None and children_before is not None:
            scheduled = _scheduled_seconds(children - children_before)
        _shutdown(iterator, threads_before)
        del iterator
    if fetched >= fill + 2 and ended > fill_ready:
        rate = steady_samples / (ended - fill_ready)
    else:  # too few batches to see a steady state: the overall rate
        rate = samples / max(ended - started, 1e-9)
    worker_cpu = None
    if setting.num_workers > 0 and scheduled is not None:
        worker_cpu = worker_cpu_fraction(scheduled[0], scheduled[1], setting.num_workers, ended - started)
    elif setting.num_workers > 0:  # no schedstat: CPU time of the reaped workers over their wall time
        worker_cpu = worker_cpu_fraction(_children_cpu_s() - cpu_before, 0.0, setting.num_workers, ended - started)
    loading_cpu = None
    if main_thread_before is not None and main_thread_after is not None:
        cpu_s, waiting_s = (after - before for after, before in zip(main_thread_after, main_thread_before))
        loading_cpu = worker_cpu_fraction(cpu_s, waiting_s, 1, ended - started)
    return LoaderTiming(
        setting, fetched, samples, first_ready - started, ended - started, rate, worker_cpu, stopped_early, loading_cpu
    )


def worker_counts(usable_cpus: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``usable_cpus`` (which is included)."""
    counts, workers = [0], 1
    while workers < usable_cpus:
        counts.append(workers)
        workers *= 2
    counts.append(max(1, usable_cpus))
    return counts


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
) -> LoaderTuneResult:
    """Time candidate settings of one loader and choose one.

    Args:
        build: makes the loader for a setting (same dataset, sampler, collate_fn, batch size).
        usable_cpus: CPU cores this process may use for workers.
        batches: batches timed per candidate (worker start-up is timed on top, in the first).
        max_seconds: no new candidate starts once tuning has taken this long.
        tolerance: a cheaper setting within this fraction of the best throughput is chosen.
        target_samples_per_second: what training consumes; the cheapest setting that keeps up
            with it wins, and the walk stops once one does.
        pin_memory: set on every candidate (on CUDA).
        persistent_workers: set on every candidate with workers.
        max_workers: never more workers than this (default ``IO_BOUND_WORKERS_PER_CORE`` x ``usable_cpus``; past
            ``usable_cpus`` only while workers are measured waiting on I/O).
        baseline: the user's own setting, timed first for comparison.
        on_timed: called with each candidate's timing as it ends (progress reporting).
    """
    started = time.perf_counter()
    max_workers = max_workers if max_workers is not None else IO_BOUND_WORKERS_PER_CORE * max(1, usable_cpus)
    timings: list[LoaderTiming] = []

    def best() -> Optional[LoaderTiming]:
        finished = [t for t in timings if not t.stopped_early]
        return max(finished, key=lambda t: t.samples_per_second) if finished else None

    def give_up(fetched: int) -> float:
        leader = best()
        if leader is None:
            return math.inf
        return 2.0 * (leader.startup_s + fetched * leader.batch_s) + 0.05

    def run(setting: LoaderSetting) -> LoaderTiming:
        with warnings.catch_warnings():
            # torch warns whenever workers outnumber cores; here that is what is being measured
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            timing = time_loader(build(setting), setting, batches, give_up, max_seconds / 4, min_seconds=0.25)
        timings.append(timing)
        if on_timed is not None:
            on_timed(timing)
        return timing

    baseline_timing = run(baseline) if baseline is not None else None
    previous: Optional[LoaderTiming] = None
    counts = worker_counts(usable_cpus)
    index = 0
    while index < len(counts):
        workers = counts[index]
        index += 1
        out_of_time = timings and time.perf_counter() - started > WALK_SHARE * max_seconds  # one is always timed
        if workers > max_workers or out_of_time:
            break
        setting = LoaderSetting(workers, 2 if workers else None, persistent_workers and workers > 0, pin_memory)
        timing = next((t for t in timings if t.setting == setting), None) or run(setting)
        if target_samples_per_second and timing.samples_per_second >= target_samples_per_second:
            break
        # one worker only moves loading off the main process (it overlaps compute, which this
        # loop does not run), so growth is judged from two workers on
        grew = previous is None or _grew(previous, timing, tolerance)
        if workers >= 2 and not grew and previous is not None and time.perf_counter() - started <= max_seconds:
            # one disturbed timing must not end the walk: both timed once more, the faster kept
            previous = _faster(previous, run(previous.setting))
            timing = _faster(timing, run(setting))
            grew = _grew(previous, timing, tolerance)
        if workers >= 2 and not grew:
            break
        previous = timing
        io_bound = _waits_on_io(timings, timing)
        if index == len(counts) and io_bound and workers * 2 <= max_workers:
            counts.append(workers * 2)  # workers wait on I/O: more of them than cores still help
    leader = best()
    if (
        leader is not None
        and leader.setting.num_workers > 0
        and time.perf_counter() - started <= WALK_SHARE * max_seconds
    ):
        deeper = LoaderSetting(leader.setting.num_workers, 4, leader.setting.persistent_workers, pin_memory)
        if all(t.setting != deeper for t in timings):
            run(deeper)

    def choose(kept: list[LoaderTiming]) -> LoaderTuneResult:
        return _choose(
            kept, baseline_timing, tolerance, target_samples_per_second, usable_cpus, time.perf_counter() - started
        )

    return _settled(timings, run, choose, started, max_seconds)


#: candidates at least this fraction of the best throughput are timed again
CONTENDER_FRACTION = 0.5
#: rounds of repeated timings at most, while the choice keeps changing
SETTLING_ROUNDS = 3
#: no new candidate starts past this share of ``max_seconds``: the rest confirms the choice
WALK_SHARE = 0.7


def _waits_on_io(timings: list[LoaderTiming], timing: LoaderTiming) -> bool:
    """Do the loader's samples mostly wait on I/O (so more workers than cores still help)?

    Judged from the timing without workers when there is one: the main thread loads alone there,
    so its CPU share is the loading's own. Workers' shares also drop when they wait for the main
    process to take their batches (a full prefetch queue on a busy machine), which is not I/O.
    """
    alone = [t.loading_cpu_fraction for t in timings if t.loading_cpu_fraction is not None]
    if alone:
        return max(alone) < 0.5
    return timing.worker_cpu_fraction is not None and timing.worker_cpu_fraction < 0.5


def _grew(previous: LoaderTiming, timing: LoaderTiming, tolerance: float) -> bool:
    return timing.samples_per_second > previous.samples_per_second * (1 + tolerance)


def _faster(kept: LoaderTiming, timing: LoaderTiming) -> LoaderTiming:
    """Of two timings of one setting, the less disturbed: a finished one over one stopped early,
    then the faster (other work on a busy machine only ever slows a timing down)."""
    if kept.stopped_early != timing.stopped_early:
        return kept if timing.stopped_early else timing
    return timing if timing.samples_per_second > kept.samples_per_second else kept


def _fastest_each(timings: list[LoaderTiming]) -> list[LoaderTiming]:
    """Each setting once, with its least disturbed timing (see :func:`_faster`)."""
    fastest: dict[LoaderSetting, LoaderTiming] = {}
    for timing in timings:
        fastest[timing.setting] = _faster(fastest[timing.setting], timing) if timing.setting in fastest else timing
    return list(fastest.values())


def _settled(
    timings: list[LoaderTiming],
    run: Callable[[LoaderSetting], LoaderTiming],
    choose: Callable[[list[LoaderTiming]], LoaderTuneResult],
    started: float,
    max_seconds: float,
) -> LoaderTuneResult:
    """Time every contender (a finished candidate within :data:`CONTENDER_FRACTION` of the best)
    again, round after round in alternating order, until the choice made from each setting's least
    disturbed timing is the same after a round as before it. One disturbed timing then no longer
    decides; a choice that still changes after :data:`SETTLING_ROUNDS` rounds (or past
    ``max_seconds``) is returned with ``settled=False`` and says so in its reason."""
    result = choose(_fastest_each(timings))
    changes = [result.setting]
    for round_index in range(SETTLING_ROUNDS):
        if time.perf_counter() - started > max_seconds:
            break
        finished = [t for t in _fastest_each(timings) if not t.stopped_early]
        if not finished:
            return result
        top = max(t.samples_per_second for t in finished)
        contenders = [t.setting for t in finished if t.samples_per_second >= CONTENDER_FRACTION * top]
        for setting in reversed(contenders) if round_index % 2 == 0 else contenders:
            run(setting)  # appended to ``timings`` by ``run``
        again = choose(_fastest_each(timings))
        if again.setting == result.setting:
            return again
        result = again
        changes.append(result.setting)
    result.settled = False
    if len(changes) > 1:
        result.reason += (
            "; uncertain: repeated timings kept changing the choice ("
            + " → ".join(f"{setting.num_workers} workers" for setting in changes)
            + "), the machine is busy"
        )
    else:
        result.reason += "; unconfirmed: `max_seconds` ran out before the choice was timed twice"
    return result


def _choose(
    timings: list[LoaderTiming],
    baseline: Optional[LoaderTiming],
    tolerance: float,
    target: Optional[float],
    usable_cpus: int,
    seconds: float,
) -> LoaderTuneResult:
    finished = [t for t in timings if not t.stopped_early] or list(timings)
    top = max(t.samples_per_second for t in finished)
    if target and any(t.samples_per_second >= target for t in finished):
        pool = [t for t in finished if t.samples_per_second >= target]
        reason = f"the cheapest setting that keeps up with training ({target:,.0f} samples/s)"
    else:
        pool = [t for t in finished if t.samples_per_second >= (1 - tolerance) * top]
        reason = f"the cheapest setting within {tolerance:.0%} of the best ({top:,.0f} samples/s)"
    chosen = min(pool, key=lambda t: t.setting.cost)
    return LoaderTuneResult(
        num_workers=chosen.setting.num_workers,
        prefetch_factor=chosen.setting.prefetch_factor,
        persistent_workers=chosen.setting.persistent_workers,
        pin_memory=chosen.setting.pin_memory,
        samples_per_second=chosen.samples_per_second,
        baseline=baseline,
        candidates=list(timings),
        target_samples_per_second=target,
        usable_cpus=usable_cpus,
        seconds=seconds,
        reason=reason,
    )


def oversubscription(
    intra_op_threads: int, workers: int, worker_cpu_fraction: Optional[float], cores: int
) -> Optional[str]:
    """A warning when the model's intra-op threads and busy workers want more cores than there are
    (on CPU training, where the model's math runs on the same cores as the loader)."""
    busy = workers * (worker_cpu_fraction if worker_cpu_fraction is not None else 1.0)
    threads = max(1, cores - math.ceil(busy))
    if workers == 0 or intra_op_threads + busy <= 1.1 * cores or threads >= intra_op_threads:
        return None  # within 10% of the cores, or nothing left to lower
    return (
        f"oversubscription: torch runs {intra_op_threads} intra-op threads for the model and the {workers} loader"
        f" workers keep ~{busy:.1f} cores busy, {intra_op_threads + busy:.1f} > {cores} usable cores; call"
        f" torch.set_num_threads({threads}) so neither stalls the other."
    )


def sample_size(sample: object) -> int:
    """Elements in one sample: the total ``numel`` of its tensors (and arrays), through tuples,
    lists and dicts. A padded batch of the largest samples is a step's worst case."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if hasattr(sample, "size") and hasattr(sample, "shape") and not callable(sample.size):  # numpy arrays
        return int(sample.size)
    items = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    return sum(sample_size(item) for item in items)


@dataclass
class ProbedSizes:
    """Sample sizes seen by :func:`largest_samples_first`: the probed indices, largest first."""

    order: list[int]
    smallest: int
    largest: int
    probed: int
    #: samples in the dataset; all of them were looked at when ``probed == total``
    total: int = 0

    @property
    def complete(self) -> bool:
        return self.probed >= self.total


def largest_samples_first(
    dataset: object, max_probe: Optional[int] = None, max_seconds: float = 5.0
) -> Optional[ProbedSizes]:
    """Look at every sample's size (in a random order of its own RNG, at most ``max_probe`` samples
    and ``max_seconds``) and order them largest first; ``None`` when the dataset is not sized and
    indexable, or when every sample looked at has the same size.

    Every sample, not a sample of them: a rare long sequence decides what fits (4 long samples in
    4,096 were missed when the probe concluded "uniform" after 256 samples of one size). When time
    runs out first, :attr:`ProbedSizes.complete` is False and callers say how many were seen.

    >>> import torch
    >>> data = [torch.zeros(n) for n in (3, 9, 5)]
    >>> largest_samples_first(data).order
    [1, 2, 0]
    >>> rare = [torch.zeros(4)] * 4095 + [torch.zeros(64)]
    >>> largest_samples_first(rare).order[0]
    4095
    """
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if length < 2:
        return None
    indices = list(range(length))
    random.Random(0).shuffle(indices)
    deadline = time.perf_counter() + max_seconds
    sizes: list[tuple[int, int]] = []
    for index in indices[: max_probe or length]:
        sizes.append((sample_size(dataset[index]), index))  # type: ignore[index]
        if time.perf_counter() > deadline:
            break
    smallest, largest = min(size for size, _ in sizes), max(size for size, _ in sizes)
    if smallest == largest:
        return None
    order = [index for _, index in sorted(sizes, key=lambda pair: -pair[0])]
    return ProbedSizes(order, smallest, largest, len(sizes), length)


class TrialSampler(Sampler[int]):
    """Indices for trial batches: ``order`` over and over until ``length``, so every batch of a trial
    is full, also when the batch is more than half the data (an epoch's short leftover batch was
    the trial's second step, the only one with optimizer state).

    >>> list(TrialSampler([7], 3))  # the largest sample at every place: each batch is the worst case
    [7, 7, 7]
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
