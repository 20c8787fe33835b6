"""The device layer: the one module that calls ``torch.cuda`` (NVML lives in :mod:`.nvml`).

Everything the library asks of a device goes through a :class:`Device`, obtained with
:func:`device_for`:

* :class:`HostDevice` -- the CPU: host RAM (``psutil.virtual_memory()``, cgroup limit), memory counted at
  the allocator by a :class:`~lightning_gpuopt.core.memory.LiveTensorTracker`;
* :class:`CudaDevice` -- a real CUDA card: a thin layer, each method one documented
  ``torch.cuda`` call;
* :class:`SimulatedCudaDevice` -- a CUDA card simulated on the CPU
  (:class:`lightning_gpuopt.testing.SimulatedGpu`): tensors stay on the host, every decision of
  the library sees a CUDA device of the chosen profile, memory is counted at the host allocator
  and passed through a model of the CUDA caching allocator
  (:class:`~lightning_gpuopt.core.allocator.CachingAllocatorModel`).

A device answers: capacity, free memory, allocated and reserved bytes now, a peak meter for a
span of code (peaks by windows or deltas: the process-wide peak counters that other tools read
are never reset), a memory cap that raises ``torch.OutOfMemoryError`` (on CUDA on *reserved*
memory, through the per-process memory fraction), ``empty_cache``, timing events for the GPU
idle/busy split, its NVML UUID and its :class:`Capabilities` (native bf16, fp16 tensor cores,
TF32, MIG, pinned memory).

Example::

    >>> device = device_for("cpu")
    >>> device.is_cuda, device.type, device.capabilities.native_bf16
    (False, 'cpu', False)
    >>> import torch
    >>> with device.peak_meter() as meter:
    ...     x = torch.zeros(1000)
    >>> meter.peak_bytes
    4000
"""

from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Protocol

import torch

from lightning_gpuopt.core.memory import LiveTensorTracker, MemoryBudget, host_memory_bytes, storage_bytes
from lightning_gpuopt.core.op_memory import AllocationWindow

#: cuBLAS keeps one workspace per handle and stream, allocated through the caching allocator:
#: 4096 KiB x 2 + 16 KiB x 8 before Hopper, 32 MiB from compute capability 9.0 on (torch's defaults)
CUBLAS_WORKSPACE_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_HOPPER = 32 * 2**20


def cublas_workspace_bytes(capability: Optional[tuple[int, int]]) -> int:
    """The cuBLAS workspace torch allocates on a card of ``capability`` (0 without one).

    Example::

        >>> cublas_workspace_bytes((9, 0)) // 2**20, cublas_workspace_bytes((7, 5)), cublas_workspace_bytes(None)
        (32, 8519680, 0)
    """
    if capability is None:
        return 0
    return CUBLAS_WORKSPACE_HOPPER if capability >= (9, 0) else CUBLAS_WORKSPACE_PRE_HOPPER


@dataclass(frozen=True)
class Capabilities:
    """What a device can do, as the library's decisions need it."""

    name: str
    compute_capability: Optional[tuple[int, int]] = None
    #: bfloat16 in hardware (compute capability >= 8.0); not ``is_bf16_supported()``, which counts emulation
    native_bf16: bool = False
    #: float16 tensor cores (compute capability >= 7.0)
    fp16_tensor_cores: bool = False
    #: TF32 tensor cores (compute capability >= 8.0)
    tf32: bool = False
    #: a MIG instance (NVML reports no utilisation for it)
    mig: bool = False
    #: page-locked host memory speeds up host-to-device copies
    pinned_memory: bool = False
    #: bytes of the cuBLAS workspace the allocator holds once a matmul ran
    cublas_workspace_bytes: int = 0

    @classmethod
    def of_cuda(cls, name: str, capability: tuple[int, int], *, mig: bool = False) -> Capabilities:
        """The capabilities of a CUDA card of ``capability``.

        Example::

            >>> Capabilities.of_cuda("Tesla T4", (7, 5)).native_bf16
            False
        """
        return cls(
            name,
            capability,
            native_bf16=capability >= (8, 0),
            fp16_tensor_cores=capability >= (7, 0),
            tf32=capability >= (8, 0),
            mig=mig,
            pinned_memory=True,
            cublas_workspace_bytes=cublas_workspace_bytes(capability),
        )


