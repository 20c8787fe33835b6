"""The largest batch size that fits a memory budget, found in a handful of trials.

Pure standard library (no torch, no Lightning): the search only sees an oracle
``fits(batch_size) -> (fitted, peak_bytes)`` that runs a real trial, and decides what to try next:

1. **probe** the start size (the callback passes the calibrated estimate's predicted maximum, so
   the first trial is usually within a few percent of the limit);
2. **extrapolate** while everything fits: peak memory is close to linear in the batch,
   ``peak(b) = a + s * b``; the line through the two largest fits (one fit: the estimate's slope,
   or proportional through zero, which under-shoots) predicts the largest ``b`` whose peak is at
   most the budget. Each jump is capped at ``max_growth`` times the largest fit;
3. once a size missed, **interpolate inside the bracket** (largest fit, smallest miss) with the
   same line (with a single fit: the line through zero, which under-shoots);
4. **bisect** the bracket (or, while nothing missed, double the largest fit) whenever the line
   contradicts a trial -- it says the smallest miss fits, or that the largest fit does not (its
   peak was above the budget) -- or is flat; and for the rest of the search once two of the
   line's guesses missed although it said they fit. The measured peaks are then not what decides
   a fit (the allocator, a cap measured elsewhere, memory the meter does not see, a peak that is
   not linear), and bisection converges whatever the peaks say. One miss alone does not end the
   line: a convex peak (flat, then steep) misses once at its kink and is then exact again;
5. stop when the smallest miss is the largest fit plus ``multiple_of`` (the limit is proven), at
   the upper bound, or after ``max_trials``.

Every size returned was tested and fitted: the answer is the largest fitting trial, never an
extrapolated size. Sizes are multiples of ``multiple_of`` inside ``[min_batch_size,
max_batch_size]``.

Example::

    >>> def fits(batch_size):                 # peak = 1 MB + 10 kB per sample, budget 11 MB
    ...     peak = 1_000_000 + 10_000 * batch_size
    ...     return peak <= 11_000_000, peak
    >>> result = search_largest_fit(fits, budget_bytes=11_000_000, start=64, max_batch_size=4096)
    >>> result.batch_size, len(result.trials), result.stop_reason
    (1000, 4, 'bracketed')
    >>> [trial.batch_size for trial in result.trials]
    [64, 256, 1000, 1001]

A meter that under-reports (the step needs 1 MB a sample, the peak says 1/1.3 of it, so the line
says up to 130 fit): the first miss contradicts the line, and the search bisects::

    >>> def fits(batch_size):                 # true limit 100
    ...     needed = 1_000_000 * batch_size
    ...     return needed <= 100_500_000, int(needed / 1.3)
    >>> result = search_largest_fit(fits, budget_bytes=100_500_000, start=125, max_batch_size=4096)
    >>> result.batch_size, [(t.batch_size, t.fits) for t in result.trials][:4]
    (100, [(125, False), (62, True), (93, True), (109, False)])
    >>> [trial.batch_size for trial in result.trials][4:]
    [101, 97, 99, 100]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

#: ``fits(batch_size) -> (fitted, peak_bytes)``; ``peak_bytes`` may be ``None`` when unknown
FitsOracle = Callable[[int], "tuple[bool, Optional[int]]"]

#: why a search stopped (:attr:`BatchSizeSearchResult.stop_reason`)
STOP_REASONS = {
    "bracketed": "the next size up (largest fit + multiple_of) was tested and did not fit",
    "upper bound": "the largest fit is the upper bound (max_batch_size, the data set or your batch size)",
    "max trials": "max_trials were spent; the largest tested fit is returned",
    "nothing fits": "min_batch_size did not fit",
}


@dataclass
class Trial:
    """One real trial: did ``batch_size`` fit, the peak it measured, and how long it took.

    ``peak_bytes`` of a trial that ran out of memory is what was live when it failed (a lower
    bound of what it needed), or ``None`` if unknown.
    """

    batch_size: int
    fits: bool
    peak_bytes: Optional[int]
    seconds: float


@dataclass
class BatchSizeSearchResult:
    """What a search found. ``batch_size`` is ``None`` only when ``min_batch_size`` did not fit."""

    batch_size: Optional[int]
    trials: list[Trial] = field(default_factory=list)
    #: the cap the search planned with (``max_memory`` less the margin; under DDP the smallest rank's)
    budget_bytes: int = 0
    #: one of :data:`STOP_REASONS`
    stop_reason: str = ""
    #: the first size tried
    start_batch_size: int = 0
    #: the smallest and largest size the search could return
    lower_bound: int = 1
    upper_bound: int = 1
    #: filled in by the callback: the user's batch size before the search, the estimate's
    #: predicted maximum, training steps per trial, ranks that agreed, total seconds, notes
    initial_batch_size: Optional[int] = None
    predicted_batch_size: Optional[int] = None
    steps_per_trial: int = 0
    world_size: int = 1
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @property
    def peak_bytes(self) -> Optional[int]:
        """The peak measured by the trial of the chosen batch size."""
        return next((t.peak_bytes for t in reversed(self.trials) if t.fits and t.batch_size == self.batch_size), None)


def round_down(value: float, multiple_of: int) -> int:
    """The largest multiple of ``multiple_of`` at most ``value``.

    Example::

        >>> round_down(1003.7, 8), round_down(7, 8)
        (1000, 0)
    """
    return math.floor(value / multiple_of) * multiple_of


def round_up(value: float, multiple_of: int) -> int:
    """The smallest multiple of ``multiple_of`` at least ``value`` (in integer arithmetic for an int,
    so exact for byte counts of any size, as the memory trackers use it).

    Example::

        >>> round_up(1003.7, 8), round_up(1000, 8), round_up(1, 512), round_up(0, 512)
        (1008, 1000, 512, 0)
    """
    if isinstance(value, int):
        return -(-value // multiple_of) * multiple_of
    return math.ceil(value / multiple_of) * multiple_of


def predicted_largest_fit(
    points: list[tuple[int, int]], budget_bytes: int, bytes_per_sample: Optional[float] = None
) -> Optional[float]:
    """The batch size at which the line through the measured ``(batch_size, peak_bytes)`` points of
    fitting trials reaches ``budget_bytes`` (not rounded).

    Two or more points: the line through the two largest batch sizes. One point: slope
    ``bytes_per_sample`` if given, else the line through zero (which under-estimates the limit, as
    the fixed part is then counted per sample). ``None`` without points or with a flat line.

    Example::

        >>> predicted_largest_fit([(10, 2_000), (20, 3_000)], 11_000)
        100.0
        >>> round(predicted_largest_fit([(20, 3_000)], 11_000), 2)   # through zero: 11000 / 150
        73.33
    """
    distinct = sorted(dict(points).items())
    if not distinct:
        return None
    top_size, top_peak = distinct[-1]
    if len(distinct) >= 2:
        low_size, low_peak = distinct[-2]
        slope: Optional[float] = (top_peak - low_peak) / (top_size - low_size)
    else:
        slope = bytes_per_sample if bytes_per_sample else top_peak / top_size
    if not slope or slope <= 0:
        return None
    return top_size + (budget_bytes - top_peak) / slope


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


#: after this many of the measured line's guesses did not fit, the line is not used again: the rest of
#: the search bisects (the first miss may be a kink of a convex peak, the second says the peaks lie)
LINE_MISSES_TO_BISECT = 2


@dataclass
class _State:
    best: Optional[int] = None  # largest size that fitted
    miss: Optional[int] = None  # smallest size that did not fit
    points: list[tuple[int, int]] = field(default_factory=list)
    line_misses: int = 0  # the line's guesses that did not fit although it said they would


@dataclass
class _Guess:
    """The next size to try (``None``: stop, for ``stop_reason``). ``line_prediction``: set when the
    size is the measured line's guess, what the line said is the largest fit (not rounded)."""

    batch_size: Optional[int]
    stop_reason: str = ""
    line_prediction: Optional[float] = None


