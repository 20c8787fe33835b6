"""Step clock: where each training step's wall time goes, and how long the GPU sat idle.

:class:`StepClock` is fed host timestamps by an adapter (the ``DataWaitMonitor`` callback)
and splits every measured training step into

* **data wait** -- the dataloader ``next()`` for this step's batch,
* **transfer** -- host-to-device copy of the batch (``batch_to_device``),
* **compute** -- from the start to the end of the step (forward, backward, optimizer),
* **other** -- the rest of the step's wall time (hooks, logging, LR schedulers, progress bar).

Validation and checkpoint saving that happen between two steps are *excluded* from the
step and totalled apart, and the first step of every epoch is not measured: the time from
the epoch start to its first batch (dataloader worker start-up) is totalled as
``worker_startup_s``. The first ``warmup_steps`` steps of the run are not measured either.
:attr:`StepClock.series` keeps the same split per measured step, binned to at most
:data:`TIMELINE_POINTS` points (:class:`StepTimeline`, for the "step time over training" plot).

:class:`CudaStepTimer` records a CUDA event at the start and end of every measured step and
reads them lazily with ``Event.query()``, so it never synchronises the device during
training: GPU busy is start -> end of a step, GPU idle is end of step i-1 -> start of step i.

Example::

    >>> clock = StepClock(warmup_steps=0)
    >>> clock.epoch_start()
    >>> for _ in range(3):
    ...     clock.add_fetch(0.0)
    ...     _ = clock.step_start()
    ...     clock.step_end(samples=8)
    >>> clock.totals.steps  # the epoch's first step is start-up, not a measured step
    2
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from lightning_gpuopt.core.checks import check_int


@dataclass
class StepTotals:
    """Sums over measured training steps (seconds, except ``steps`` and ``samples``)."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    data_wait_s: float = 0.0
    data_wait_cpu_s: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    forward_s: float = 0.0

    @property
    def other_s(self) -> float:
        """Wall time of the steps not spent waiting for data, transferring, or computing."""
        return max(0.0, self.wall_s - self.data_wait_s - self.transfer_s - self.compute_s)

    def fraction(self, seconds: float) -> Optional[float]:
        """``seconds`` as a share of the measured wall time; ``None`` before any step."""
        return seconds / self.wall_s if self.wall_s > 0 else None

    @property
    def loader_cpu_fraction(self) -> Optional[float]:
        """CPU seconds the process spent per second of data wait (near 1: loading computes in
        the main process; near 0: it waits on I/O or on worker processes)."""
        return min(1.0, self.data_wait_cpu_s / self.data_wait_s) if self.data_wait_s > 0 else None

    @property
    def samples_per_second(self) -> Optional[float]:
        return self.samples / self.wall_s if self.wall_s > 0 and self.samples > 0 else None

    @property
    def step_time_s(self) -> Optional[float]:
        return self.wall_s / self.steps if self.steps else None


#: at most this many points in a :class:`StepTimeline` (pairs of points merge when a run has more)
TIMELINE_POINTS = 200


@dataclass
class StepTimeline:
    """Where step time went over training: measured steps binned into consecutive groups of
    ``steps_per_point`` steps, each column the mean per step of its group (seconds).

    ``step`` is the training step (0-based, every step of the run counted, warm-up included) at
    which each group starts; ``gpu_idle_s`` is filled on CUDA only (``None`` elsewhere).

    Example::

        >>> series = BinnedSeries(("wall_s",), max_points=2)
        >>> for step in range(4):
        ...     series.add(step, (float(step),))
        >>> series.points(), series.steps_per_point
        ([[0.5], [2.5]], 2)
    """

    steps_per_point: int = 1
    step: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    other_s: list[float] = field(default_factory=list)
    gpu_idle_s: Optional[list[float]] = None


