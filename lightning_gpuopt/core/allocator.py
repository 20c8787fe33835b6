"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), default settings.

Requests are rounded up to 512 bytes and served best fit from the small or the large pool (their sizes below), split
and merged as torch does; ``expandable=True`` maps pages at the end of one segment per pool. Past the limit the free
segments are released, then :class:`AllocatorOutOfMemory` raised in CUDA's words. :func:`largest_replayed_fit`: the
largest batch whose :class:`AllocationTrace`, run through :func:`replay`, fits a cap. See docs/batch-size-search.md.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY, CUDA_SMALL_SEGMENT_BYTES
from lightning_gpuopt.core.search import round_up

_MIB = 2**20
SMALL_SIZE, SMALL_BUFFER = _MIB, CUDA_SMALL_SEGMENT_BYTES  # the small pool: requests up to 1 MiB, 2 MiB segments
# the large pool: 20 MiB segments for requests below 10 MiB, else the request rounded up to 2 MiB
MIN_LARGE_ALLOC, LARGE_BUFFER, ROUND_LARGE = 10 * _MIB, 20 * _MIB, 2 * _MIB


class AllocatorOutOfMemory(torch.OutOfMemoryError):
    """A request the model could not serve, raised as CUDA raises it (a ``torch.OutOfMemoryError``)."""


@dataclass(eq=False)
class Block:
    """A piece of a segment: handed out (``allocated``) or cached (free)."""

    segment: int  #: the segment's address
    offset: int
    size: int
    small: bool
    allocated: bool = False
    prev: Optional[Block] = None
    next: Optional[Block] = None


@dataclass(eq=False)
class PeakWindow:
    """Peaks of allocated and reserved bytes since the window opened."""

    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0


@dataclass(eq=False)
class AllocatorStats(PeakWindow):
    """Counters as PyTorch's ``memory_stats`` names them (a subset); the peaks are the process's."""

    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_segments: int = 0


