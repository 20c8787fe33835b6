"""The largest batch size that fits a memory budget, found in a handful of trials.

Pure: the search calls an oracle ``fits(batch_size) -> (fitted, peak_bytes)`` that runs a real trial. It probes
``start`` (``near=True``: a prediction within a few percent, walked from in steps of ``tolerance * 2**(k-1)``),
extrapolates on the line through the two largest fits (at most ``max_growth`` times the largest), interpolates
once a size missed, bisects when the line is flat or contradicted (for good after two of its guesses missed),
stops once the next size up or one within ``tolerance`` missed, and checks the answer with ``confirm``. The
answer was tested and fitted, never extrapolated. ``headroom`` ``h``: ``b`` fits only if its peak plus ``h * b``
samples at the measured bytes per sample fits. See docs/batch-size-search.md.

    >>> def fits(batch_size):                 # peak = 1 MB + 10 kB per sample, budget 11 MB
    ...     peak = 1_000_000 + 10_000 * batch_size
    ...     return peak <= 11_000_000, peak
    >>> result = search_largest_fit(fits, budget_bytes=11_000_000, start=64, max_batch_size=4096)
    >>> result.batch_size, result.stop_reason, [trial.batch_size for trial in result.trials]
    (1000, 'bracketed', [64, 256, 1000, 1001])
    >>> search = dict(budget_bytes=11_000_000, start=64, max_batch_size=4096, headroom=1 / 32)  # 3% lower
    >>> search_largest_fit(fits, **search, bytes_per_sample=10_000).batch_size, search_largest_fit(fits, **search).batch_size
    (969, 966)

A meter that under-reports (the line says 130 fit): the first miss contradicts it, and the search bisects:

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


@dataclass
class Trial:
    """One real trial: did ``batch_size`` fit, its peak (of a miss: what was live when it failed, a
    lower bound; ``None``: unknown), and how long it took."""

    batch_size: int
    fits: bool
    peak_bytes: Optional[int]
    seconds: float


@dataclass
class BatchSizeSearchResult:
    """What a search found. ``batch_size`` is ``None`` only when ``min_batch_size`` did not fit."""

    batch_size: Optional[int]
    trials: list[Trial] = field(default_factory=list)
    #: the cap the search planned with (``max_memory``, kept as ``limit_bytes``, less the margin; under DDP the smallest rank's)
    budget_bytes: int = 0
    #: ``"bracketed"`` (the next size up missed), ``"within tolerance"``, ``"upper bound"``, ``"max trials"``, ``"nothing fits"``
    stop_reason: str = ""
    start_batch_size: int = 0
    lower_bound: int = 1
    upper_bound: int = 1
    #: filled in by the callback
    initial_batch_size: Optional[int] = None
    predicted_batch_size: Optional[int] = None
    limit_bytes: Optional[int] = None
    steps_per_trial: int = 0
    steps: int = 0  #: the training batches the trials began (a trial that ran out of memory: fewer)
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
    """The largest multiple of ``multiple_of`` at most ``value``: ``round_down(1003.7, 8) == 1000``."""
    return math.floor(value / multiple_of) * multiple_of


def round_up(value: float, multiple_of: int) -> int:
    """The smallest multiple of ``multiple_of`` at least ``value`` (exact for ints of any size).

    >>> round_up(1003.7, 8), round_up(1000, 8), round_up(1, 512), round_up(0, 512)
    (1008, 1000, 512, 0)
    """
    if isinstance(value, int):
        return -(-value // multiple_of) * multiple_of
    return math.ceil(value / multiple_of) * multiple_of


def largest_stepping_size(batch_size: int, samples: int, batches_per_step: int, multiple_of: int = 1) -> int:
    """The largest size up to ``batch_size`` (a multiple of ``multiple_of``) whose epoch of ``samples`` holds
    ``batches_per_step`` full batches, so that the optimizer steps in every epoch; 0 when none does.

    >>> largest_stepping_size(1024, 1024, 3, multiple_of=8), largest_stepping_size(64, 1024, 2)
    (336, 64)
    """
    return min(batch_size, round_down(samples // max(1, batches_per_step), multiple_of))


def predicted_largest_fit(
    points: list[tuple[int, int]], budget_bytes: int, bytes_per_sample: Optional[float] = None
) -> Optional[float]:
    """Where the line through the two largest fitting ``(batch_size, peak_bytes)`` (one point: slope
    ``bytes_per_sample``, else through zero) reaches the budget; ``None`` without points or with a flat line.

    >>> predicted_largest_fit([(10, 2_000), (20, 3_000)], 11_000)
    100.0
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
    return None if not slope or slope <= 0 else top_size + (budget_bytes - top_peak) / slope


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


