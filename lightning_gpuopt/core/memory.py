"""Amounts of memory (:func:`parse_memory`), a simulated memory cap (:class:`MemoryBudget`, whose OOM says "CUDA out of
memory" as a real one does) and out-of-memory errors (:func:`is_out_of_memory_error`, :func:`call_catching_oom`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY, card_allocated_memory, device_for, release_memory
from lightning_gpuopt.core.op_memory import LiveTensorTracker

MIN_MAX_MEMORY_BYTES = 1024  #: the fewest bytes a callback's ``max_memory`` accepts (not ``max_memory=1``)

_MEMORY_STRING = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# out-of-memory errors' messages: CUDA, MPS, XPU, cuBLAS, cuDNN (its workspace failed), the CPU allocator
_OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_SUPPORTED", "DefaultCPUAllocator: can't allocate memory")  # fmt: skip


def parse_memory(
    value: int | float | str,
    device: torch.device | str | int | None = None,
    *,
    name: str = "max_memory",
    minimum: int = 1,
) -> int:
    """Bytes from an int, a string such as ``"300MB"`` or ``"20GiB"``, or a fraction in ``(0, 1]`` of ``device``."""
    works = f'an int of bytes >= {minimum}, a string such as "300MB" or "20GiB", or a float in (0, 1] (of the device)'

    def fail(problem: str) -> ValueError:
        return ValueError(f"`{name}`={value!r} {problem}; expected {works}.")

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise fail("is a bool" if isinstance(value, bool) else f"has type {type(value).__name__}")
    of, hint = "", ""
    if isinstance(value, int):
        num_bytes, hint = value, "; for the whole device give the fraction 1.0"
    elif isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise fail("is a float outside (0, 1]")
        if device is None:
            instead = 'pass `device=` or give bytes / a string such as "20GiB"'
            raise ValueError(f"`{name}`={value!r} is a fraction of a device, but no device was given; {instead}.")
        total = device_for(device).total_memory()
        num_bytes, of = int(value * total), f" of the device's {total}"
    else:
        match = _MEMORY_STRING.match(value)
        if match is None:
            raise fail("is not a memory size")
        unit = (match.group(2) or "B").upper()  # K, M, G, T: powers of 1000, or of 1024 with an "i"
        num_bytes = int(float(match.group(1)) * (1024 if "I" in unit else 1000) ** "BKMGT".index(unit[0]))
    if num_bytes <= 0 and not of:
        raise fail("is not positive" if hint else "is zero bytes")
    if num_bytes < minimum:
        raise fail(f"is {num_bytes} bytes{of}, below the minimum of {minimum} bytes{hint}")
    return num_bytes


class MemoryBudget(LiveTensorTracker):
    """A simulated memory cap: raises ``torch.OutOfMemoryError`` when live tensors would pass it.

    Args:
        max_memory: the cap, as :func:`parse_memory` takes it (a fraction is of ``device``).
        existing: objects whose tensors count from entry: modules, optimizers, batches.
        device: count only tensors on this device (on CUDA in 512-byte blocks).
        baseline_bytes: a fixed amount counted as live (memory held outside tensors).

    >>> with MemoryBudget("1MB", existing=[torch.zeros(1000)]) as budget:  # 4000 bytes from entry
    ...     c = torch.zeros(2000)
    >>> budget.peak_bytes
    12000
    """

    def __init__(
        self,
        max_memory: int | float | str,
        *,
        existing: Iterable[Any] = (),
        device: torch.device | str | None = None,
        baseline_bytes: int = 0,
    ) -> None:
        on_cuda = device is not None and torch.device(device).type == "cuda"
        cap, granularity = parse_memory(max_memory, device), CUDA_ALLOCATION_GRANULARITY if on_cuda else 1
        super().__init__(cap, existing=existing, device=device, granularity=granularity, baseline_bytes=baseline_bytes)


def is_out_of_memory_error(exception: BaseException) -> bool:
    """Whether ``exception`` means the device ran out of memory: any ``torch.OutOfMemoryError`` or
    ``MemoryError``, or a ``RuntimeError`` from CUDA/MPS/XPU, cuBLAS, cuDNN or the CPU allocator."""
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = " ".join(str(arg) for arg in exception.args)
    return isinstance(exception, RuntimeError) and any(marker in message for marker in _OOM_MARKERS)


@dataclass
class CallOutcome:
    """What :func:`call_catching_oom` returns: the value, or that the call ran out of memory."""

    value: Any = None
    out_of_memory: bool = False
    error_message: Optional[str] = None


def call_catching_oom(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CallOutcome:
    """Call ``fn``; report an OOM instead of raising it, with its memory freed (other errors propagate)."""
    allocated_before = card_allocated_memory()
    try:
        return CallOutcome(value=fn(*args, **kwargs))
    except BaseException as exc:
        if not is_out_of_memory_error(exc):
            raise
        message = str(exc)
    release_memory(allocated_before)
    return CallOutcome(out_of_memory=True, error_message=message)