class BinnedSeries:
    """Per-step values summed into at most ``max_points`` bins of ``steps_per_point`` consecutive
    steps; when a new step would make one bin too many, neighbouring bins merge in pairs and
    ``steps_per_point`` doubles. Memory stays ``O(max_points)`` however long the run."""

    def __init__(self, columns: Sequence[str], max_points: int = TIMELINE_POINTS) -> None:
        self.columns = tuple(columns)
        self.max_points = check_int("max_points", max_points, 2, f"max_points={TIMELINE_POINTS}")
        self.steps_per_point = 1
        self.first_step: list[int] = []
        self._sums: list[list[float]] = []
        self._counts: list[int] = []

    @property
    def steps(self) -> int:
        return sum(self._counts)

    def add(self, step: int, values: Sequence[float]) -> None:
        if (not self._counts or self._counts[-1] >= self.steps_per_point) and len(self._counts) == self.max_points:
            self._merge_pairs()
        if self._counts and self._counts[-1] < self.steps_per_point:
            self._counts[-1] += 1
            self._sums[-1] = [total + value for total, value in zip(self._sums[-1], values)]
        else:
            self.first_step.append(step)
            self._counts.append(1)
            self._sums.append([float(value) for value in values])

    def _merge_pairs(self) -> None:
        self.steps_per_point *= 2
        pairs = range(0, len(self._counts), 2)
        self.first_step = [self.first_step[i] for i in pairs]
        self._sums = [
            [a + b for a, b in zip(*self._sums[i : i + 2])] if i + 1 < len(self._sums) else self._sums[i] for i in pairs
        ]
        self._counts = [sum(self._counts[i : i + 2]) for i in pairs]

    def points(self) -> list[list[float]]:
        """Each bin's values as means per step, in step order."""
        return [[total / count for total in sums] for sums, count in zip(self._sums, self._counts)]


@dataclass
class _PendingStep:
    """What happened since the previous step ended, before the next one starts."""

    fetch_s: float = 0.0
    fetch_cpu_s: float = 0.0
    transfer_s: float = 0.0
    forward_s: float = 0.0
    excluded_s: float = 0.0


@dataclass(frozen=True)
class StepStart:
    """Returned by :meth:`StepClock.step_start`: whether this step is measured, and whether
    the gap before it is a clean step-to-step gap (no validation, checkpoint or epoch start)."""

    measured: bool
    clean_gap: bool


