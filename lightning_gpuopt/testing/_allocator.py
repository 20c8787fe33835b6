"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), default settings.

Requests are rounded up to 512 bytes and carved out of segments (2 MiB for requests up to 1 MiB, the
*small* pool; else 20 MiB below 10 MiB, or the request rounded up to 2 MiB) by best fit among cached
blocks, split when the rest is at least 512 bytes (small) or over 1 MiB (large); freed blocks merge and
stay cached. A segment past the limit first releases the free segments, then raises
:class:`AllocatorOutOfMemory` in CUDA's words. Peaks are also kept per window (a meter's own span).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY
from lightning_gpuopt.core.search import round_up

_MIB = 2**20
SMALL_SIZE, SMALL_BUFFER = _MIB, 2 * _MIB  # the small pool: requests up to 1 MiB, 2 MiB segments
# the large pool: 20 MiB segments for requests below 10 MiB, else the request rounded up to 2 MiB
MIN_LARGE_ALLOC, LARGE_BUFFER, ROUND_LARGE = 10 * _MIB, 20 * _MIB, 2 * _MIB


class AllocatorOutOfMemory(Exception):
    """A request the model could not serve, in CUDA's wording."""


@dataclass(eq=False)
class Block:
    """A piece of a segment: handed out (``allocated``) or cached (free)."""

    segment: int
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

    def __init__(self, limit_bytes: int, *, total_bytes: Optional[int] = None, outside_bytes: int = 0) -> None:
        self.limit_bytes = int(limit_bytes)
        self.total_bytes = int(total_bytes if total_bytes is not None else limit_bytes)
        self.outside_bytes = outside_bytes
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.stats = AllocatorStats()
        self._pools: dict[bool, set[Block]] = {True: set(), False: set()}  # the cached blocks: small, large
        self._segments: dict[int, Block] = {}  # first block of each segment
        self._segment_ids = itertools.count()
        self._windows: list[PeakWindow] = []

    def malloc(self, num_bytes: int) -> Block:
        """Hand out a block for ``num_bytes``; raises :class:`AllocatorOutOfMemory` when it cannot."""
        size = round_up(max(num_bytes, 1), CUDA_ALLOCATION_GRANULARITY)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        fits = [cached for cached in list(pool) if cached.size >= size]  # best fit; list(): a GC callback may free
        block = min(fits, key=lambda b: (b.size, b.segment, b.offset), default=None)
        if block is None:
            block = self._new_segment(size, small, num_bytes)
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
        """Release every fully free segment to the driver (PyTorch's ``empty_cache``)."""
        for segment_id, first in list(self._segments.items()):
            if first.allocated or first.next is not None:
                continue
            self._pools[first.small].remove(first)
            del self._segments[segment_id]
            self.reserved_bytes -= first.size
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

    def _new_segment(self, size: int, small: bool, requested: int) -> Block:
        large = LARGE_BUFFER if size < MIN_LARGE_ALLOC else round_up(size, ROUND_LARGE)
        wanted = SMALL_BUFFER if size <= SMALL_SIZE else large  # the segment to reserve
        if self.reserved_bytes + wanted > self.limit_bytes:
            self.stats.num_alloc_retries += 1
            self.empty_cache()
            if self.reserved_bytes + wanted > self.limit_bytes:
                self.stats.num_ooms += 1
                raise AllocatorOutOfMemory(self._oom_message(requested))
        segment = next(self._segment_ids)
        block = self._segments[segment] = Block(segment, 0, wanted, small)
        self.reserved_bytes += wanted
        self.stats.num_segments += 1
        self._update_peaks()
        return block

    def _update_peaks(self) -> None:
        for window in (self.stats, *self._windows):
            window.peak_allocated_bytes = max(window.peak_allocated_bytes, self.allocated_bytes)
            window.peak_reserved_bytes = max(window.peak_reserved_bytes, self.reserved_bytes)

    def _oom_message(self, requested: int) -> str:
        m, free = _mib_or_gib, max(0, self.total_bytes - self.outside_bytes - self.reserved_bytes)
        in_use, cached = self.outside_bytes + self.reserved_bytes, self.reserved_bytes - self.allocated_bytes
        return (
            f"CUDA out of memory. Tried to allocate {m(requested)}. GPU 0 has a total capacity of "
            f"{m(self.total_bytes)} of which {m(free)} is free. Including non-PyTorch memory, this process has "
            f"{m(in_use)} memory in use. Of the allocated memory {m(self.allocated_bytes)} is allocated by PyTorch, "
            f"and {m(cached)} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


def _mib_or_gib(num_bytes: int) -> str:
    """CUDA's own format: GiB from 1 GiB up, else MiB, two decimals."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / _MIB:.2f} MiB"
