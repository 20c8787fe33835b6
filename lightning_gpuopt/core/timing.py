"""Where each training step's wall time goes, and how long the GPU sat idle.

:class:`StepClock`, fed host timings by ``DataWaitMonitor``, splits every measured training step into data
wait (the dataloader ``next()``), transfer (``batch_to_device``), compute (step start to end) and other (hooks,
logging, schedulers); validation and checkpoint saving between steps are totalled apart, and parts timed in some
steps only are estimated in the others. The first step of each epoch (its batch's time is loader start-up) and the
first ``warmup_steps`` are not measured.
:class:`CudaStepTimer` records device events around each measured step and reads them lazily, never
synchronising: GPU busy is a step's start to end, GPU idle the end of step i-1 to the start of step i."""

from __future__ import annotations

import collections
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from lightning_gpuopt.core.checks import check_int


class Event(Protocol):
    """A device timing event: a CUDA event with timing (from :mod:`.device`) or the simulated card's host event."""

    def query(self) -> bool: ...
    def elapsed_time(self, end: Any) -> float: ...
    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class StepTotals:
    """Sums over measured training steps (seconds, but ``steps``, ``samples`` and ``gpu_util_mean``), with shares
    and per-step means as properties. Validation, checkpoint saving and loader start-up are not in ``wall_s``."""

    steps: int = 0
    samples: int = 0
    #: each step from the previous step's end to its own end, time kept apart taken out
    wall_s: float = 0.0
    #: the dataloader ``next()`` for each step's batch, and the main thread's CPU time meanwhile
    data_wait_s: float = 0.0
    data_wait_cpu_s: float = 0.0
    #: ``batch_to_device``; step start to step end; its ``training_step`` call (up to the backward)
    transfer_s: float = 0.0
    compute_s: float = 0.0
    forward_s: float = 0.0
    validation_s: float = 0.0
    checkpoint_s: float = 0.0
    worker_startup_s: float = 0.0
    #: train start to end, the denominator of every share of training time (0.0: the parts above summed)
    train_s: float = 0.0
    #: CUDA: device time from step start to end, and between steps (0.0 elsewhere)
    gpu_busy_s: float = 0.0
    gpu_idle_s: float = 0.0
    #: NVML: mean utilisation (%) of the GPU (``None`` without NVML)
    gpu_util_mean: Optional[float] = None

    #: properties written to the JSON report beside the fields
    # fmt: off
    JSON_PROPERTIES = ("other_s", "step_time_s", "data_wait_fraction", "transfer_fraction", "compute_fraction",
                       "other_fraction", "loader_cpu_fraction", "gpu_idle_fraction", "samples_per_second")
    # fmt: on

    #: step time outside data wait, transfer and compute (hooks, logging, schedulers, progress bar)
    other_s = property(lambda self: max(0.0, self.wall_s - self.data_wait_s - self.transfer_s - self.compute_s))

    def share(self, seconds: float) -> Optional[float]:
        """``seconds`` as a share of the steps' wall time (``None`` without a step); ``*_fraction``: of each part."""
        return seconds / self.wall_s if self.wall_s > 0 else None

    def per_step(self, seconds: float) -> float:
        return seconds / self.steps if self.steps else 0.0

    def training_share(self, seconds: float) -> Optional[float]:
        """``seconds`` as a share of training time (:attr:`train_s`)."""
        total = self.train_s or self.wall_s + self.validation_s + self.checkpoint_s + self.worker_startup_s
        return seconds / total if total > 0 else None

    step_time_s = property(lambda self: self.per_step(self.wall_s), doc="Mean seconds a step.")
    data_wait_per_step_s = property(lambda self: self.per_step(self.data_wait_s), doc="Mean data wait a step.")
    #: per step, the time before the gradient sync: data wait + transfer + forward
    arrival_per_step_s = property(lambda self: self.per_step(self.data_wait_s + self.transfer_s + self.forward_s))
    data_wait_fraction = property(lambda self: self.share(self.data_wait_s), doc="Data wait's share of the steps.")
    transfer_fraction = property(lambda self: self.share(self.transfer_s), doc="Transfer's share of the steps.")
    compute_fraction = property(lambda self: self.share(self.compute_s), doc="Compute's share of the steps.")
    other_fraction = property(lambda self: self.share(self.other_s), doc="The rest's share of the steps.")
    loader_cpu_fraction = property(
        lambda self: min(1.0, self.data_wait_cpu_s / self.data_wait_s) if self.data_wait_s > 0 else None,
        doc="Main-thread CPU seconds per second of data wait (near 1: loading computes in the main process).",
    )
    gpu_idle_fraction = property(
        lambda self: self.gpu_idle_s / total if (total := self.gpu_busy_s + self.gpu_idle_s) > 0 else None
    )
    samples_per_second = property(lambda self: self.samples / self.wall_s if self.wall_s > 0 and self.samples else None)


