"""A model of PyTorch's CUDA caching allocator, for the simulated GPU (pure standard library).

What a CUDA card really holds is not the sum of live tensors: PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) rounds every request up to 512 bytes, carves requests out
of *segments* it reserves from the driver, keeps freed blocks cached for reuse instead of
returning them, and splits and merges blocks inside a segment. ``memory_reserved`` is therefore
at least ``memory_allocated``, and a request can fail with plenty of free bytes in total when no
single cached block or new segment fits (fragmentation). :class:`CachingAllocatorModel` follows
the allocator's rules with its default settings (no ``max_split_size_mb``, no expandable
segments, one stream):

* sizes: below 512 bytes a request takes 512; above, it is rounded up to a multiple of 512;
* pools: requests of at most 1 MiB come from the *small* pool, whose segments are 2 MiB; larger
  ones from the *large* pool, whose segments are 20 MiB for requests under 10 MiB, else the
  request rounded up to 2 MiB;
* a request takes the smallest cached block of its pool that is large enough (best fit), split
  when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool); what is
  handed out counts whole in ``allocated``;
* a freed block merges with free neighbours of its segment and stays cached (reserved);
* when a new segment would pass the limit, every fully free segment is released (as
  ``empty_cache`` would) and the request tried again; if it still does not fit, the request
  fails, and :meth:`CachingAllocatorModel.malloc` raises :class:`AllocatorOutOfMemory`.

Peaks are kept per *window* (:meth:`CachingAllocatorModel.open_window`), so a meter measures the
peak of its own span without resetting the process-wide peak counters others read.

Example::

    >>> allocator = CachingAllocatorModel(limit_bytes=64 * 2**20)
    >>> a = allocator.malloc(1000)                # 1024 bytes out of a new 2 MiB small segment
    >>> allocator.allocated_bytes, allocator.reserved_bytes
    (1024, 2097152)
    >>> allocator.free(a)
    >>> b = allocator.malloc(700)                 # reuses the cached block: nothing new reserved
    >>> allocator.allocated_bytes, allocator.reserved_bytes
    (1024, 2097152)
    >>> allocator.empty_cache(), allocator.reserved_bytes     # b is still live: its segment stays
    (0, 2097152)
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Optional

#: the allocator's block granularity
MIN_BLOCK_SIZE = 512
#: largest request served from the small pool
SMALL_SIZE = 2**20
#: segment size of the small pool
SMALL_BUFFER = 2 * 2**20
#: requests below this get a LARGE_BUFFER segment
MIN_LARGE_ALLOC = 10 * 2**20
#: segment size for large requests below MIN_LARGE_ALLOC
LARGE_BUFFER = 20 * 2**20
#: large segments are rounded up to a multiple of this
ROUND_LARGE = 2 * 2**20


def round_size(num_bytes: int) -> int:
    """The block size the allocator hands out for a request of ``num_bytes``.

    Example::

        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    if num_bytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * -(-num_bytes // MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """Bytes reserved from the driver for a new segment that must hold a block of ``rounded``.

    Example::

        >>> [segment_size(round_size(n)) // 2**20 for n in (100, 3 * 2**20, 50 * 2**20 + 1)]
        [2, 20, 52]
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)


class AllocatorOutOfMemory(Exception):
    """A request the model could not serve; :attr:`message` has CUDA's wording."""

    def __init__(self, message: str, requested: int) -> None:
        super().__init__(message)
        self.message = message
        self.requested = requested


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

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class PeakWindow:
    """Peaks of allocated and reserved bytes since the window opened (see ``open_window``)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    closed: bool = False


@dataclass
class AllocatorStats:
    """Counters as PyTorch's ``memory_stats`` names them (a subset)."""

    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_segments: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0


@dataclass
class _Pool:
    free: list[tuple[int, int, int]] = field(default_factory=list)  # sorted Block.key()s
    blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)

    def add(self, block: Block) -> None:
        key = block.key()
        bisect.insort(self.free, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = block.key()
        del self.free[bisect.bisect_left(self.free, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> Optional[Block]:
        index = bisect.bisect_left(self.free, (size, -1, -1))
        return self.blocks[self.free[index]] if index < len(self.free) else None


class CachingAllocatorModel:
    """The CUDA caching allocator's bookkeeping, without memory behind it (see the module docstring).

    Args:
        limit_bytes: the most the allocator may reserve (the card's memory less the CUDA context,
            or ``set_per_process_memory_fraction``'s share).
        device_index: the GPU number used in error messages.
        total_bytes: the card's total memory, for error messages (default: ``limit_bytes``).
        outside_bytes: memory the process holds outside the allocator (the CUDA context), for
            error messages.
    """

    def __init__(
        self, limit_bytes: int, *, device_index: int = 0, total_bytes: Optional[int] = None, outside_bytes: int = 0
    ) -> None:
        self.limit_bytes = int(limit_bytes)
        self.device_index = device_index
        self.total_bytes = int(total_bytes if total_bytes is not None else limit_bytes)
        self.outside_bytes = outside_bytes
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.stats = AllocatorStats()
        self._pools = {True: _Pool(), False: _Pool()}
        self._segments: dict[int, Block] = {}  # first block of each segment
        self._segment_ids = itertools.count()
        self._windows: list[PeakWindow] = []

    # -- requests
    def malloc(self, num_bytes: int) -> Block:
        """Hand out a block for ``num_bytes``; raises :class:`AllocatorOutOfMemory` when it cannot."""
        size = round_size(num_bytes)
        small = size <= SMALL_SIZE
        block = self._pools[small].best_fit(size)
        if block is None:
            block = self._new_segment(size, small, num_bytes)
        else:
            self._pools[small].remove(block)
        if self._should_split(block, size):
            rest = Block(block.segment, block.offset + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._pools[small].add(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        self._update_peaks()
        return block

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool (it stays reserved), merged with free neighbours."""
        if not block.allocated:
            return
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                block = self._merge(block, neighbour)
        pool.add(block)

    def empty_cache(self) -> int:
        """Release every fully free segment to the driver (PyTorch's ``empty_cache``); the bytes released."""
        released = 0
        for segment_id, first in list(self._segments.items()):
            if first.allocated or first.next is not None:
                continue
            self._pools[first.small].remove(first)
            del self._segments[segment_id]
            self.reserved_bytes -= first.size
            released += first.size
            self.stats.num_segments -= 1
        return released

    # -- windows
    def open_window(self) -> PeakWindow:
        """A window whose peaks start at the bytes allocated and reserved now."""
        window = PeakWindow(self.allocated_bytes, self.reserved_bytes)
        self._windows.append(window)
        return window

    def close_window(self, window: PeakWindow) -> PeakWindow:
        if not window.closed:
            window.closed = True
            self._windows.remove(window)
        return window

    def reset_peaks(self) -> None:
        """Restart the process-wide peaks (PyTorch's ``reset_peak_memory_stats``) from the bytes held now."""
        self.stats.peak_allocated_bytes = self.allocated_bytes
        self.stats.peak_reserved_bytes = self.reserved_bytes

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not handed out: cached blocks."""
        return self.reserved_bytes - self.allocated_bytes

    def largest_free_block(self) -> int:
        """The largest block a request could get without reserving a new segment."""
        return max((key[0] for pool in self._pools.values() for key in pool.free[-1:]), default=0)

    # -- internals
    @staticmethod
    def _should_split(block: Block, size: int) -> bool:
        remaining = block.size - size
        return remaining >= MIN_BLOCK_SIZE if block.small else remaining > SMALL_SIZE

    def _new_segment(self, size: int, small: bool, requested: int) -> Block:
        wanted = segment_size(size)
        if self.reserved_bytes + wanted > self.limit_bytes:
            self.stats.num_alloc_retries += 1
            self.empty_cache()
            if self.reserved_bytes + wanted > self.limit_bytes:
                self.stats.num_ooms += 1
                raise AllocatorOutOfMemory(self._oom_message(requested), requested)
        segment = next(self._segment_ids)
        block = Block(segment, 0, wanted, small)
        self._segments[segment] = block
        self.reserved_bytes += wanted
        self.stats.num_segments += 1
        self._update_peaks()
        return block

    def _merge(self, block: Block, neighbour: Block) -> Block:
        first, second = (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _update_peaks(self) -> None:
        stats = self.stats
        stats.peak_allocated_bytes = max(stats.peak_allocated_bytes, self.allocated_bytes)
        stats.peak_reserved_bytes = max(stats.peak_reserved_bytes, self.reserved_bytes)
        for window in self._windows:
            window.peak_allocated_bytes = max(window.peak_allocated_bytes, self.allocated_bytes)
            window.peak_reserved_bytes = max(window.peak_reserved_bytes, self.reserved_bytes)

    def _oom_message(self, requested: int) -> str:
        free = max(0, self.total_bytes - self.outside_bytes - self.reserved_bytes)
        return (
            f"CUDA out of memory. Tried to allocate {_mib_or_gib(requested)}. GPU {self.device_index} has a total "
            f"capacity of {_mib_or_gib(self.total_bytes)} of which {_mib_or_gib(free)} is free. Including non-PyTorch "
            f"memory, this process has {_mib_or_gib(self.outside_bytes + self.reserved_bytes)} memory in use. Of the "
            f"allocated memory {_mib_or_gib(self.allocated_bytes)} is allocated by PyTorch, and "
            f"{_mib_or_gib(self.reserved_bytes - self.allocated_bytes)} is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


def _mib_or_gib(num_bytes: int) -> str:
    """CUDA's own format: GiB from 1 GiB up, else MiB, two decimals."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"
