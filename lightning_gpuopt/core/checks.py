"""Argument checks shared by every constructor: fail early, naming the argument, the value
and what would work.

Example::

    >>> check_int("warmup_steps", 3, minimum=0, example="warmup_steps=3")
    3
    >>> check_number("tolerance", 1.5, low=0, high=1, high_inclusive=False, example="tolerance=0.05")
    Traceback (most recent call last):
    ValueError: `tolerance` must be a number in [0, 1), got 1.5; e.g. tolerance=0.05.
"""

from __future__ import annotations

import math
from typing import Any, Optional


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def check_int(name: str, value: Any, minimum: int, example: str, allow_none: bool = False) -> Optional[int]:
    """``value`` as an int >= ``minimum`` (or ``None`` when allowed), else a ``ValueError``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be an integer >= {minimum}{none}, got {value!r}; e.g. {example}.")
    return value


def check_number(
    name: str,
    value: Any,
    example: str,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """``value`` as a float within the given bounds, else a ``ValueError`` that states them."""
    fits = _is_number(value)
    if fits and low is not None:
        fits = value >= low if low_inclusive else value > low
    if fits and high is not None:
        fits = value <= high if high_inclusive else value < high
    if not fits:
        if low is not None and high is not None:
            bounds = f"in {'[' if low_inclusive else '('}{low:g}, {high:g}{']' if high_inclusive else ')'}"
        elif low is not None:
            bounds = f"{'>=' if low_inclusive else '>'} {low:g}"
        elif high is not None:
            bounds = f"{'<=' if high_inclusive else '<'} {high:g}"
        else:
            bounds = "(int or float)"
        raise ValueError(f"`{name}` must be a number {bounds}, got {value!r}; e.g. {example}.")
    return float(value)