#: at most this many points in a :class:`StepTimeline` (pairs of points merge when a run has more)
_TIMELINE_POINTS = 200


@dataclass
class StepTimeline:
    """Measured steps in groups of ``steps_per_point``, each column the group's mean per step (seconds);
    ``step``: the training step each group starts at; ``gpu_idle_s``: ``None`` off CUDA."""

    steps_per_point: int = 1
    step: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    other_s: list[float] = field(default_factory=list)
    gpu_idle_s: Optional[list[float]] = None


class BinnedSeries:
    """Per-step values summed into at most ``max_points`` bins of ``steps_per_point`` steps; when one bin too
    many would start, neighbours merge in pairs and ``steps_per_point`` doubles."""

    def __init__(self, columns: Sequence[str], max_points: int = _TIMELINE_POINTS) -> None:
        self.columns = tuple(columns)
        self.max_points = check_int("max_points", max_points, 2, f"max_points={_TIMELINE_POINTS}")
        self.steps_per_point = 1
        self.first_step: list[int] = []
        self._sums: list[list[float]] = []
        self._counts: list[int] = []

    steps = property(lambda self: sum(self._counts), doc="The steps added.")

    def add(self, step: int, values: Sequence[float]) -> None:
        if self._counts and self._counts[-1] < self.steps_per_point:  # room in the last bin
            self._counts[-1] += 1
            self._sums[-1] = list(map(operator.add, self._sums[-1], values))
        elif len(self._counts) < self.max_points:
            self.first_step.append(step)
            self._counts.append(1)
            self._sums.append([float(value) for value in values])
        else:
            self.steps_per_point *= 2
            pairs = range(0, len(self._counts), 2)
            self.first_step = [self.first_step[i] for i in pairs]
            self._sums = [[sum(values) for values in zip(*self._sums[i : i + 2])] for i in pairs]
            self._counts = [sum(self._counts[i : i + 2]) for i in pairs]
            self.add(step, values)

    def points(self) -> list[list[float]]:
        """Each bin's values as means per step, in step order."""
        return [[total / count for total in sums] for sums, count in zip(self._sums, self._counts)]

    def sums(self) -> list[float]:
        """Each column's total over every step."""
        return [sum(column) for column in zip(*self._sums)] if self._sums else [0.0] * len(self.columns)


#: whether a starting step is measured, and whether the gap before it is a plain step-to-step gap
StepStart = collections.namedtuple("StepStart", ("measured", "clean_gap"))


#: the per-step columns of :attr:`StepClock.series`: :class:`StepTotals` fields
_COLUMNS = ("samples", "wall_s", "data_wait_s", "data_wait_cpu_s", "transfer_s", "compute_s")


class _Mean:
    """The running ``mean`` of the values added (0.0 before one), and their ``total``."""

    __slots__ = ("count", "mean", "total")

    def __init__(self) -> None:
        self.total, self.mean, self.count = 0.0, 0.0, 0

    def add(self, value: float) -> float:
        self.total, self.count = self.total + value, self.count + 1
        self.mean = self.total / self.count
        return value