@dataclass
class _State:
    tolerance: float  # stop once the smallest miss is within this share of the largest fit
    best: Optional[int] = None  # largest size that fitted
    miss: Optional[int] = None  # smallest size that did not fit
    points: list[tuple[int, int]] = field(default_factory=list)
    line_misses: int = 0  # the line's guesses that did not fit although it said they would
    near: bool = False  # ``start`` predicts the limit within a few percent: walk from it (see search_largest_fit)
    trials: int = 0


def _next_guess(
    state: _State, lo: int, hi: int, m: int, budget_bytes: int, bytes_per_sample: Optional[float], max_growth: float
) -> tuple[Optional[int], str, Optional[float]]:
    """``(next size or None to stop, stop reason, the line's prediction when the size is its guess)``."""
    best, miss = state.best, state.miss
    step = state.tolerance * 2 ** (state.trials - 1) if state.near else 0.5  # a walk's step doubles from the tolerance
    if best is None:  # only misses so far: halve (walk down) towards the lower bound
        assert miss is not None
        down = _clamp(round_down(miss * max(0.5, 1 - step), m), lo, miss - m)
        return (None, "nothing fits", None) if miss <= lo else (down, "", None)
    if miss is not None and miss - best <= max(m, state.tolerance * best):
        return None, "bracketed" if miss - best <= m else "within tolerance", None
    if miss is None and best >= hi:
        return None, "upper bound", None
    growth = 1 + step if state.near else max_growth
    ceiling = miss - m if miss is not None else min(hi, max(best + m, round_down(best * growth, m)))
    # one fit, no miss: the estimate's slope (after a miss, one point uses the line through zero)
    estimated = miss is None and len(state.points) == 1 and bool(bytes_per_sample)
    predicted = predicted_largest_fit(state.points, budget_bytes, bytes_per_sample if estimated else None)
    line = None
    if predicted is None:  # a flat line: no information; bisect, or grow as far as allowed
        target = ceiling if miss is None else (best + miss) / 2
    elif estimated:
        target = predicted
    elif state.line_misses >= 2 or predicted < best or (miss is not None and predicted >= miss):
        # the line contradicts a trial, or two of its guesses missed: bisect the bracket, or double until a miss
        target = best * 2 if miss is None else (best + miss) / 2
    else:  # a prediction below the next size up says "the largest fit is the limit": test the next size up
        target = line = predicted
    return _clamp(round_down(target, m), best + m, ceiling), "", line