class SpanMeter(abc.ABC):
    """What every meter shares: peaks of a span between :meth:`start` and :meth:`stop`, usable as
    ``with``; subclasses implement ``_begin`` and ``_end`` (which sets the peaks)."""

    def __init__(self) -> None:
        self.peak_bytes: Optional[int] = None
        self.peak_reserved_bytes: Optional[int] = None
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Begin measuring (a running meter restarts)."""
        self.stop()
        self._begin()
        self._running = True

    def stop(self) -> Optional[int]:
        """Stop measuring; the peak in bytes (``None`` if never started)."""
        if self._running:
            self._running = False
            self._end()
        return self.peak_bytes

    @abc.abstractmethod
    def _begin(self) -> None:
        """Start counting."""

    @abc.abstractmethod
    def _end(self) -> None:
        """Stop counting and set :attr:`peak_bytes` (and :attr:`peak_reserved_bytes` where known)."""

    def __enter__(self) -> SpanMeter:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class Event(Protocol):
    """A timing event on the device's stream (``torch.cuda.Event`` on a real card)."""

    def query(self) -> bool: ...

    # ``end``: an event of the same kind (torch's takes a torch.cuda.Event named ``end_event``)
    def elapsed_time(self, end: Any, /) -> float: ...

    def synchronize(self) -> None: ...


class Device:
    """A device the library measures and decides for; the host CPU unless a subclass says otherwise.

    Args:
        torch_device: where the tensors live.
    """

    #: what the library treats the device as: ``"cuda"`` or ``"cpu"``
    type = "cpu"

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def index(self) -> int:
        return self.torch_device.index or 0

    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def uuid(self) -> Optional[str]:
        """The NVML UUID (``GPU-...`` / ``MIG-...``) of a CUDA card; ``None`` elsewhere."""
        return None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(self.torch_device.type)

    @property
    def autocast_device_type(self) -> str:
        """The ``device_type`` autocast and a ``GradScaler`` need for tensors on this device."""
        return self.torch_device.type

    def describe(self) -> str:
        """e.g. ``"cuda:0 (NVIDIA H100 80GB HBM3)"``, or ``"cpu"``."""
        return f"{self.type}:{self.index} ({self.name})" if self.is_cuda else str(self.torch_device)

    # -- memory
    def total_memory(self) -> int:
        """Bytes the device holds (host: physical RAM, cgroup limit applied)."""
        return host_memory_bytes()

    def free_memory(self) -> int:
        """Bytes free now (host: what can be allocated without swapping, at most the cgroup limit)."""
        return host_memory_bytes(available=True)

    def allocated_memory(self) -> Optional[int]:
        """Bytes the allocator has handed out now (``None`` where unknown: the host)."""
        return None

    def reserved_memory(self) -> Optional[int]:
        """Bytes the allocator holds now, handed out or cached (``None`` where unknown)."""
        return None

    def usable_memory(self, existing: Iterable[Any] = ()) -> int:
        """What a training step can use: free memory plus what torch holds already (the storages
        of ``existing`` on the host; everything reserved on a CUDA card)."""
        return min(self.free_memory() + storage_bytes(*existing), self.total_memory())

    def peak_meter(self, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        """A meter of the peak of a span, counting ``existing``'s tensors and ``baseline_bytes`` on the
        host (a card's allocator counts everything it holds)."""
        return _TrackerMeter(
            LiveTensorTracker(existing=existing, device=self.torch_device, baseline_bytes=baseline_bytes)
        )

    def memory_cap(self, max_bytes: int, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        """A meter whose span raises ``torch.OutOfMemoryError`` past ``max_bytes`` (host: a
        :class:`~lightning_gpuopt.core.memory.MemoryBudget` counting ``existing`` too)."""
        return _TrackerMeter(
            MemoryBudget(max_bytes, existing=existing, device=self.torch_device, baseline_bytes=baseline_bytes)
        )

    def empty_cache(self) -> None:
        """Return cached blocks to the driver (nothing to do on the host)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device."""
        return tensor.device.type == self.torch_device.type

    # -- time
    def new_event(self) -> Optional[Event]:
        """A recorded timing event on the device's current stream (``None`` on the host: host timers suffice)."""
        return None

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to do on the host)."""


class HostDevice(Device):
    """The CPU: host RAM, memory counted at the host allocator."""


class _TrackerMeter(SpanMeter):
    """A :class:`LiveTensorTracker` (or budget) as a meter."""

    def __init__(self, tracker: LiveTensorTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def _begin(self) -> None:
        self.tracker.__enter__()

    def _end(self) -> None:
        self.tracker.__exit__(None, None, None)
        self.peak_bytes = self.tracker.peak_bytes


# ----------------------------------------------------------------------------- real CUDA (thin)


class CudaDevice(Device):
    """A real CUDA card: each method is one documented ``torch.cuda`` call."""

    type = "cuda"

    @property
    def _properties(self) -> Any:
        return torch.cuda.get_device_properties(self.torch_device)

    @property
    def uuid(self) -> Optional[str]:
        return str(self._properties.uuid)

    @property
    def capabilities(self) -> Capabilities:
        props = self._properties
        return Capabilities.of_cuda(props.name, (props.major, props.minor), mig="MIG" in props.name)

    def total_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.torch_device)[1])

    def free_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.torch_device)[0])

    def allocated_memory(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))

    def reserved_memory(self) -> int:
        return int(torch.cuda.memory_reserved(self.torch_device))

    def usable_memory(self, existing: Iterable[Any] = ()) -> int:
        return self.free_memory() + self.reserved_memory()

    def peak_meter(self, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _CudaPeakMeter(self)

    def memory_cap(self, max_bytes: int, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _CudaCapMeter(self, max_bytes)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def new_event(self) -> Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


class _CudaPeakMeter(SpanMeter):
    """The peak allocated between start and stop, from the profiler's allocator events (the
    allocated bytes at start plus the largest running sum of the span's allocations and frees),
    so ``reset_peak_memory_stats`` is never called. Reserved memory only grows between
    ``empty_cache`` calls: its peak is the larger of the reserved bytes at start and at stop.
    When another profiler already runs, the process-wide ``max_memory_allocated`` is the answer
    (an upper bound of the span's peak)."""

    def __init__(self, device: CudaDevice) -> None:
        super().__init__()
        self.device = device
        self._window = AllocationWindow("cuda", device.index)
        self._start: tuple[int, int] = (0, 0)

    def _begin(self) -> None:
        self._start = (self.device.allocated_memory(), self.device.reserved_memory())
        self._window.__enter__()

    def _end(self) -> None:
        self._window.__exit__(None, None, None)
        allocated, reserved = self._start
        if self._window.peak_delta_bytes is None:
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device.torch_device))
        else:
            self.peak_bytes = allocated + self._window.peak_delta_bytes
        self.peak_reserved_bytes = max(reserved, self.device.reserved_memory())


