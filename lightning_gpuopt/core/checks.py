"""Argument checks shared by every constructor: fail early, naming the argument, the value and what would work.

>>> check_number("tolerance", 1.5, low=0, high=1, high_inclusive=False, example="tolerance=0.05")
Traceback (most recent call last):
ValueError: `tolerance` must be a number in [0, 1), got 1.5; e.g. tolerance=0.05.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, overload


@overload
def check_int(name: str, value: Any, minimum: int, example: str, allow_none: Literal[False] = False) -> int: ...
@overload
def check_int(name: str, value: Any, minimum: int, example: str, allow_none: bool) -> Optional[int]: ...
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
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    above = low is None or (number and (value > low or (low_inclusive and value == low)))
    below = high is None or (number and (value < high or (high_inclusive and value == high)))
    if number and above and below:
        return float(value)
    lower = f"{'>=' if low_inclusive else '>'} {low:g}" if low is not None else ""
    upper = f"{'<=' if high_inclusive else '<'} {high:g}" if high is not None else ""
    if low is not None and high is not None:
        lower, upper = f"in {'[' if low_inclusive else '('}{low:g}, {high:g}{']' if high_inclusive else ')'}", ""
    kind = "a finite number" if isinstance(value, float) and math.isinf(value) else "a number"
    raise ValueError(f"`{name}` must be {kind} {lower or upper or '(int or float)'}, got {value!r}; e.g. {example}.")


def check_bool(name: str, value: Any, example: str, allow_none: bool = False) -> Optional[bool]:
    """``value`` when it is ``True`` or ``False`` (or ``None`` when allowed), else a ``ValueError``: ``"false"``
    and numbers are refused, as ``bool("false")`` would turn on what the user meant to turn off."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        none = " (or None)" if allow_none else ""
        got = f"{value!r} (a {type(value).__name__})"
        raise ValueError(f"`{name}` must be True or False{none}, got {got}; e.g. {example}.")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any], example: str) -> Any:
    """``value`` when it is one of ``choices`` (of the same type: ``1`` is not ``True``), else a ``ValueError``."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        listed = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"`{name}` must be one of {listed}, got {value!r}; e.g. {example}.")
    return value


def check_name(name: str, value: Any, example: str) -> str:
    """``value`` when it is a non-empty string (an attribute or class name), else a ``ValueError``."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"`{name}` must be a non-empty name (a str), got {value!r}; e.g. {example}.")
    return value


def check_path(name: str, value: Any, example: str, allow_none: bool = False) -> Optional[str | os.PathLike]:
    """``value`` when it is a non-empty ``str`` or ``os.PathLike`` under no file (or ``None`` when allowed), else a ``ValueError``."""
    if value is None and allow_none:
        return value
    if not isinstance(value, os.PathLike) and (not isinstance(value, str) or not value.strip()):
        none = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be a path (a str or os.PathLike){none}, got {value!r}; e.g. {example}.")
    blocker = next((p for p in Path(os.fspath(value)).parents if p.is_file()), None)
    if blocker is not None and "://" not in os.fspath(value):
        raise ValueError(f"`{name}`={value!r} lies under {blocker}, which is a file, not a folder; e.g. {example}.")
    return value