class StepClock:
    """Splits training steps into data wait, transfer, compute and other, from host timers (``clock``, in
    seconds), the first ``warmup_steps`` not measured. Call, in a training loop's order: :meth:`epoch_start`;
    per step :meth:`add_fetch`, :meth:`add_transfer`, :meth:`step_start`, :meth:`add_forward`, :meth:`step_end`;
    :meth:`add_excluded` for time between steps. The ``add_*`` calls may come in some steps only: in the others the
    transfer and forward are the mean of the steps they were timed in, the data wait the gap between the previous
    step's end and this one's start less the mean of that gap's rest (transfer, hooks) in the steps it was timed in.

    A hot path notes steps instead, from their fetch: :meth:`note_boundary` (the open step ends, the next fetch
    starts) and :meth:`note_fetched` (its step starts). Such a step's data wait is its fetch; its compute, the rest of
    its time less the mean rest of the timed steps. Noting only appends the time: every other call first settles the
    notes, in order (``steps_seen``, ``measured_steps`` and :attr:`series` lag until then, or :meth:`settle`)."""

    def __init__(self, warmup_steps: int = 3, clock: Callable[[], float] = time.perf_counter) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, "warmup_steps=3")
        self._clock = clock
        self.steps_seen = self.epochs_seen = self.measured_steps = 0
        self.worker_startup_s: list[float] = []
        self.excluded_s: dict[str, float] = collections.defaultdict(float)
        #: every measured step's figures (:data:`_COLUMNS`), binned
        self.series = BinnedSeries(_COLUMNS)
        self._window_start = StepTotals()
        self._epoch_started_at: Optional[float] = None
        self._train_started_at: Optional[float] = None
        self._last_end: Optional[float] = None
        self._step_started_at: Optional[float] = None
        self._measuring_step = False
        # over the measured steps each was timed in: the gap before the step less its fetch; the fetch, its CPU time
        self._rest, self._fetch, self._fetch_cpu, self._transfer, self._forward = (_Mean() for _ in range(5))
        self._notes: list[Any] = []  # each boundary's time; each fetched batch's (time, samples)
        self._fetch_started_at: Optional[float] = None
        self._fetch_s: Optional[float] = None
        self._compute_s: Optional[float] = None  # step start to end; None: noted
        self._open_samples = 0  # the open step's samples, from its fetch (noted) or compute_end, until its end
        self._clear_pending()

    def note_boundary(self) -> None:
        self._notes.append(self._clock())

    def note_fetched(self, samples: int) -> None:
        self._notes.append((self._clock(), samples))

    def settle(self) -> None:
        """Run the notes, in order; the time this takes is the monitor's, kept out of the step it falls in (as
        ``excluded_s["monitor"]``)."""
        if not self._notes:
            return
        notes, self._notes, started = self._notes, [], self._clock()
        for note in notes:
            if type(note) is tuple:  # the fetch since the boundary: the step starts
                fetched_at, self._open_samples = note
                self._fetch_s = fetched_at - self._fetch_started_at if self._fetch_started_at is not None else None
                self._start_at(fetched_at)
            else:
                self._end_at(note, self._open_samples)
                self._fetch_started_at = note
        self.add_excluded("monitor", self._clock() - started)

    def epoch_start(self) -> None:
        """A training epoch starts: its first batch carries the loader's start-up cost."""
        self.settle()
        self.epochs_seen += 1
        self._epoch_started_at = self._clock()
        self._train_started_at = self._train_started_at or self._epoch_started_at
        # a step started and never ended (-1 from a hook) is dropped
        self._last_end = self._step_started_at = self._fetch_started_at = None
        self._clear_pending()

    def _clear_pending(self) -> None:
        self._fetch_cpu_s = self._excluded_s = 0.0
        self._fetch_s = self._compute_s = None
        self._forward_s: Optional[float] = None
        self._transfer_s: Optional[float] = None

    def add_fetch(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.settle()
        self._fetch_s = (self._fetch_s or 0.0) + seconds
        self._fetch_cpu_s += cpu_seconds

    def add_transfer(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.settle()
        self._transfer_s = (self._transfer_s or 0.0) + seconds

    def add_forward(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.settle()
        self._forward_s = (self._forward_s or 0.0) + seconds

    def add_excluded(self, kind: str, seconds: float) -> None:
        """Validation, checkpoint saving, ...: totalled under ``kind``, kept out of the steps."""
        self.settle()
        self.excluded_s[kind] += seconds
        self._excluded_s += seconds

    def step_start(self) -> StepStart:
        self.settle()
        self._start_at(self._clock())
        return StepStart(self._measuring_step, self._measuring_step and self._excluded_s == 0)

    def _start_at(self, now: float) -> None:
        self._step_started_at = now
        first_in_epoch = self._last_end is None
        if first_in_epoch and self._epoch_started_at is not None:
            self.worker_startup_s.append(now - self._epoch_started_at - self._excluded_s)
        self._measuring_step = not first_in_epoch and self.steps_seen >= self.warmup_steps

    def step_end(self, samples: int) -> None:
        self._end_at(self.compute_end(samples), samples)

    def compute_end(self, samples: int) -> float:
        """The step's compute ends (now: returned); the step, at the next :meth:`note_boundary` (or :meth:`step_end`)."""
        self.settle()
        now = self._clock()
        if self._step_started_at is not None:
            self._compute_s, self._open_samples = now - self._step_started_at, samples
        return now

    def _end_at(self, now: float, samples: int) -> None:
        if self._step_started_at is None:  # a step that started before we were attached
            return
        if self._measuring_step and self._last_end is not None:
            fetch_s, compute_s, cpu_s = self._fetch_s, self._compute_s, self._fetch_cpu_s  # timed, else estimated
            wall_s = max(now - self._last_end - self._excluded_s, compute_s or 0.0)
            if fetch_s is not None and compute_s is not None:
                self._rest.add(wall_s - compute_s - self._fetch.add(fetch_s))
                self._fetch_cpu.add(cpu_s)
            else:
                fetch_s = max(0.0, wall_s - (compute_s or 0.0) - self._rest.mean) if fetch_s is None else fetch_s
                compute_s = max(0.0, wall_s - fetch_s - self._rest.mean) if compute_s is None else compute_s
                cpu_s = fetch_s * self._fetch_cpu.total / self._fetch.total if self._fetch.total > 0 else 0.0
            transfer_s = self._transfer.mean if self._transfer_s is None else self._transfer.add(self._transfer_s)
            if self._forward_s is not None:
                self._forward.add(self._forward_s)
            self.series.add(self.steps_seen, (samples, wall_s, fetch_s, cpu_s, transfer_s, compute_s))
            self.measured_steps += 1
        self.steps_seen += 1
        self._last_end = now
        self._step_started_at = None
        self._clear_pending()

    def totals(self) -> StepTotals:
        """The measured steps' sums, and the time kept apart."""
        self.settle()
        sums = dict(zip(_COLUMNS, self.series.sums()))
        sums |= {f"{kind}_s": self.excluded_s.get(kind, 0.0) for kind in ("validation", "checkpoint")}
        samples, started = round(sums.pop("samples")), self._train_started_at
        sums["train_s"] = self._clock() - started if started is not None else 0.0
        sums["forward_s"] = self._forward.mean * self.measured_steps
        return StepTotals(self.measured_steps, samples, worker_startup_s=sum(self.worker_startup_s), **sums)

    def take_window(self) -> StepTotals:
        """The steps' sums since the previous call (for periodic logging)."""
        now = self.totals()
        start, self._window_start = self._window_start, now
        return StepTotals(**{name: getattr(now, name) - getattr(start, name) for name in ("steps", *_COLUMNS)})

    def timeline(self, gpu_idle: Optional[BinnedSeries] = None) -> StepTimeline:
        """The measured steps binned; ``gpu_idle`` (:attr:`CudaStepTimer.idle_series`) is kept when it covers
        the same steps."""
        self.settle()
        points = self.series.points()
        _, wall, wait, _, transfer, compute = [list(column) for column in zip(*points)] if points else [[]] * 6
        idle = gpu_idle.points() if gpu_idle is not None and gpu_idle.steps == self.series.steps and points else None
        other = [max(0.0, w - d - t - c) for w, d, t, c in zip(wall, wait, transfer, compute)]
        idle_s = [point[0] for point in idle] if idle is not None else None
        first, every = list(self.series.first_step), self.series.steps_per_point
        return StepTimeline(every, first, wall, wait, transfer, compute, other, idle_s)


class CudaStepTimer:
    """GPU busy and idle seconds per measured step from device events, read lazily; ``steps``, ``busy_s`` and
    ``idle_s`` total the resolved steps. A step's device time starts at :meth:`before_transfer` (its batch
    fetched), so the copy to the device is busy, not idle. ``new_event`` records an event on the device's
    current stream and returns it (``Device.new_event``)."""

    def __init__(self, new_event: Callable[[], Event]) -> None:
        self._new_event = new_event
        self.steps, self.busy_s, self.idle_s = 0, 0.0, 0.0
        #: (start, end, previous step's end or ``None`` after an unclean gap) of unresolved steps
        self._pending: collections.deque[tuple[Event, Event, Optional[Event]]] = collections.deque()
        self._transfer_start: Optional[Event] = None
        self._start: Optional[Event] = None
        self._clean_gap = False
        self._previous_end: Optional[Event] = None
        #: GPU idle seconds before each resolved measured step (0 after an unclean gap), binned
        self.idle_series = BinnedSeries(("gpu_idle_s",))

    def before_transfer(self) -> None:
        """The batch is fetched: the step's device work begins with its copy to the device."""
        self._transfer_start = self._new_event()

    def step_start(self, start: StepStart) -> None:
        event, self._transfer_start = self._transfer_start, None
        self._start = (event or self._new_event()) if start.measured else None
        self._clean_gap = start.clean_gap

    def step_end(self) -> None:
        end = self._new_event()
        if self._start is not None:
            self._pending.append((self._start, end, self._previous_end if self._clean_gap else None))
        self._previous_end, self._start = end, None
        self.poll()

    def poll(self) -> CudaStepTimer:
        """Resolve every recorded step whose end event has completed, without blocking."""
        while self._pending and self._pending[0][1].query():
            start, end, previous_end = self._pending.popleft()
            self.steps += 1
            self.busy_s += start.elapsed_time(end) / 1e3
            idle_s = max(0.0, previous_end.elapsed_time(start) / 1e3) if previous_end is not None else 0.0
            self.idle_s += idle_s
            self.idle_series.add(self.steps - 1, (idle_s,))
        return self

    def finish(self) -> CudaStepTimer:
        """Wait for the last recorded step (once, at the end) and resolve everything."""
        if self._pending:
            self._pending[-1][1].synchronize()
        return self.poll()