def _line_agrees(predicted: float, best: int, miss: Optional[int]) -> bool:
    """Whether a line's predicted largest fit agrees with the trials: it must not say that the
    largest fit does not fit (its peak was above the budget) nor that the smallest miss fits.

    Example::

        >>> _line_agrees(130.4, best=62, miss=None), _line_agrees(130.4, best=62, miss=125)
        (True, False)
    """
    return best <= predicted and (miss is None or predicted < miss)


def _next_guess(
    state: _State,
    lo: int,
    hi: int,
    multiple_of: int,
    budget_bytes: int,
    bytes_per_sample: Optional[float],
    max_growth: float,
) -> _Guess:
    m = multiple_of
    if state.best is None:  # only misses so far: halve towards the lower bound
        assert state.miss is not None
        if state.miss <= lo:
            return _Guess(None, "nothing fits")
        return _Guess(_clamp(round_down(state.miss / 2, m), lo, state.miss - m))
    if state.miss is not None and state.miss - state.best <= m:
        return _Guess(None, "bracketed")
    if state.miss is None and state.best >= hi:
        return _Guess(None, "upper bound")
    ceiling = hi if state.miss is None else state.miss - m
    if state.miss is None:
        ceiling = min(ceiling, max(state.best + m, round_down(state.best * max_growth, m)))
    if state.miss is None and len(state.points) == 1 and bytes_per_sample:
        # one fit, no miss: the estimate's slope (a miss proves it wrong, then one point uses the line through zero)
        predicted = predicted_largest_fit(state.points, budget_bytes, bytes_per_sample)
        return _Guess(ceiling if predicted is None else _clamp(round_down(predicted, m), state.best + m, ceiling))
    predicted = predicted_largest_fit(state.points, budget_bytes)
    if predicted is None:  # a flat line: no information; bisect, or grow as far as allowed
        target = ceiling if state.miss is None else (state.best + state.miss) / 2
        return _Guess(_clamp(round_down(target, m), state.best + m, ceiling))
    if state.line_misses >= LINE_MISSES_TO_BISECT or not _line_agrees(predicted, state.best, state.miss):
        # the measured peaks are not what decides a fit: bisect the bracket, or double until a size misses
        target = state.best * 2 if state.miss is None else (state.best + state.miss) / 2
        return _Guess(_clamp(round_down(target, m), state.best + m, ceiling))
    # a prediction below the next size up says "the largest fit is the limit": test the next size up
    return _Guess(_clamp(round_down(predicted, m), state.best + m, ceiling), line_prediction=predicted)