class _CudaCapMeter(_CudaPeakMeter):
    """A peak meter whose span may reserve at most ``max_bytes``: the caching allocator's
    per-process memory fraction, put back as it was on stop."""

    def __init__(self, device: CudaDevice, max_bytes: int) -> None:
        super().__init__(device)
        self.max_bytes = max_bytes
        self._fraction: Optional[float] = None

    def _begin(self) -> None:
        self._fraction = torch.cuda.get_per_process_memory_fraction(self.device.torch_device)
        fraction = min(1.0, self.max_bytes / self.device.total_memory())
        torch.cuda.set_per_process_memory_fraction(fraction, self.device.torch_device)
        super()._begin()

    def _end(self) -> None:
        try:
            super()._end()
        finally:
            if self._fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self._fraction, self.device.torch_device)
                self._fraction = None


# ----------------------------------------------------------------------------- choosing a device

_simulations: list[Device] = []


@contextlib.contextmanager
def simulating(device: Device) -> Iterator[Device]:
    """Within the block, :func:`device_for` answers ``device`` for the host and for ``"cuda"``
    (used by :class:`lightning_gpuopt.testing.SimulatedGpu`)."""
    _simulations.append(device)
    try:
        yield device
    finally:
        _simulations.remove(device)


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Inside the block tensors are host tensors, also under a simulated card: for work a real run
    does on the host (e.g. the estimate's probe of kernel workspaces), which must not count on it."""
    card = _simulations[-1] if _simulations else None
    if card is None:
        yield
        return
    with card.paused():  # type: ignore[attr-defined]
        yield


def simulated_device() -> Optional[Device]:
    """The simulated card in force, if any."""
    return _simulations[-1] if _simulations else None


def cuda_available() -> bool:
    """Whether a CUDA card can be used (a simulated one counts)."""
    return bool(_simulations) or torch.cuda.is_available()


def cuda_hardware_available() -> bool:
    """Whether a real CUDA card can be used (``torch.cuda.is_available()``; a simulated one does not count)."""
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    """CUDA cards this process can use (a simulated card counts as one)."""
    return 1 if _simulations else torch.cuda.device_count()


def cuda_arch_list() -> list[str]:
    """The GPU architectures this torch build carries kernels for (``sm_90``, ...; ``compute_*`` is PTX)."""
    return torch.cuda.get_arch_list()


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (a simulated card never does)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def cuda_rng_in_use() -> bool:
    """Whether CUDA RNG states exist to save and restore (only on a real, initialised card)."""
    return cuda_initialised()


def device_for(device: torch.device | str | int | None = None) -> Device:
    """The :class:`Device` for a torch device (``None``: the host; an int: that CUDA card).

    Under :class:`~lightning_gpuopt.testing.SimulatedGpu` the host and ``"cuda"`` are the
    simulated card.

    Example::

        >>> type(device_for("cpu")).__name__
        'HostDevice'
    """
    if device is None:
        device = torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if _simulations and device.type in ("cpu", "cuda"):
        return _simulations[-1]
    if device.type == "cuda":
        return CudaDevice(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    return HostDevice(device)


def default_device() -> Device:
    """The device a run would use by default: CUDA card 0 when there is one, else the host."""
    return device_for("cuda" if cuda_available() else "cpu")


class HostEvent:
    """A timing event taken on the host: for a device that runs every op synchronously on the
    host (the simulated card), the host clock is the device clock."""

    def __init__(self) -> None:
        self.time_s = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        return (end.time_s - self.time_s) * 1e3

    def synchronize(self) -> None:
        pass
