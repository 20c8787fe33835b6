"""Device memory: capacity, peak meters, a simulated cap (:class:`MemoryBudget`), OOM detection and cleanup.

Pure torch + standard library + psutil (no Lightning import).

* :func:`device_total_memory` / :func:`device_free_memory`: what a device holds and has free,
  asked of the device layer (:mod:`.device`): on CUDA the driver's figures; on CPU
  ``psutil.virtual_memory()`` (``total``, ``available``), capped by the cgroup memory limit
  (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) when one is set.
* :class:`LiveTensorTracker`: a ``TorchDispatchMode`` that counts memory at the allocator, op by op.
  Each untyped storage is counted once, by its ``nbytes`` (what the CPU allocator hands out for
  it; views share their base's storage and add nothing), from the op that created it until it is
  freed (a weak reference to the storage calls back when it dies). On top of that, each op's
  *workspace* -- what its kernel allocates and frees inside itself (oneDNN reorders, scratch
  buffers), invisible to a storage count -- is learned from the profiler's allocator events the
  first time that op call is seen (:mod:`.op_memory`) and counted while the op runs, so the peak
  and the cap are those of the allocator. In-place ops and views allocate nothing and count
  nothing. With ``workspaces=False`` it counts storages alone, for real and fake tensors alike,
  which is what lets :mod:`.estimate` trace a step without allocating.
* :class:`MemoryBudget`: the tracker with a cap; an op whose new storage would pass the cap raises
  ``torch.OutOfMemoryError`` with "CUDA out of memory" in its message, so code written for a real
  CUDA OOM (``lightning.pytorch.utilities.memory.is_oom_error`` included) handles it the same way.
* :class:`PeakMemoryMeter`: the peak of one device between ``start()`` and ``stop()``, from the
  device layer (a :class:`LiveTensorTracker` on the host).
* :func:`device_usable_memory`: what a training step may use (free + already held by torch).
* :func:`parse_memory`: ``"300MB"``, ``"20GiB"``, ``0.9`` (a fraction of the device) or bytes.
* :func:`is_out_of_memory_error`, :func:`release_memory`, :func:`call_catching_oom`.

What a tracker counts: the tensors created while it is active, plus those handed to it as
``existing`` (modules: parameters, buffers and gradients; optimizers: their state; any tensors or
nested lists/tuples/dicts of them), which are counted from entry until they are freed. So a budget
entered with ``existing=(model, optimizer, batch)`` caps the whole training step, parameters,
gradients and optimizer state included, and a gradient freed by ``zero_grad(set_to_none=True)``
inside it is subtracted when it dies. Tensors that were alive before entry and not passed as
``existing`` are not counted; ``baseline_bytes`` adds a fixed amount for anything else.

Example::

    >>> import torch
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

import gc
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import psutil
import torch

from lightning_gpuopt.core._torch_compat import FakeTensor, TorchDispatchMode, storage_key, tree_leaves
from lightning_gpuopt.core.op_memory import call_learning_allocations
from lightning_gpuopt.core.search import round_up

#: markers of out-of-memory errors in exception messages (CUDA, MPS, XPU, cuBLAS, cuDNN, CPU allocator)
OOM_MESSAGE_MARKERS = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
)

#: the CUDA caching allocator hands out blocks in multiples of this many bytes
CUDA_ALLOCATION_GRANULARITY = 512

#: the fewest bytes a callback's ``max_memory`` accepts: ``max_memory=1`` (meant as "the whole
#: device", which is the fraction ``1.0``) is refused rather than read as one byte
MIN_MAX_MEMORY_BYTES = 1024

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_MEMORY_STRING = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


# ----------------------------------------------------------------------------- capacity


#: the memory limit of this process's cgroup: v2's ``memory.max``, else v1's ``memory.limit_in_bytes``
#: (``max`` in v2, and in v1 a figure near 2**63, mean no limit)
CGROUP_MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _cgroup_limit_bytes() -> int | None:
    """The cgroup memory limit in bytes (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``);
    ``None`` without one.

    Read here because psutil reports the host's RAM and ignores the container's cgroup limit: in a
    container capped at 8 GiB on a 512 GiB host, ``psutil.virtual_memory().total`` is 512 GiB.
    """
    for path in CGROUP_MEMORY_LIMIT_FILES:
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None
    return None


def host_memory_bytes(available: bool = False) -> int:
    """The host's RAM (``psutil.virtual_memory().total``) or, with ``available=True``, what can be
    allocated now without swapping (``.available``), each capped by the cgroup memory limit (v2 or v1): what the
    device layer reports as a CPU host's total and free memory.

    Example::

        >>> 0 < host_memory_bytes(available=True) <= host_memory_bytes()
        True
    """
    memory = psutil.virtual_memory()
    num_bytes = int(memory.available if available else memory.total)
    limit = _cgroup_limit_bytes()
    return num_bytes if limit is None else min(num_bytes, limit)


def device_total_memory(device: torch.device | str | int | None = None) -> int:
    """Bytes the device holds (see :meth:`lightning_gpuopt.core.device.Device.total_memory`).

    Example::

        >>> device_total_memory("cpu") > 0
        True
    """
    return _device_for(device).total_memory()


def device_free_memory(device: torch.device | str | int | None = None) -> int:
    """Bytes free on the device now (see :meth:`lightning_gpuopt.core.device.Device.free_memory`).

    Example::

        >>> 0 < device_free_memory("cpu") <= device_total_memory("cpu")
        True
    """
    return _device_for(device).free_memory()


def device_usable_memory(device: torch.device | str | int | None = None, *, existing: Iterable[Any] = ()) -> int:
    """Bytes a training step on ``device`` can use: free memory plus what torch already holds there.

    CUDA: free memory plus what the caching allocator has reserved (the model and optimizer live
    in it and a larger batch can reuse it). Elsewhere: free memory plus the storages of
    ``existing`` (e.g. the model and optimizer, already allocated and so no longer free).

    Example::

        >>> model = torch.nn.Linear(100, 100)
        >>> device_usable_memory("cpu", existing=[model]) >= storage_bytes(model)
        True
    """
    return _device_for(device).usable_memory(existing)


def _device_for(device: torch.device | str | int | None) -> Any:
    from lightning_gpuopt.core.device import device_for  # the device layer builds on this module

    return device_for(device)


def parse_memory(
    value: int | float | str,
    device: torch.device | str | int | None = None,
    *,
    name: str = "max_memory",
    minimum: int = 1,
) -> int:
    """An amount of memory in bytes from bytes, a string with a unit, or a fraction of the device.

    Decimal units are powers of 1000 (``"300MB"`` = 300,000,000 bytes), binary units powers of
    1024 (``"20GiB"`` = 20 * 2**30 bytes); units are case-insensitive. A float in ``(0, 1]`` is a
    fraction of :func:`device_total_memory` of ``device``, which must then be given.

    Args:
        value: bytes (a positive int), a string such as ``"300MB"``, ``"1.5GiB"`` or ``"4096"``,
            or a fraction of the device such as ``0.9``.
        device: the device a fraction refers to.
        name: the argument's name, used in error messages.
        minimum: the fewest bytes accepted (the callbacks' ``max_memory`` takes at least
            :data:`MIN_MAX_MEMORY_BYTES`, so that ``max_memory=1`` -- meant as the whole device --
            is refused rather than read as one byte).

    Raises:
        ValueError: for anything else; the message names the argument, the value given and what works.

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
    if isinstance(value, bool):
        raise ValueError(f"`{name}`={value!r} is a bool; expected {works}.")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"`{name}`={value!r} is not positive; expected {works}.")
        if value < minimum:
            raise ValueError(
                f"`{name}`={value!r} is {value} byte{'s' if value != 1 else ''}, below the minimum of "
                f"{minimum} bytes; for the whole device give the fraction 1.0. Expected {works}."
            )
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"`{name}`={value!r} is a float outside (0, 1]; expected {works}.")
        if device is None:
            raise ValueError(
                f"`{name}`={value!r} is a fraction of a device, but no device was given; "
                'pass `device=` or give bytes / a string such as "20GiB".'
            )
        total = device_total_memory(device)
        num_bytes = int(value * total)
        if num_bytes < minimum:
            raise ValueError(
                f"`{name}`={value!r} is {num_bytes} bytes of the device's {total}, below the minimum "
                f"of {minimum} bytes; expected {works}."
            )
        return num_bytes
    if isinstance(value, str):
        match = _MEMORY_STRING.match(value)
        if match is None:
            raise ValueError(f"`{name}`={value!r} is not a memory size; expected {works}.")
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
        num_bytes = int(number * _UNITS[unit])
        if num_bytes <= 0:
            raise ValueError(f"`{name}`={value!r} is zero bytes; expected {works}.")
        if num_bytes < minimum:
            raise ValueError(
                f"`{name}`={value!r} is {num_bytes} bytes, below the minimum of {minimum} bytes; expected {works}."
            )
        return num_bytes
    raise ValueError(f"`{name}`={value!r} has type {type(value).__name__}; expected {works}.")


