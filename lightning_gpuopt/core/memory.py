"""Amounts of memory, a simulated memory cap, and out-of-memory errors.

* :func:`parse_memory`: ``"300MB"``, ``"20GiB"``, ``0.9`` (a fraction of a device) or bytes.
* :class:`MemoryBudget`: a :class:`~.op_memory.LiveTensorTracker` with a cap. An op whose new
  storage would pass it raises ``torch.OutOfMemoryError`` with "CUDA out of memory" in its message,
  so code written for a real CUDA OOM (``lightning.pytorch.utilities.memory.is_oom_error``
  included) handles it the same way. Entered with ``existing=(model, optimizer, batch)`` it caps a
  whole training step, parameters, gradients and optimizer state included; a gradient freed by
  ``zero_grad(set_to_none=True)`` inside it is subtracted when it dies.
* :func:`is_out_of_memory_error`, :func:`call_catching_oom`.

Example::

    >>> with MemoryBudget("1MB") as budget:
    ...     a = torch.zeros(1000)           # 4000 bytes
    ...     b = a[10:]                      # a view: no new storage
    ...     del a, b
    ...     c = torch.zeros(2000)           # 8000 bytes; the first tensor is already freed
    >>> budget.peak_bytes
    8000
    >>> parse_memory("300MB"), parse_memory("1GiB")
    (300000000, 1073741824)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY, device_for, release_memory
from lightning_gpuopt.core.op_memory import LiveTensorTracker

#: the fewest bytes a callback's ``max_memory`` accepts: ``max_memory=1`` (meant as "the whole
#: device", which is the fraction ``1.0``) is refused rather than read as one byte
MIN_MAX_MEMORY_BYTES = 1024

_MEMORY_STRING = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# out-of-memory errors' messages: CUDA, MPS, XPU, cuBLAS, cuDNN (its workspace failed), the CPU allocator
_OOM_MARKERS = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
)


def parse_memory(
    value: int | float | str,
    device: torch.device | str | int | None = None,
    *,
    name: str = "max_memory",
    minimum: int = 1,
) -> int:
    """An amount of memory in bytes: bytes (an int), a string with an optional unit, or a fraction of ``device``.

    Decimal units are powers of 1000 (``"300MB"``), binary ones of 1024 (``"20GiB"``), any case. A
    float in ``(0, 1]`` is that fraction of ``device``'s total memory. Anything else, or fewer than
    ``minimum`` bytes, raises ``ValueError`` naming ``name``, the value and what works.

    Example::

        >>> parse_memory(4096), parse_memory("1.5KiB"), parse_memory("2 kb")
        (4096, 1536, 2000)
        >>> parse_memory(1, minimum=MIN_MAX_MEMORY_BYTES)
        Traceback (most recent call last):
        ...
        ValueError: `max_memory`=1 is 1 byte, below the minimum of 1024 bytes; for the whole device give the fraction 1.0. Expected an int of bytes >= 1024, a string such as "300MB" or "20GiB", or a float in (0, 1] (a fraction of the device).
    """
    works = (
        f'an int of bytes >= {minimum}, a string such as "300MB" or "20GiB", '
        "or a float in (0, 1] (a fraction of the device)"
    )

    def fail(problem: str) -> ValueError:
        return ValueError(f"`{name}`={value!r} {problem}; expected {works}.")

    if isinstance(value, bool):
        raise fail("is a bool")
    if isinstance(value, int):
        if value <= 0:
            raise fail("is not positive")
        if value < minimum:
            raise ValueError(
                f"`{name}`={value!r} is {value} byte{'s' if value != 1 else ''}, below the minimum of "
                f"{minimum} bytes; for the whole device give the fraction 1.0. Expected {works}."
            )
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise fail("is a float outside (0, 1]")
        if device is None:
            raise ValueError(
                f"`{name}`={value!r} is a fraction of a device, but no device was given; "
                'pass `device=` or give bytes / a string such as "20GiB".'
            )
        total = device_for(device).total_memory()
        num_bytes = int(value * total)
        if num_bytes < minimum:
            raise fail(f"is {num_bytes} bytes of the device's {total}, below the minimum of {minimum} bytes")
        return num_bytes
    if not isinstance(value, str):
        raise fail(f"has type {type(value).__name__}")
    match = _MEMORY_STRING.match(value)
    if match is None:
        raise fail("is not a memory size")
    unit = (match.group(2) or "B").upper()  # K, M, G, T: powers of 1000, or of 1024 with an "i"
    num_bytes = int(float(match.group(1)) * (1024 if "I" in unit else 1000) ** "BKMGT".index(unit[0]))
    if num_bytes <= 0:
        raise fail("is zero bytes")
    if num_bytes < minimum:
        raise fail(f"is {num_bytes} bytes, below the minimum of {minimum} bytes")
    return num_bytes


class MemoryBudget(LiveTensorTracker):
    """A simulated memory cap: raises ``torch.OutOfMemoryError`` when live tensors would pass it.

    Counts what :class:`~.op_memory.LiveTensorTracker` counts, on any device (on CUDA the real
    allocator still applies its own limit, and storages are rounded to its 512-byte blocks).
    Nested budgets each apply their own cap.

    Args:
        max_memory: the cap, as :func:`parse_memory` takes it (a fraction is of ``device``).
        existing: objects whose tensors count from entry: modules, optimizers, batches.
        device: count only tensors on this device.
        baseline_bytes: a fixed amount counted as live (memory held outside tensors).

    Example::

        >>> model = torch.nn.Linear(1000, 1000)           # 4,004,000 bytes of parameters
        >>> with MemoryBudget("5MB", existing=[model]) as budget:
        ...     try:
        ...         model(torch.ones(512, 1000))          # 2 MB input + 2 MB output: too much
        ...     except torch.OutOfMemoryError as error:
        ...         print("CUDA out of memory" in str(error))
        True
        >>> budget.peak_bytes <= 5_000_000
        True
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
        super().__init__(
            parse_memory(max_memory, device),
            existing=existing,
            device=device,
            granularity=CUDA_ALLOCATION_GRANULARITY if on_cuda else 1,
            baseline_bytes=baseline_bytes,
        )


def is_out_of_memory_error(exception: BaseException) -> bool:
    """Whether ``exception`` means the device ran out of memory: any ``torch.OutOfMemoryError`` or
    ``MemoryError``, or a ``RuntimeError`` from CUDA/MPS/XPU, cuBLAS, cuDNN or the CPU allocator.

    Example::

        >>> is_out_of_memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
        True
        >>> is_out_of_memory_error(ValueError("out of memory"))
        False
    """
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
    """Call ``fn``; on an out-of-memory error, free its memory (:func:`~.device.release_memory`, once
    the traceback holding its tensors is gone) and report it instead of raising. Other errors propagate.

    Example::

        >>> def step():
        ...     with MemoryBudget(1000):
        ...         return torch.zeros(1000)
        >>> outcome = call_catching_oom(step)
        >>> outcome.out_of_memory, "CUDA out of memory" in outcome.error_message
        (True, True)
    """
    try:
        return CallOutcome(value=fn(*args, **kwargs))
    except BaseException as exc:
        if not is_out_of_memory_error(exc):
            raise
        message = str(exc)
    release_memory()
    return CallOutcome(out_of_memory=True, error_message=message)
