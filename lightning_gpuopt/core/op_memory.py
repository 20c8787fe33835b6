"""What one op allocates inside its kernel, learned from the allocator through the torch profiler.

A dispatch-level count of tensor storages sees every op's outputs but not the buffers a kernel
allocates and frees inside itself: oneDNN's reorders and workspaces for convolutions on CPU
(as large as the output), sorting and reduction scratch, attention buffers. The allocator sees
them: with ``profile_memory`` the torch profiler records every allocation and free the CPU
allocator serves (``ProfiledCPUMemoryReporter``), in order.

:func:`call_learning_allocations` runs an op once under the profiler and keeps the sequence of
its allocations and frees as an :class:`OpAllocations` template, keyed by the op and its
arguments' shapes, strides, dtypes and other values (:func:`op_key`); later calls with the same
key reuse the template, so a training step is profiled op by op only the first time each
distinct call is seen. The profiler is not started when one already runs (a user's profiler
keeps its events; that call's workspace is then unknown and counted as zero).

Example::

    >>> import torch
    >>> x, w = torch.randn(8, 3, 16, 16), torch.randn(4, 3, 3, 3)
    >>> out, allocations = call_learning_allocations(torch.ops.aten.convolution.default,
    ...                                              (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {})
    >>> allocations.peak_bytes >= out.untyped_storage().nbytes()   # the output, and any workspace
    True
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from lightning_gpuopt.core._torch_compat import (
    profiler_running,
    start_allocation_events,
    stop_allocation_events,
    tree_flatten,
)

#: learned templates, shared by every tracker of the process (cleared when it grows past this)
MAX_TEMPLATES = 50_000

_templates: dict[Any, OpAllocations] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class OpAllocations:
    """The allocations one op call made, in order.

    ``events`` holds ``+size`` for an allocation and ``-(i + 1)`` for the free of the ``i``-th
    allocation of the call; allocations never freed inside the call are ``kept`` (its outputs, or
    a cache the kernel keeps). Frees of memory allocated before the call are left out: the storage
    tracking sees those when the tensor dies.
    """

    events: tuple[int, ...]
    kept: frozenset[int]

    @property
    def sizes(self) -> list[int]:
        """Sizes of the call's allocations, in order."""
        return [event for event in self.events if event > 0]

    @property
    def peak_bytes(self) -> int:
        """The most the call held at once above what was live before it (outputs included)."""
        sizes, live, peak = self.sizes, 0, 0
        for event in self.events:
            live += event if event > 0 else -sizes[-event - 1]
            peak = max(peak, live)
        return peak

    @property
    def kept_bytes(self) -> int:
        sizes = self.sizes
        return sum(sizes[i] for i in self.kept)

    @property
    def workspace_bytes(self) -> int:
        """What the call needed beyond what it kept: the peak less the kept allocations."""
        return max(0, self.peak_bytes - self.kept_bytes)


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type, leaf.requires_grad)
    if leaf is None or isinstance(
        leaf, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return leaf
    return type(leaf).__name__


def op_key(func: Any, args: tuple, kwargs: Optional[dict]) -> tuple:
    """A hashable key of an op call: the op, the intra-op threads and its arguments' metadata (not their values).

    Example::

        >>> a, b = torch.ones(2, 3), torch.zeros(2, 3)
        >>> op_key(torch.ops.aten.add.Tensor, (a, a), {}) == op_key(torch.ops.aten.add.Tensor, (b, b), {})
        True
    """
    leaves, _ = tree_flatten((args, kwargs or {}))
    # oneDNN picks kernels (and so workspaces) by the number of threads too
    return (func, torch.get_num_threads(), *map(_leaf_key, leaves))


def _allocations_from(records: list) -> OpAllocations:
    """The template from the legacy profiler's per-thread records (``memory_alloc`` events)."""
    events: list[int] = []
    open_by_size: dict[int, list[int]] = {}
    count = 0
    for thread in records:
        for record in thread:
            if record.kind() != "memory_alloc":
                continue
            size = int(record.cpu_memory_usage())
            if size > 0:
                open_by_size.setdefault(size, []).append(count)
                events.append(size)
                count += 1
            elif size < 0 and open_by_size.get(-size):
                events.append(-(open_by_size[-size].pop() + 1))
    kept = frozenset(index for indices in open_by_size.values() for index in indices)
    return OpAllocations(tuple(events), kept)


def _profiled_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, OpAllocations]:
    start_allocation_events()
    try:
        out = func(*args, **kwargs)
    finally:
        records = stop_allocation_events()
    return out, _allocations_from(records)


def learning_possible() -> bool:
    """Whether an op can be profiled now (no other profiler is running)."""
    return not profiler_running()


def call_learning_allocations(
    func: Callable[..., Any], args: tuple, kwargs: Optional[dict], key: Optional[tuple] = None
) -> tuple[Any, Optional[OpAllocations]]:
    """Run ``func``; return its output and its allocations, learned on the first call of its key.

    ``None`` when the call's allocations are unknown: its key was never learned and a profiler is
    already running.
    """
    kwargs = kwargs or {}
    key = op_key(func, args, kwargs) if key is None else key
    known = _templates.get(key)
    if known is not None or not learning_possible():
        return func(*args, **kwargs), known
    out, allocations = _profiled_call(func, args, kwargs)
    with _lock:
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = allocations
    return out, allocations


class AllocationWindow:
    """The largest rise of a device's allocated bytes over a span, from the profiler's allocator
    events: a peak measured by deltas, without touching the allocator's peak counters.

    ``peak_delta_bytes`` is ``None`` when another profiler was already running (it is left alone).

    Example::

        >>> with AllocationWindow("cpu") as window:
        ...     a = torch.zeros(1000); del a
        ...     b = torch.zeros(500)
        >>> window.peak_delta_bytes
        4000
    """

    def __init__(self, device_type: str = "cpu", index: int = 0) -> None:
        self.device_type = device_type
        self.index = index
        self.peak_delta_bytes: Optional[int] = None
        self._active = False

    def __enter__(self) -> AllocationWindow:
        self.peak_delta_bytes = None
        self._active = learning_possible()
        if self._active:
            start_allocation_events()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._active:
            return
        self._active = False
        records = stop_allocation_events()
        live = peak = 0
        for thread in records:
            for record in thread:
                if record.kind() != "memory_alloc":
                    continue
                if self.device_type == "cuda":
                    if record.device() != self.index:
                        continue
                    live += int(record.cuda_memory_usage())
                else:
                    live += int(record.cpu_memory_usage())
                peak = max(peak, live)
        self.peak_delta_bytes = peak
