"""Memory counted op by op at the dispatcher: storages, what each op's kernel allocates, the meters.

A count of storages misses what a kernel allocates inside itself (oneDNN reorders, sorting scratch):
:func:`call_learning_allocations` learns it from the profiler, once per op signature.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Iterable, Iterator, Optional, Sequence, TypeVar

import torch

from lightning_gpuopt.core import _torch_compat as compat
from lightning_gpuopt.core._torch_compat import FakeTensor, TorchDispatchMode, storage_key, tree_leaves
from lightning_gpuopt.core.search import round_up

_ATOMS = (torch.Tensor, bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def leaves(tree: Any) -> list:
    """The leaves of ``tree``: tuples, lists and dicts walked here (pytree's generic walk is the hot spot)."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(node.values()))
        elif isinstance(node, _ATOMS):
            found.append(node)
        else:
            found.extend(tree_leaves(node))
    return found


def collect_tensors(*objects: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``objects``, their containers, modules (with gradients) and optimizers (state)."""
    for leaf in leaves(objects):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, torch.nn.Module):
            for param in leaf.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from leaf.buffers()
        elif isinstance(leaf, torch.optim.Optimizer):
            yield from collect_tensors(list(leaf.state.values()))


def storage_of(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
    """The untyped storage behind ``tensor`` (its views share it); ``None`` for a storage-less tensor."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested and other storage-less tensors
        return None


def storage_bytes(*objects: Any, granularity: int = 1) -> int:
    """Bytes of the distinct storages of the tensors in ``objects``, each rounded up to ``granularity``."""
    storages = [storage for storage in map(storage_of, collect_tensors(*objects)) if storage is not None]
    return sum({storage_key(s): round_up(s.nbytes(), granularity) for s in storages}.values())


def is_real_host_call(flat: list) -> bool:
    """Whether an op call (the :func:`leaves` of its ``(args, kwargs)``) runs on real host tensors only."""
    for leaf in flat:
        device = leaf.device if isinstance(leaf, torch.Tensor) else leaf if isinstance(leaf, torch.device) else None
        if isinstance(leaf, FakeTensor) or (device is not None and device.type != "cpu"):
            return False
    return True


_Meter = TypeVar("_Meter", bound="SpanMeter")
_MAX_TEMPLATES = 50_000  # learned peaks, shared by the process; cleared when they pass this
_templates: dict[Any, int] = {}
_lock = threading.Lock()


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device.type, leaf.requires_grad)
    return leaf if isinstance(leaf, _ATOMS) else type(leaf).__name__


def call_learning_allocations(func: Any, args: tuple, kwargs: dict, flat: list) -> tuple[Any, Optional[int]]:
    """``func``'s output and the peak its kernel allocated (``None``: another profiler runs), learned once per op,
    thread count and argument metadata; ``flat``: :func:`leaves` of the arguments."""
    key = (func, torch.get_num_threads(), *map(_leaf_key, flat))
    known = _templates.get(key)
    if known is not None or compat.profiler_running():
        return func(*args, **kwargs), known
    compat.start_allocation_events()
    try:
        out = func(*args, **kwargs)
    finally:
        records = compat.stop_allocation_events()
    open_sizes: collections.Counter = collections.Counter()  # the most the op's own allocations held at once
    live = peak = 0
    for record in (record for thread in records for record in thread if record.kind() == "memory_alloc"):
        size = int(record.cpu_memory_usage())
        if size > 0 or (size < 0 and open_sizes[-size]):
            open_sizes[abs(size)] += 1 if size > 0 else -1
            live, peak = live + size, max(peak, live + size)
    with _lock:
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = peak
    return out, peak


class SpanMeter:
    """The peak memory (and reserved peak, where known) of a span or ``with`` block; subclasses implement
    ``_begin`` and ``_end``."""

    peak_bytes: Optional[int] = None
    peak_reserved_bytes: Optional[int] = None
    running = False  #: whether :meth:`start` was called and :meth:`stop` not yet
    _started = False

    def start(self) -> None:
        """Begin measuring (a running meter restarts)."""
        self.stop()
        self._begin()
        self.running = self._started = True

    def stop(self) -> Optional[int]:
        """Stop measuring; the peak in bytes (``None`` if never started)."""
        if self.running:
            self.running = False
            self._end()
        return self.peak_bytes if self._started else None

    def _begin(self) -> None: ...

    def _end(self) -> None: ...

    def __enter__(self: _Meter) -> _Meter:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class LiveTensorTracker(SpanMeter, TorchDispatchMode):
    """The host's meter: live tensor storages (``existing`` from the start) plus ``baseline_bytes``, with a real host
    op's kernel peak (``workspaces``); past ``max_bytes`` it raises ``torch.OutOfMemoryError``. ``record``: keep
    :attr:`sizes` and :attr:`events` as an :class:`~lightning_gpuopt.core.allocator.AllocationTrace`."""

    peak_bytes: int

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # compiled code runs compiled under it (torch 2.9+, pytorch#190286)
        return True

    def __init__(
        self,
        max_bytes: Optional[int] = None,
        *,
        existing: Iterable[Any] = (),
        device: torch.device | str | None = None,
        granularity: int = 1,
        baseline_bytes: int = 0,
        workspaces: bool = True,
        record: bool = False,
    ) -> None:
        super().__init__()
        self.max_bytes, self.existing, self.granularity = max_bytes, tuple(existing), granularity
        self.baseline_bytes, self.workspaces = baseline_bytes, workspaces
        self.device = None if device is None else torch.device(device)
        self.live_bytes = self.peak_bytes = self.workspace_bytes_at_peak = 0
        self._live: dict[int, tuple[weakref.ref, int, int]] = {}
        self.sizes: Optional[list[int]] = [] if record else None
        self.events: list[int] = []
        self._surplus: dict[int, int] = {}  # storages counted above their size: key -> bytes

    def _begin(self) -> None:
        self._live.clear()
        self._surplus.clear()
        self.events, self.sizes = [], None if self.sizes is None else []
        self.live_bytes = self.peak_bytes = self.baseline_bytes
        self.workspace_bytes_at_peak = 0
        for key, storage, num_bytes, _ in self._new_storages(collect_tensors(*self.existing), set()):
            self._add(key, storage, num_bytes)
        TorchDispatchMode.__enter__(self)

    def _end(self) -> None:
        try:
            TorchDispatchMode.__exit__(self, None, None, None)
        finally:
            self._live.clear()  # dropping the weak references also drops their callbacks
            self.live_bytes = 0

    @property
    def tracked_storages(self) -> int:
        """How many storages are counted as live now (0 outside the span)."""
        return len(self._live)

    def _counts(self, tensor: torch.Tensor) -> bool:
        want = self.device
        return want is None or (tensor.device.type == want.type and want.index in (None, tensor.device.index))

    def _new_storages(self, tensors: Iterable[torch.Tensor], exclude: set[int], surplus: Sequence[int] = ()) -> list:
        """``(key, storage, bytes, surplus)`` per storage of ``tensors`` not live nor in ``exclude``, rounded up."""
        found = []
        for index, tensor in enumerate(tensors):
            storage = storage_of(tensor) if self._counts(tensor) else None
            if storage is None or (key := storage_key(storage)) in self._live or key in exclude:
                continue
            exclude.add(key)
            more = surplus[index] if index < len(surplus) else 0
            if (num_bytes := round_up(storage.nbytes(), self.granularity) + more) > 0:
                found.append((key, storage, num_bytes, more))
        return found

    def _add(self, key: int, storage: torch.UntypedStorage, num_bytes: int) -> None:
        def release(_ref: weakref.ref) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.live_bytes -= entry[1]
                if self.sizes is not None:
                    self.events.append(entry[2])

        self._live[key] = (weakref.ref(storage, release), num_bytes, -1 if self.sizes is None else len(self.sizes))
        if self.sizes is not None:
            self.sizes.append(num_bytes)
            self.events.append(-1)
        self.live_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out, inside, workspace, surplus = self._run(func, args, kwargs)
        inputs = {storage_key(s) for s in map(storage_of, collect_tensors(args, kwargs)) if s is not None}
        new = self._new_storages(collect_tensors(out), inputs, surplus)
        # while the op ran it held its outputs and its workspace, at least the allocator's peak inside it
        needed = max(sum(entry[2] for entry in new) + workspace, inside)
        if self.max_bytes is not None and needed and self.live_bytes + needed > self.max_bytes:
            where = f"simulated by {type(self).__name__} on {'any device' if self.device is None else self.device}"
            asked = f"{func} tried to allocate {needed} bytes with {self.live_bytes} bytes live and a cap of {self.max_bytes} bytes."
            raise torch.OutOfMemoryError(f"CUDA out of memory ({where}): {asked}")
        if self.live_bytes + needed > self.peak_bytes:
            self.peak_bytes = self.live_bytes + needed
            self._surplus = {key: more for key, more in self._surplus.items() if key in self._live}
            self.workspace_bytes_at_peak = sum(self._surplus.values()) + sum(entry[3] for entry in new) + workspace
        for key, storage, num_bytes, more in new:
            self._add(key, storage, num_bytes)
            if more:
                self._surplus[key] = more
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, int, int, Sequence[int]]:
        """The op's output, the allocator's peak inside it, its workspace and per output its surplus bytes."""
        on_host = self.device is None or self.device.type == "cpu"
        flat = leaves((args, kwargs)) if self.workspaces and on_host else []
        if flat and is_real_host_call(flat):
            out, peak = call_learning_allocations(func, args, kwargs, flat)
            return out, peak or 0, 0, ()
        return func(*args, **kwargs), 0, 0, ()