# ----------------------------------------------------------------------------- tensors and storages


def collect_tensors(*objects: Any) -> Iterator[torch.Tensor]:
    """The tensors that ``objects`` hold: modules (parameters, buffers, gradients), optimizers (state)
    and tensors, also inside lists, tuples and dicts.

    Example::

        >>> len(list(collect_tensors(torch.nn.Linear(2, 3), [torch.zeros(1)])))
        3
    """
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            yield from collect_tensors(list(obj.state.values()))
        else:
            yield from (leaf for leaf in tree_leaves(obj) if isinstance(leaf, torch.Tensor))


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The untyped storage behind ``tensor`` (shared by its views), or ``None`` for a tensor without
    one (sparse, nested and other storage-less tensors).

    Example::

        >>> base = torch.zeros(4)
        >>> storage_key(storage_of(base[2:])) == storage_key(storage_of(base)), storage_of(base).nbytes()
        (True, 16)
    """
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested and other storage-less tensors
        return None


def storage_bytes(*objects: Any, granularity: int = 1) -> int:
    """Bytes of the distinct storages behind the tensors of ``objects`` (see :func:`collect_tensors`).

    Example::

        >>> base = torch.zeros(10)
        >>> storage_bytes(base, base[5:], torch.zeros(2))
        48
    """
    seen: dict[int, int] = {}
    for tensor in collect_tensors(*objects):
        storage = storage_of(tensor)
        if storage is not None:
            seen[storage_key(storage)] = round_up(storage.nbytes(), granularity)
    return sum(seen.values())


# ----------------------------------------------------------------------------- live storage tracking


class LiveTensorTracker(TorchDispatchMode):
    """A dispatch mode that counts the bytes of live tensor storages, with an optional cap.

    Active between ``__enter__`` and ``__exit__`` (usable as ``with`` or across two hooks). On entry
    the counts start at zero and the tensors of ``existing`` (see :func:`collect_tensors`) are
    counted; on exit all tracked state is dropped (``live_bytes`` is 0 again, ``peak_bytes`` kept),
    also when the block raised.

    Args:
        max_bytes: the cap; an op whose new storages would pass it raises ``torch.OutOfMemoryError``.
        existing: objects whose tensors count from entry: modules, optimizers, batches.
        device: count only tensors on this device (``None``: every device).
        granularity: round each storage up to a multiple of this (512 mimics the CUDA allocator).
        baseline_bytes: a fixed amount added to the live bytes (memory held outside tensors).
        workspaces: count what each op's kernel allocates inside itself on the host, learned from
            the profiler's allocator events (see :mod:`.op_memory`); ``False`` counts storages alone.

    Example::

        >>> with LiveTensorTracker() as tracker:
        ...     x = torch.ones(256)
        ...     y = x * 2                 # the kernel also wraps the 2 in a tensor: 8 + 4 bytes
        >>> tracker.peak_bytes            # two 1024-byte storages and the multiplication's 12
        2060
        >>> with LiveTensorTracker(workspaces=False) as storages_only:
        ...     x = torch.ones(256)
        ...     y = x * 2
        >>> storages_only.peak_bytes
        2048
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        *,
        existing: Iterable[Any] = (),
        device: torch.device | str | None = None,
        granularity: int = 1,
        baseline_bytes: int = 0,
        workspaces: bool = True,
    ) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.workspaces = workspaces
        self.existing = tuple(existing)
        self.device = None if device is None else torch.device(device)
        self.granularity = granularity
        self.baseline_bytes = baseline_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}

    # -- lifecycle
    def __enter__(self) -> LiveTensorTracker:
        self._clear()
        self.live_bytes = self.peak_bytes = self.baseline_bytes
        self.track(*self.existing)
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._clear()

    def _clear(self) -> None:
        self._live.clear()  # dropping the weak references also drops their callbacks
        self.live_bytes = 0

    @property
    def tracked_storages(self) -> int:
        """How many storages are counted as live now (0 outside the ``with`` block)."""
        return len(self._live)

    def reset_peak(self) -> None:
        """Restart the peak from the bytes live now."""
        self.peak_bytes = self.live_bytes

    # -- counting
    def track(self, *objects: Any) -> None:
        """Count the tensors of ``objects`` as live from now until they are freed (cap not applied)."""
        for key, storage, num_bytes in self._new_storages(collect_tensors(*objects), exclude=set()):
            self._add(key, storage, num_bytes)

    def _counts(self, tensor: torch.Tensor) -> bool:
        if self.device is None:
            return True
        device = tensor.device
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def _new_storages(self, tensors: Iterable[Any], exclude: set[int]) -> list[tuple[int, torch.UntypedStorage, int]]:
        found: dict[int, tuple[int, torch.UntypedStorage, int]] = {}
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or not self._counts(tensor):
                continue
            storage = storage_of(tensor)
            if storage is None:
                continue
            key = storage_key(storage)
            if key in self._live or key in exclude or key in found:
                continue
            num_bytes = round_up(storage.nbytes(), self.granularity)
            if num_bytes > 0:
                found[key] = (key, storage, num_bytes)
        return list(found.values())

    def _add(self, key: int, storage: torch.UntypedStorage, num_bytes: int) -> None:
        self._live[key] = (weakref.ref(storage, self._release_callback(key)), num_bytes)
        self.live_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release_callback(self, key: int) -> Callable[[weakref.ref], None]:
        def release(_ref: weakref.ref) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.live_bytes -= entry[1]

        return release

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        allocations = None
        if self.workspaces and self._counts_host() and is_real_host_call((args, kwargs)):
            out, allocations = call_learning_allocations(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        inputs = {
            storage_key(storage) for storage in map(storage_of, _tensor_leaves((args, kwargs))) if storage is not None
        }
        new = self._new_storages(tree_leaves(out), exclude=inputs)
        added = sum(num_bytes for _, _, num_bytes in new)
        # while the op ran it held its outputs and its workspace: the allocator's peak inside the op
        needed = max(added, allocations.peak_bytes if allocations is not None else 0)
        if self.max_bytes is not None and needed and self.live_bytes + needed > self.max_bytes:
            raise torch.OutOfMemoryError(self._oom_message(func, needed))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + needed)
        for key, storage, num_bytes in new:
            self._add(key, storage, num_bytes)
        return out

    def _counts_host(self) -> bool:
        return self.device is None or self.device.type == "cpu"

    def _oom_message(self, func: Any, added: int) -> str:
        where = "any device" if self.device is None else str(self.device)
        return (
            f"CUDA out of memory (simulated by {type(self).__name__} on {where}): {func} tried to allocate "
            f"{added} bytes with {self.live_bytes} bytes live and a cap of {self.max_bytes} bytes."
        )