class StepClock:
    """Splits training steps into data wait, transfer, compute and other, from host timers.

    The adapter calls, in the order a training loop produces them: :meth:`epoch_start`;
    then per step :meth:`add_fetch` / :meth:`add_transfer` (durations measured around the
    dataloader ``next()`` and the device copy), :meth:`step_start`, :meth:`add_forward`,
    :meth:`step_end`; and :meth:`add_excluded` for validation or checkpoint time between
    steps.

    Args:
        warmup_steps: steps at the start of the run that are not measured (allocator
            growth, cuDNN autotuning, lazy initialisation).
        clock: a monotonic clock in seconds.
    """

    def __init__(self, warmup_steps: int = 3, clock: Callable[[], float] = time.perf_counter) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, "warmup_steps=3")
        self._clock = clock
        self.totals = StepTotals()
        self.window = StepTotals()
        self.steps_seen = 0
        self.epochs_seen = 0
        self.worker_startup_s: list[float] = []
        self.excluded_s: dict[str, float] = collections.defaultdict(float)
        #: every measured step's wall, data wait, transfer and compute seconds, binned
        self.series = BinnedSeries(("wall_s", "data_wait_s", "transfer_s", "compute_s"))
        self._pending = _PendingStep()
        self._epoch_started_at: Optional[float] = None
        self._last_end: Optional[float] = None
        self._step_started_at: Optional[float] = None
        self._measuring_step = False

    # -- fed by the adapter ------------------------------------------------------------
    def epoch_start(self) -> None:
        """A training epoch starts: its first batch carries the loader's start-up cost."""
        self.epochs_seen += 1
        self._epoch_started_at = self._clock()
        self._last_end = None
        self._pending = _PendingStep()

    def add_fetch(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self._pending.fetch_s += seconds
        self._pending.fetch_cpu_s += cpu_seconds

    def add_transfer(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self._pending.transfer_s += seconds

    def add_forward(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self._pending.forward_s += seconds

    def add_excluded(self, kind: str, seconds: float) -> None:
        """Validation, checkpoint saving, ...: totalled under ``kind``, kept out of the steps."""
        self.excluded_s[kind] += seconds
        self._pending.excluded_s += seconds

    def step_start(self) -> StepStart:
        now = self._clock()
        self._step_started_at = now
        first_in_epoch = self._last_end is None
        if first_in_epoch and self._epoch_started_at is not None:
            self.worker_startup_s.append(now - self._epoch_started_at - self._pending.excluded_s)
        self._measuring_step = not first_in_epoch and self.steps_seen >= self.warmup_steps
        return StepStart(
            measured=self._measuring_step, clean_gap=self._measuring_step and self._pending.excluded_s == 0
        )

    def step_end(self, samples: int) -> None:
        now = self._clock()
        if self._step_started_at is None:  # a step that started before we were attached
            return
        if self._measuring_step and self._last_end is not None:
            step = self._pending
            compute_s = now - self._step_started_at
            wall_s = max(now - self._last_end - step.excluded_s, compute_s)
            for totals in (self.totals, self.window):
                totals.steps += 1
                totals.samples += samples
                totals.wall_s += wall_s
                totals.data_wait_s += step.fetch_s
                totals.data_wait_cpu_s += step.fetch_cpu_s
                totals.transfer_s += step.transfer_s
                totals.compute_s += compute_s
                totals.forward_s += step.forward_s
            self.series.add(self.steps_seen, (wall_s, step.fetch_s, step.transfer_s, compute_s))
        self.steps_seen += 1
        self._last_end = now
        self._step_started_at = None
        self._pending = _PendingStep()

    def timeline(self, gpu_idle: Optional[BinnedSeries] = None) -> StepTimeline:
        """The measured steps binned (:class:`StepTimeline`); ``gpu_idle`` (one value a measured
        step, from :attr:`CudaStepTimer.idle_series`) is kept only when it covers the same steps."""
        points = self.series.points()
        wall, wait, transfer, compute = (list(column) for column in zip(*points)) if points else ([], [], [], [])
        same_steps = gpu_idle is not None and gpu_idle.steps == self.series.steps and points
        return StepTimeline(
            steps_per_point=self.series.steps_per_point,
            step=list(self.series.first_step),
            wall_s=wall,
            data_wait_s=wait,
            transfer_s=transfer,
            compute_s=compute,
            other_s=[max(0.0, w - d - t - c) for w, d, t, c in zip(wall, wait, transfer, compute)],
            gpu_idle_s=[point[0] for point in gpu_idle.points()] if same_steps else None,  # type: ignore[union-attr]
        )

    def take_window(self) -> StepTotals:
        """The totals since the last call (for periodic logging), and start a new window."""
        window, self.window = self.window, StepTotals()
        return window


@dataclass
class GpuTotals:
    """GPU busy and idle seconds over measured steps whose events have completed."""

    steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0

    @property
    def idle_fraction(self) -> Optional[float]:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else None

    def minus(self, earlier: GpuTotals) -> GpuTotals:
        return GpuTotals(self.steps - earlier.steps, self.busy_s - earlier.busy_s, self.idle_s - earlier.idle_s)


class Event(Protocol):
    """A timing event recorded on the device's stream (a CUDA ``Event`` on a real card)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...

    def synchronize(self) -> None: ...


@dataclass
class _RecordedStep:
    start: Event
    end: Event
    previous_end: Optional[Event]


class CudaStepTimer:
    """GPU busy/idle per step from device events, read lazily: no synchronisation while training.

    A step's GPU time starts when its batch has been fetched, before the host-to-device copy
    (:meth:`before_transfer`), so a copy counts as busy, not as idle. Only steps whose events are
    not yet resolved are held, so a long run keeps a few events.

    Args:
        new_event: records an event on the device's current stream and returns it
            (:meth:`lightning_gpuopt.core.device.Device.new_event`).

    Example::

        >>> from lightning_gpuopt.core.device import HostEvent
        >>> timer = CudaStepTimer(HostEvent)
        >>> timer.before_transfer(); timer.step_start(StepStart(measured=True, clean_gap=True)); timer.step_end()
        >>> timer.finish().steps
        1
    """

    def __init__(self, new_event: Callable[[], Event]) -> None:
        self._new_event = new_event
        self.totals = GpuTotals()
        self._pending: collections.deque[_RecordedStep] = collections.deque()
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
            previous_end = self._previous_end if self._clean_gap else None
            self._pending.append(_RecordedStep(self._start, end, previous_end))
        self._previous_end = end
        self._start = None
        self.poll()

    def poll(self) -> GpuTotals:
        """Resolve every recorded step whose end event has completed, without blocking."""
        while self._pending and self._pending[0].end.query():
            step = self._pending.popleft()
            self.totals.steps += 1
            self.totals.busy_s += step.start.elapsed_time(step.end) / 1e3
            idle_s = 0.0
            if step.previous_end is not None:
                idle_s = max(0.0, step.previous_end.elapsed_time(step.start) / 1e3)
                self.totals.idle_s += idle_s
            self.idle_series.add(self.totals.steps - 1, (idle_s,))
        return self.totals

    def finish(self) -> GpuTotals:
        """Wait for the last recorded step (once, at the end) and resolve everything."""
        if self._pending:
            self._pending[-1].end.synchronize()
        return self.poll()