def search_largest_fit(
    fits: Callable[[int], tuple[bool, Optional[int]]],
    *,
    budget_bytes: int,
    start: int,
    max_batch_size: int,
    min_batch_size: int = 1,
    multiple_of: int = 1,
    max_trials: int = 10,
    bytes_per_sample: Optional[float] = None,
    max_growth: float = 4.0,
    headroom: float = 0.0,
    tolerance: float = 0.0,
    confirm: Optional[Callable[[int], bool]] = None,
    on_trial: Optional[Callable[[Trial], None]] = None,
    near: bool = False,
) -> BatchSizeSearchResult:
    """The largest batch size in ``[min_batch_size, max_batch_size]``, a multiple of ``multiple_of``, that
    ``fits``, in at most ``max_trials`` calls; a guess is at most ``max_growth`` times the largest fit.

    Args:
        fits: runs a real trial at a batch size: ``(fitted, peak_bytes)``, ``peak_bytes`` ``None`` when unknown.
        budget_bytes: the memory a trial's peak must stay within (for the extrapolation).
        start: the first size to try (rounded and clamped), e.g. the estimate's predicted maximum.
        bytes_per_sample: the estimate's slope, used while only one trial has fitted.
        headroom: a size fits only if ``headroom`` times it more samples would too (see the module docstring).
        tolerance: stop once the smallest miss is within ``tolerance`` times the largest fit of it (0: exact).
        confirm: whether the answer holds (e.g. more steps); where not, it is a miss and the search goes on below.
        on_trial: called with each trial as it ends (progress reporting).
        near: ``start`` is within a few percent of the limit: walk from it (see the module docstring).
    """
    if multiple_of < 1 or max_trials < 1 or min_batch_size < 1 or max_growth <= 1 or not 0 <= tolerance < 1:
        need = "need multiple_of >= 1, max_trials >= 1, min_batch_size >= 1, max_growth > 1 and 0 <= tolerance < 1"
        raise ValueError(f"{need}; got {multiple_of=}, {max_trials=}, {min_batch_size=}, {max_growth=}, {tolerance=}")
    lo, hi = round_up(min_batch_size, multiple_of), round_down(max_batch_size, multiple_of)
    if lo > hi:
        bounds = f"[min_batch_size={min_batch_size}, max_batch_size={max_batch_size}]"
        instead = "lower multiple_of or min_batch_size, or raise the upper bound"
        raise ValueError(f"no multiple of multiple_of={multiple_of} lies in {bounds}; {instead}")
    state, trials, confirmed = _State(tolerance=tolerance, near=near), list[Trial](), set[int]()
    first = _clamp(round_down(start, multiple_of), lo, hi)
    size: Optional[int] = first
    reason, line_prediction, holds, refuted = "", None, confirm or (lambda _: True), False
    while (size is not None and len(trials) < max_trials) or (confirm and state.best not in (None, *confirmed)):
        started, reported = time.perf_counter(), len(trials)
        if size is None or len(trials) >= max_trials:  # the answer, confirmed before it is given
            confirmed.add(answer := int(state.best or 0))
            if holds(answer):
                continue
            trials.append(Trial(answer, False, None, time.perf_counter() - started))
            state.miss = answer
            state.best = max((t.batch_size for t in trials if t.fits and t.batch_size < answer), default=None)
            if not refuted and (state.best or 0) < (below := answer - multiple_of) >= lo:  # the next size down
                confirmed.add(below)
                trials.append(Trial(below, holds(below), None, time.perf_counter() - started))
                state.best, state.miss = (below, answer) if trials[-1].fits else (state.best, below)
            refuted = True  # short trials do not decide here: every later trial is a confirmation
        else:
            fitted, peak = (holds(size), None) if refuted else fits(size)
            confirmed.update([size] if refuted else [])
            padded = None if peak is None else int(peak + headroom * size * (bytes_per_sample or peak / size))
            fitted = bool(fitted) and (not headroom or padded is None or padded <= budget_bytes)
            trials.append(Trial(size, fitted, None if peak is None else int(peak), time.perf_counter() - started))
            if fitted:
                state.best = size if state.best is None else max(state.best, size)
                if padded is not None:
                    state.points.append((size, padded))
            else:
                state.miss = size if state.miss is None else min(state.miss, size)
                state.line_misses += line_prediction is not None and line_prediction >= size  # the line said it fits
        if on_trial is not None:  # each trial this round ran, as it ended
            for trial in trials[reported:]:
                on_trial(trial)
        state.trials = len(trials)
        per_sample = bytes_per_sample and bytes_per_sample * (1 + headroom)
        size, reason, line_prediction = _next_guess(state, lo, hi, multiple_of, budget_bytes, per_sample, max_growth)
    return BatchSizeSearchResult(
        state.best, trials, budget_bytes, reason or "max trials", first, lower_bound=lo, upper_bound=hi
    )
