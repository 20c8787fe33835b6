"""The device layer: the one module that calls ``torch.cuda`` (NVML lives in :mod:`.nvml`). :func:`device_for` gives
the :class:`Device` of a torch device: the host (RAM capped by the cgroup limit psutil ignores), a real card
(:class:`CudaDevice`) or the simulated card in force (:func:`simulating`, where ``testing.SimulatedGpu`` plugs in).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import psutil
import torch

from lightning_gpuopt.core._torch_compat import clear_cublas_workspaces
from lightning_gpuopt.core.op_memory import LiveTensorTracker, SpanMeter, storage_bytes

CUDA_ALLOCATION_GRANULARITY = 512  #: the CUDA caching allocator hands out blocks in multiples of this many bytes
CUDA_SMALL_SEGMENT_BYTES = 2 * 2**20  #: its small pool's segment (``kSmallBuffer``): requests up to 1 MiB share these
# the cgroup memory limit: v2's ``memory.max``, else v1's (``max`` in v2, and in v1 a figure near 2**63, mean none)
_CGROUP_MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _host_memory_bytes(available: bool = False) -> int:
    """The host's RAM, or with ``available`` what can be allocated now; at most the cgroup limit."""
    memory = psutil.virtual_memory()
    num_bytes = int(memory.available if available else memory.total)
    for path in _CGROUP_MEMORY_LIMIT_FILES:
        with contextlib.suppress(OSError):
            text = Path(path).read_text().strip()
            return min(num_bytes, int(text)) if text.isdigit() else num_bytes
    return num_bytes


@dataclass(frozen=True)
class Capabilities:
    """What a device can do, as the library's decisions need it."""

    name: str
    compute_capability: Optional[tuple[int, int]] = None
    native_bf16: bool = False  #: bfloat16 in hardware (8.0 and up), not ``is_bf16_supported()``'s emulation
    tf32: bool = False  #: TF32 tensor cores (8.0 and up)
    mig: bool = False  #: a MIG instance (NVML reports no utilisation for it)
    cublas_workspace_bytes: int = 0  #: one cuBLAS workspace (:func:`cublas_workspace_bytes`); one per thread

    @classmethod
    def of_cuda(
        cls, name: str, capability: tuple[int, int], *, mig: bool = False, cublas: Optional[int] = None
    ) -> Capabilities:
        """A CUDA card of compute ``capability``; ``cublas``: torch's cuBLAS workspace size, where it says."""
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        ampere, cublas = capability >= (8, 0), cublas_workspace_bytes(capability, config, cublas)
        return cls(name, capability, native_bf16=ampere, tf32=ampere, mig=mig, cublas_workspace_bytes=cublas)


def cublas_workspace_bytes(capability: tuple[int, int], config: str = "", reported: Optional[int] = None) -> int:
    """One cuBLAS workspace (torch keeps one per thread that runs matmuls): ``reported`` (torch 2.13's
    ``torch.backends.cuda.cublas_workspace_size()``), else ``CUBLAS_WORKSPACE_CONFIG``'s ``:KIB:COUNT`` pairs (Lightning
    sets ``:4096:8`` for ``deterministic=True``), else 32 MiB on capability 9.x-12.x (before torch 2.8: 9.0), else 8.125 MiB.

    >>> cublas_workspace_bytes((9, 0)) >> 20, cublas_workspace_bytes((7, 5)), cublas_workspace_bytes((7, 5), ":4096:8") >> 20
    (32, 8519680, 32)
    """
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if reported is not None or pairs:
        return reported if reported is not None else sum(int(kib) * 1024 * int(count) for kib, count in pairs)
    return 32 * 2**20 if 9 <= capability[0] <= 12 else 4096 * 1024 * 2 + 16 * 1024 * 8