class CachingAllocatorModel:
    """The caching allocator's bookkeeping, reserving at most ``limit_bytes`` (the others: for messages)."""

    def __init__(
        self, limit_bytes: int, *, total_bytes: Optional[int] = None, outside_bytes: int = 0, expandable: bool = False
    ) -> None:
        self.limit_bytes = int(limit_bytes)
        self.total_bytes = int(total_bytes if total_bytes is not None else limit_bytes)
        self.outside_bytes, self.expandable = outside_bytes, expandable
        self.allocated_bytes = self.reserved_bytes = 0
        self.stats = AllocatorStats()
        self._pools: dict[bool, set[Block]] = {True: set(), False: set()}  # the cached blocks: small, large
        self._segments: dict[int, Block] = {}  # first block of each segment, by address
        self._windows: list[PeakWindow] = []

    def malloc(self, num_bytes: int) -> Block:
        """Hand out a block for ``num_bytes``; raises :class:`AllocatorOutOfMemory` when it cannot."""
        size = round_up(max(num_bytes, 1), CUDA_ALLOCATION_GRANULARITY)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        fits = [cached for cached in list(pool) if cached.size >= size]  # best fit; list(): a GC callback may free
        block = min(fits, key=lambda b: (b.size, b.segment + b.offset), default=None)
        if block is None:
            block = self._new_segment(size, small)
        else:
            pool.remove(block)
        rest = block.size - size
        if rest >= CUDA_ALLOCATION_GRANULARITY if small else rest > SMALL_SIZE:  # split: the rest is cached
            after = Block(block.segment, block.offset + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = after
            block.next, block.size = after, size
            pool.add(after)
        block.allocated = True
        self.allocated_bytes += block.size
        self._update_peaks()
        return block

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool (it stays reserved), merged with its free neighbours."""
        if not block.allocated:
            return
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                first, second = (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                block = first
        pool.add(block)

    def empty_cache(self) -> None:
        """Release every fully free segment (an expandable one: the whole pages of its free tail) to the driver."""
        for address, first in list(self._segments.items()):
            tail, page = _last(first), SMALL_BUFFER if first.small else LARGE_BUFFER  # what an expandable one maps
            whole = tail.size if first is tail else tail.size // page * page * self.expandable
            unmapped = 0 if tail.allocated else whole
            self.reserved_bytes, tail.size = self.reserved_bytes - unmapped, tail.size - unmapped
            if unmapped and not tail.size:
                self._pools[first.small].remove(tail)
                if tail.prev is not None:
                    tail.prev.next = None
                else:
                    del self._segments[address]
                    self.stats.num_segments -= 1

    def open_window(self) -> PeakWindow:
        """A window whose peaks start at the bytes allocated and reserved now."""
        window = PeakWindow(self.allocated_bytes, self.reserved_bytes)
        self._windows.append(window)
        return window

    def close_window(self, window: PeakWindow) -> PeakWindow:
        if window in self._windows:
            self._windows.remove(window)
        return window

    def _new_segment(self, size: int, small: bool, retried: bool = False) -> Block:
        large = LARGE_BUFFER if size < MIN_LARGE_ALLOC else round_up(size, ROUND_LARGE)
        wanted = SMALL_BUFFER if size <= SMALL_SIZE else large  # the segment to reserve (torch's alloc_size)
        tail = next((_last(f) for f in self._segments.values() if f.small == small), None) if self.expandable else None
        if self.expandable:  # map pages at the end of the pool's one segment
            free_tail = tail.size if tail and not tail.allocated else 0
            wanted = round_up(size - free_tail, SMALL_BUFFER if small else LARGE_BUFFER)
        if self.reserved_bytes + wanted > self.limit_bytes:
            if retried:
                self.stats.num_ooms += 1
                raise AllocatorOutOfMemory(self._oom_message(wanted))
            self.stats.num_alloc_retries += 1
            self.empty_cache()
            return self._new_segment(size, small, retried=True)
        self.reserved_bytes += wanted
        self._update_peaks()
        if tail is not None and not tail.allocated:
            self._pools[small].remove(tail)
            tail.size += wanted
            return tail
        if tail is not None:
            tail.next = Block(tail.segment, tail.offset + tail.size, wanted, small, prev=tail)
            return tail.next
        address = 0  # the lowest free addresses (a model of where the driver maps a new segment)
        for start, first in sorted(self._segments.items()):
            if start - address >= wanted:
                break
            address = start + (last := _last(first)).offset + last.size
        self.stats.num_segments += 1
        block = self._segments[address] = Block(address, 0, wanted, small)
        return block

    def _update_peaks(self) -> None:
        for window in (self.stats, *self._windows):
            window.peak_allocated_bytes = max(window.peak_allocated_bytes, self.allocated_bytes)
            window.peak_reserved_bytes = max(window.peak_reserved_bytes, self.reserved_bytes)

    def _oom_message(self, alloc_size: int) -> str:
        m, free = format_size, max(0, self.total_bytes - self.outside_bytes - self.reserved_bytes)
        in_use, cached = self.outside_bytes + self.reserved_bytes, self.reserved_bytes - self.allocated_bytes
        capped = self.limit_bytes < self.total_bytes - self.outside_bytes  # a memory fraction is set
        return (
            f"CUDA out of memory. Tried to allocate {m(alloc_size)}. GPU 0 has a total capacity of "
            f"{m(self.total_bytes)} of which {m(free)} is free. Including non-PyTorch memory, this process has "
            f"{m(in_use)} memory in use. {f'{m(self.limit_bytes)} allowed; ' if capped else ''}"
            f"Of the allocated memory {m(self.allocated_bytes)} is allocated by PyTorch, "
            f"and {m(cached)} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


def _last(block: Block) -> Block:
    while block.next is not None:
        block = block.next
    return block


def format_size(num_bytes: int) -> str:
    """The allocator's ``format_size``: bytes up to 1 KiB, then KiB, MiB, GiB with two decimals.

    >>> format_size(1024), format_size(1025), format_size(2**30), format_size(int(79.11 * 2**30))
    ('1024 bytes', '1.00 KiB', '1024.00 MiB', '79.11 GiB')
    """
    power = next(p for p in (0, 10, 20, 30) if num_bytes <= 2**p * 1024 or p == 30)
    return f"{num_bytes / 2**power:.2f} {'KMG'[power // 10 - 1]}iB" if power else f"{num_bytes} bytes"


@dataclass(frozen=True)
class AllocationTrace:
    """A step's allocations: ``sizes[k]`` the k-th's bytes; in ``order`` -1 allocates the next one, -2 allocates and
    frees it (a workspace, left out where it does not fit), ``k >= 0`` frees the k-th; the step begins at ``step``."""

    sizes: tuple[int, ...]
    order: tuple[int, ...]
    step: int = 0

    def at(self, batch_size: int, traced: int, other: AllocationTrace, other_traced: int) -> AllocationTrace:
        """The trace at ``batch_size``: each allocation's bytes on the line through this trace at ``traced`` samples
        and ``other`` (the same events) at ``other_traced``, rounded up to the allocator's 512 bytes."""
        slope = [(b - a) / (other_traced - traced) for a, b in zip(self.sizes, other.sizes)]
        grown = (max(0.0, a + s * (batch_size - traced)) for a, s in zip(self.sizes, slope))
        return AllocationTrace(tuple(round_up(b, CUDA_ALLOCATION_GRANULARITY) for b in grown), self.order, self.step)


def replay(trace: AllocationTrace, limit_bytes: int, steps: int = 1) -> Optional[int]:
    """The peak of reserved bytes of ``trace`` with its step run ``steps`` times under ``limit_bytes`` (``None``: out
    of memory); a repeated step frees what its previous one kept in place of what it freed (the gradients)."""
    model, blocks = CachingAllocatorModel(limit_bytes), dict[int, Optional[Block]]()
    body, before = trace.order[trace.step :], trace.order[: trace.step]
    first = sum(event < 0 for event in before)  # the step's first allocation
    freed = {event for event in body if event >= 0}
    kept = [k for k in range(first, len(trace.sizes)) if k not in freed and trace.sizes[k]]
    pairs: dict[int, int] = {}  # an allocation from before the step that the step frees -> what it keeps in its place
    for old in sorted(k for k in freed if k < first):
        pairs[old] = next((k for k in kept if trace.sizes[k] == trace.sizes[old] and k not in pairs.values()), -1)
    once = set(kept) - set(pairs.values())  # kept in no one's place (a cuBLAS workspace): made by the first step
    try:
        for repeat, (events, count) in enumerate([(before, 0), *[(body, first)] * steps]):
            blocks.update({old: blocks.get(new) for old, new in pairs.items()} if repeat > 1 else {})
            for event in events:
                if event == -2:
                    with contextlib.suppress(AllocatorOutOfMemory):
                        model.free(model.malloc(trace.sizes[count]))
                elif event < 0 and (repeat < 2 or count not in once):
                    blocks[count] = model.malloc(trace.sizes[count])
                elif (block := blocks.pop(event, None)) is not None:
                    model.free(block)
                count += event < 0
    except AllocatorOutOfMemory:
        return None
    return model.stats.peak_reserved_bytes


def largest_replayed_fit(
    traces: dict[int, AllocationTrace], limit_bytes: int, upper: int, steps: int = 1
) -> Optional[int]:
    """The largest batch up to ``upper`` whose ``steps`` replayed on the line through the two largest traces with the
    same events fit ``limit_bytes``; ``None`` without two such traces or where batch 1 does not fit."""
    sizes = sorted(traces, reverse=True)
    pair = next(((b, a) for a in sizes for b in sizes if b < a and traces[a].order == traces[b].order), None)
    if pair is None:
        return None
    low, high = pair

    def misses(batch_size: int) -> bool:
        return replay(traces[low].at(batch_size, low, traces[high], high), limit_bytes, steps) is None

    return bisect.bisect_left(range(1, upper + 1), True, key=misses) or None  # how many of 1..upper fit