def is_real_host_call(tree: Any) -> bool:
    """Whether an op call, given as the tree of its ``(args, kwargs)``, runs on real host tensors (no
    fake tensors, no tensor or ``torch.device`` of another device, meta included): only such a call
    can be run to learn its workspace.

    Example::

        >>> is_real_host_call(((torch.zeros(2), 3), {})), is_real_host_call(((torch.zeros(2, device="meta"),), {}))
        (True, False)
    """
    for leaf in tree_leaves(tree):
        if isinstance(leaf, FakeTensor):
            return False
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            return False
        if isinstance(leaf, torch.device) and leaf.type != "cpu":
            return False
    return True


def _tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class MemoryBudget(LiveTensorTracker):
    """A simulated device-memory cap: raises ``torch.OutOfMemoryError`` when live tensors would pass it.

    Counts what :class:`LiveTensorTracker` counts: tensors created inside the block, plus the
    tensors of ``existing`` (e.g. ``(model, optimizer, batch)`` to cap a whole training step with
    parameters, gradients and optimizer state), plus ``baseline_bytes``. The error's message
    contains "CUDA out of memory", so ``lightning.pytorch.utilities.memory.is_oom_error`` and
    :func:`is_out_of_memory_error` recognise it like a real CUDA OOM. It works on any device (on
    CUDA the real allocator still applies its own limit); nested budgets each apply their own cap,
    and leaving the block, normally or by an exception, drops all tracked state.

    Args:
        max_memory: the cap: bytes, a string such as ``"300MB"`` / ``"20GiB"``, or a fraction of
            ``device`` such as ``0.5`` (see :func:`parse_memory`).
        existing: objects whose tensors count from entry: modules, optimizers, batches.
        device: count only tensors on this device; also the device a fraction refers to.
        baseline_bytes: a fixed amount counted as live (memory held outside tensors).

    Example::

        >>> import torch
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
        super().__init__(
            parse_memory(max_memory, device),
            existing=existing,
            device=device,
            granularity=1 if device is None or torch.device(device).type != "cuda" else CUDA_ALLOCATION_GRANULARITY,
            baseline_bytes=baseline_bytes,
        )


# ----------------------------------------------------------------------------- peak meter


class PeakMemoryMeter:
    """Peak memory of one device between :meth:`start` and :meth:`stop` (or inside ``with``).

    The device layer's meter (:meth:`lightning_gpuopt.core.device.Device.peak_meter`): on the host
    a :class:`LiveTensorTracker` over the tensors of ``existing`` and those created in between
    (allocator-level: kernel workspaces included); on a CUDA card the allocated bytes at start plus
    the largest rise over the span (the process-wide peak counters are not reset), with
    :attr:`peak_reserved_bytes`; on a simulated card a window over its allocator.

    Args:
        device: the device to measure.
        existing: on the host, objects whose tensors count from the start (model, optimizer,
            batch); a simulated card moves them to itself.
        baseline_bytes: on the host, a fixed amount counted as live (memory held outside
            tensors the tracker can see; on CUDA the allocator already counts everything).

    Example::

        >>> model = torch.nn.Linear(10, 10)
        >>> with PeakMemoryMeter("cpu", existing=[model]) as meter:
        ...     model(torch.ones(4, 10)).sum().backward()
        >>> meter.peak_bytes >= 2 * (10 * 10 + 10) * 4
        True
    """

    def __init__(
        self, device: torch.device | str | None = None, *, existing: Iterable[Any] = (), baseline_bytes: int = 0
    ) -> None:
        self._meter = _device_for(device).peak_meter(existing=tuple(existing), baseline_bytes=baseline_bytes)

    @property
    def peak_bytes(self) -> int | None:
        return self._meter.peak_bytes

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self._meter.peak_reserved_bytes

    @property
    def running(self) -> bool:
        """Whether :meth:`start` was called and :meth:`stop` not yet."""
        return bool(getattr(self._meter, "running", False))

    def start(self) -> None:
        """Begin measuring (a running meter restarts)."""
        self._meter.start()

    def stop(self) -> int | None:
        """Stop measuring; returns the peak in bytes (``None`` if never started)."""
        return self._meter.stop()

    def __enter__(self) -> PeakMemoryMeter:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


# ----------------------------------------------------------------------------- OOM handling


def is_out_of_memory_error(exception: BaseException) -> bool:
    """Whether ``exception`` means the device ran out of memory.

    Broader than ``lightning.pytorch.utilities.memory.is_oom_error``: any ``torch.OutOfMemoryError``
    or ``MemoryError``, and ``RuntimeError`` messages from CUDA/MPS/XPU ("out of memory"), cuBLAS
    ("CUBLAS_STATUS_ALLOC_FAILED"), cuDNN ("CUDNN_STATUS_NOT_SUPPORTED", which cuDNN raises when
    its workspace cannot be allocated) and the CPU allocator.

    Example::

        >>> is_out_of_memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
        True
        >>> is_out_of_memory_error(ValueError("out of memory"))
        False
    """
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    message = " ".join(str(arg) for arg in exception.args)
    return any(marker in message for marker in OOM_MESSAGE_MARKERS)


def release_memory() -> None:
    """Free what a failed step left: collect garbage and, on CUDA, return cached blocks to the driver.

    Call it outside the ``except`` block that caught the error, so that the traceback (and the
    failed step's tensors its frames hold) is gone first; :func:`call_catching_oom` does this.
    """
    gc.collect()
    from lightning_gpuopt.core.device import cuda_initialised, simulated_device

    card = simulated_device()
    if card is not None:
        card.empty_cache()
    elif cuda_initialised():
        _device_for("cuda").empty_cache()


@dataclass
class CallOutcome:
    """What :func:`call_catching_oom` returns: the value, or that the call ran out of memory."""

    value: Any = None
    out_of_memory: bool = False
    error_message: str | None = None


def call_catching_oom(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CallOutcome:
    """Call ``fn``; on an out-of-memory error free its memory and report it instead of raising.

    Other exceptions propagate. The cleanup runs after the ``except`` block, when the exception and
    its traceback (whose frames hold the failed call's tensors) have been released.

    Example::

        >>> def step():
        ...     with MemoryBudget(1000):
        ...         return torch.zeros(1000)
        >>> outcome = call_catching_oom(step)
        >>> outcome.out_of_memory, "CUDA out of memory" in outcome.error_message
        (True, True)
    """
    message: str | None = None
    try:
        return CallOutcome(value=fn(*args, **kwargs))
    except BaseException as exc:
        if not is_out_of_memory_error(exc):
            raise
        message = str(exc)
    release_memory()
    return CallOutcome(out_of_memory=True, error_message=message)