def search_largest_fit(
    fits: FitsOracle,
    *,
    budget_bytes: int,
    start: int,
    max_batch_size: int,
    min_batch_size: int = 1,
    multiple_of: int = 1,
    max_trials: int = 10,
    bytes_per_sample: Optional[float] = None,
    max_growth: float = 4.0,
    on_trial: Optional[Callable[[Trial], None]] = None,
) -> BatchSizeSearchResult:
    """The largest batch size in ``[min_batch_size, max_batch_size]`` (a multiple of ``multiple_of``)
    for which ``fits`` says yes, found with few calls (see the module docstring).

    Args:
        fits: runs a real trial at a batch size: ``(fitted, peak_bytes)``.
        budget_bytes: the memory a trial's peak must stay within (for the extrapolation).
        start: the first size to try (rounded and clamped), e.g. the estimate's predicted maximum.
        max_batch_size: the largest size that may be tried (e.g. the data set length).
        min_batch_size: the smallest size that may be tried.
        multiple_of: every size tried is a multiple of this.
        max_trials: at most this many calls of ``fits``.
        bytes_per_sample: the estimate's slope, used while only one trial has fitted.
        max_growth: a guess is at most this many times the largest fit.
        on_trial: called with each trial as it ends (progress reporting).

    Raises:
        ValueError: when no multiple of ``multiple_of`` lies in the range, or an argument is out of range.
    """
    if multiple_of < 1 or max_trials < 1 or min_batch_size < 1 or max_growth <= 1:
        raise ValueError(
            f"need multiple_of >= 1, max_trials >= 1, min_batch_size >= 1 and max_growth > 1; got {multiple_of=}, "
            f"{max_trials=}, {min_batch_size=}, {max_growth=}"
        )
    lo, hi = round_up(min_batch_size, multiple_of), round_down(max_batch_size, multiple_of)
    if lo > hi:
        raise ValueError(
            f"no multiple of multiple_of={multiple_of} lies in [min_batch_size={min_batch_size}, "
            f"max_batch_size={max_batch_size}]; lower multiple_of or min_batch_size, or raise the upper bound"
        )
    state = _State()
    trials: list[Trial] = []
    first = _clamp(round_down(start, multiple_of), lo, hi)
    guess = _Guess(first)
    reason = "max trials"
    while guess.batch_size is not None and len(trials) < max_trials:
        size = guess.batch_size
        started = time.perf_counter()
        fitted, peak = fits(size)
        trials.append(Trial(size, bool(fitted), None if peak is None else int(peak), time.perf_counter() - started))
        if on_trial is not None:
            on_trial(trials[-1])
        if fitted:
            state.best = size if state.best is None else max(state.best, size)
            if peak is not None:
                state.points.append((size, int(peak)))
        else:
            state.miss = size if state.miss is None else min(state.miss, size)
        if not fitted and guess.line_prediction is not None and guess.line_prediction >= size:
            state.line_misses += 1  # the line said it fits
        guess = _next_guess(state, lo, hi, multiple_of, budget_bytes, bytes_per_sample, max_growth)
        reason = guess.stop_reason or reason
    return BatchSizeSearchResult(
        batch_size=state.best,
        trials=trials,
        budget_bytes=budget_bytes,
        stop_reason=reason,
        start_batch_size=first,
        lower_bound=lo,
        upper_bound=hi,
    )