class Device:
    """A device the library measures and decides for: the host, unless a subclass says otherwise."""

    type = "cpu"  #: what the library treats the device as: ``"cuda"`` or ``"cpu"``

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
        """A CUDA card's UUID as torch spells it (bare hex; :func:`~.nvml.same_device` matches NVML's ``GPU-...``)."""
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

    def total_memory(self) -> int:
        return _host_memory_bytes()

    def free_memory(self) -> int:
        return _host_memory_bytes(available=True)

    def allocated_memory(self) -> Optional[int]:
        """Bytes the allocator has handed out now (``None`` where unknown: the host)."""
        return None

    def reserved_memory(self) -> Optional[int]:
        """Bytes the allocator holds now, handed out or cached (``None`` where unknown)."""
        return None

    def usable_memory(self, existing: Iterable[Any] = ()) -> int:
        """Free memory plus what torch holds (a card: all it reserved; the host: the storages of ``existing``)."""
        if (reserved := self.reserved_memory()) is not None:
            return self.free_memory() + reserved
        return min(self.free_memory() + storage_bytes(*existing), self.total_memory())

    def peak_meter(self, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        """A meter of a span's peak (the host counts ``existing`` and ``baseline_bytes`` too)."""
        return self.memory_cap(None, existing, baseline_bytes)

    def memory_cap(self, max_bytes: Optional[int], existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        """A meter whose span raises ``torch.OutOfMemoryError`` past ``max_bytes`` (``None``: no cap)."""
        return LiveTensorTracker(max_bytes, existing=existing, device=self.torch_device, baseline_bytes=baseline_bytes)

    def empty_cache(self, workspaces: bool = False) -> None:
        """Return cached blocks to the driver (``workspaces``: cuBLAS's workspaces first, as a fresh process has none)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on this device (of its type: any CUDA card for a card)."""
        return tensor.device.type == self.torch_device.type

    def new_event(self) -> Any:
        """A timing event recorded on the device's current stream (``None`` on the host: host timers suffice)."""
        return None

    def synchronize(self) -> None:
        """Wait for the device's queued work."""


class CudaDevice(Device):
    """A real CUDA card: each method is one documented ``torch.cuda`` call."""

    type = "cuda"

    @property
    def uuid(self) -> Optional[str]:
        return str(torch.cuda.get_device_properties(self.torch_device).uuid)

    @property
    def capabilities(self) -> Capabilities:
        props, size = torch.cuda.get_device_properties(self.torch_device), None
        with contextlib.suppress(AttributeError):  # torch 2.13 reports its cuBLAS workspace size
            size = torch.backends.cuda.cublas_workspace_size()
        return Capabilities.of_cuda(props.name, (props.major, props.minor), mig="MIG" in props.name, cublas=size)

    def total_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.torch_device)[1])

    def free_memory(self) -> int:
        return int(torch.cuda.mem_get_info(self.torch_device)[0])

    def allocated_memory(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))

    def reserved_memory(self) -> int:
        return int(torch.cuda.memory_reserved(self.torch_device))

    def memory_cap(self, max_bytes: Optional[int], existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _CudaPeakMeter(self, max_bytes)

    def empty_cache(self, workspaces: bool = False) -> None:
        if workspaces:
            clear_cublas_workspaces()
        torch.cuda.empty_cache()

    def new_event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


class _CudaPeakMeter(SpanMeter):
    """A span's peaks from the allocator's counters; ``max_bytes``: a memory fraction caps its reserved memory;
    ``alloc_retries``: its mallocs that freed cached blocks to retry (reserved memory brushed the cap)."""

    def __init__(self, device: CudaDevice, max_bytes: Optional[int] = None) -> None:
        self.device, self.max_bytes, self.alloc_retries, self._retries = device, max_bytes, 0, 0
        self._fraction: Optional[float] = None

    def _begin(self) -> None:
        where = self.device.torch_device
        if self.max_bytes is not None:
            self._fraction = torch.cuda.get_per_process_memory_fraction(where)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.max_bytes / self.device.total_memory()), where)
        for meter in _running_cuda_meters:  # a running outer span keeps the peaks the reset drops
            meter._fold()
        torch.cuda.reset_peak_memory_stats(where)
        self.peak_bytes = self.peak_reserved_bytes = None
        self._retries = self._fold()
        _running_cuda_meters.append(self)

    def _fold(self) -> int:
        """Take the allocator's peaks since the last reset into this span's; its count of alloc retries."""
        stats = torch.cuda.memory_stats(self.device.torch_device)
        self.peak_bytes = max(self.peak_bytes or 0, int(stats.get("allocated_bytes.all.peak", 0)))
        self.peak_reserved_bytes = max(self.peak_reserved_bytes or 0, int(stats.get("reserved_bytes.all.peak", 0)))
        return int(stats.get("num_alloc_retries", 0))

    def _end(self) -> None:
        try:
            self.alloc_retries = self._fold() - self._retries
        finally:
            _running_cuda_meters.remove(self)
            if self._fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self._fraction, self.device.torch_device)
                self._fraction = None


_running_cuda_meters: list[_CudaPeakMeter] = []
_simulations: list[Device] = []
#: whether a real CUDA card can be used (a simulated one does not count)
cuda_hardware_available = torch.cuda.is_available
#: the GPU architectures this torch build carries kernels for (``sm_90``, ...; ``compute_*`` is PTX)
cuda_arch_list = torch.cuda.get_arch_list


@contextlib.contextmanager
def simulating(device: Device) -> Iterator[Device]:
    """Within the block, :func:`device_for` answers ``device`` for the host and for ``"cuda"`` (one at a time)."""
    if _simulations:
        raise RuntimeError("a SimulatedGpu is already entered; simulate one card at a time")
    _simulations.append(device)
    try:
        yield device
    finally:
        _simulations.remove(device)


def cuda_available() -> bool:
    """Whether a CUDA card can be used (a simulated one counts)."""
    return bool(_simulations) or torch.cuda.is_available()


def cuda_device_count() -> int:
    """CUDA cards this process can use (a simulated card counts as one)."""
    return 1 if _simulations else torch.cuda.device_count()


def cuda_rng_in_use() -> bool:
    """Whether CUDA RNG states exist to save and restore: this process initialised a real card."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def device_for(device: torch.device | str | int | None = None) -> Device:
    """The :class:`Device` of a torch device (``None``: the host; an int: that CUDA card)."""
    device = (
        torch.device("cuda", device) if isinstance(device, int) else torch.device("cpu" if device is None else device)
    )
    if _simulations and device.type in ("cpu", "cuda"):
        return _simulations[-1]
    if device.type == "cuda":
        return CudaDevice(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    return Device(device)


def card_allocated_memory() -> Optional[int]:
    """Bytes the card in use (a simulated one included) has handed out now; ``None`` without one."""
    return device_for("cuda").allocated_memory() if _simulations or cuda_rng_in_use() else None


def release_memory(allocated_before: Optional[int] = None) -> None:
    """Collect a failed step's garbage (the young generations, 0.1-9 ms; all, 0.2 s and more, only where the card holds
    more than ``allocated_before``, ``None``: always), then empty the card's cache. Call it outside the ``except``
    block that caught the OOM, so that the traceback and the step's tensors are gone first."""
    gc.collect(1)
    allocated = card_allocated_memory()
    if allocated is None or allocated_before is None or allocated > allocated_before:
        gc.collect()
    if allocated is not None:
        device_for("cuda").empty_cache()


@contextlib.contextmanager
def objects_set_aside() -> Iterator[None]:
    """``gc.freeze`` for the block: a full collection in it scans only what the block made (0.2 ms against 0.18 s
    with torch and Lightning loaded); where something else froze objects already, nothing changes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class HostEvent:
    """A timing event on the host clock: the device clock of the simulated card (its ops run on the host)."""

    time_s: float = field(default_factory=time.perf_counter)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time``."""
        return (end.time_s - self.time_s) * 1e3

    def synchronize(self) -> None: ...
