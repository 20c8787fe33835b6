"""Background sampler of GPU utilisation and memory through NVML (``nvidia-ml-py``).

:class:`NvmlSampler` starts a daemon thread that reads, for each device it samples, the
utilisation (% of time a kernel ran during the driver's sample period, as ``nvidia-smi`` shows
it) and the memory used, at a fixed interval. Without an NVIDIA driver it is silently absent:
:meth:`NvmlSampler.start` returns ``False`` and every figure is ``None``.

The library: every NVML call of the package goes through :func:`nvml_library`, which is
``pynvml`` unless :func:`using_nvml_library` installed another object with its names (a
:class:`lightning_gpuopt.testing._nvml.FakeNvml`, a simulated GPU's NVML).

Devices are found by UUID, not by index: NVML numbers GPUs in PCI order, CUDA (by default)
fastest first, and ``CUDA_VISIBLE_DEVICES`` renumbers them. Give the sampler torch's UUIDs
(``str(torch.cuda.get_device_properties(i).uuid)``, printed without the ``"GPU-"``/``"MIG-"``
prefix; both forms are accepted) and read ``cuda:i``'s figures with ``take_window(uuid)``.

Tolerance: a device NVML refuses (``NoPermission``, ``NotSupported``, any ``NVMLError``) is
reported in its :class:`GpuUsage` (``error``, ``samples == 0``) and the others are still sampled;
a MIG instance (or a GPU in MIG mode) has no utilisation but its memory is read. Every successful
``nvmlInit`` is matched by exactly one ``nvmlShutdown``: in :meth:`NvmlSampler.stop`, or in
:meth:`NvmlSampler.start` when it returns ``False`` or raises.

Example::

    >>> from lightning_gpuopt.testing._nvml import FakeNvml, FakeNvmlDevice
    >>> nvml = FakeNvml([FakeNvmlDevice("NVIDIA T4", "GPU-5d2e", 16 << 30, memory_used=4 << 30, utilization=90)])
    >>> with using_nvml_library(nvml):
    ...     sampler = NvmlSampler(interval_s=0.5, uuids=["5d2e"])   # as torch prints the UUID
    ...     sampler.start()                     # False on a machine without an NVIDIA driver
    ...     sampler.take_window("5d2e")         # (mean utilisation %, max memory fraction)
    ...     usage = sampler.stop()              # one GpuUsage per device ([] without a driver)
    True
    (90.0, 0.25)
    >>> usage[0].util_mean, usage[0].memory_used_max_bytes == 4 << 30, nvml.initialised
    (90.0, True, 0)
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from lightning_gpuopt.core.checks import check_number

_PREFIXES = ("GPU-", "MIG-")


@dataclass
class GpuUsage:
    """Utilisation and memory of one GPU (or MIG instance) over the sampled period.

    ``index`` is the NVML index of the GPU (of the GPU it lives on, for a MIG instance; ``None``
    when unknown). ``samples`` counts the memory readings; ``util_*`` are ``None`` where NVML has
    no utilisation (MIG). ``error`` is the last NVML error the device raised, ``None`` if none.
    """

    index: Optional[int]
    name: str
    uuid: str
    visible: bool
    samples: int
    util_mean: Optional[float]
    util_max: Optional[float]
    memory_used_max_bytes: int
    memory_total_bytes: int
    mig: bool = False
    error: Optional[str] = None


@dataclass
class _Stats:
    samples: int = 0
    util_samples: int = 0
    util_sum: float = 0.0
    util_max: float = 0.0
    memory_used_max: int = 0
    memory_total: int = 0

    def add(self, util: Optional[float], used: int, total: int) -> None:
        self.samples += 1
        self.memory_used_max = max(self.memory_used_max, used)
        self.memory_total = total
        if util is not None:
            self.util_samples += 1
            self.util_sum += util
            self.util_max = max(self.util_max, util)

    @property
    def util_mean(self) -> Optional[float]:
        return self.util_sum / self.util_samples if self.util_samples else None


# ----------------------------------------------------------------------------- the library

_NO_OVERRIDE = object()
_override: Any = _NO_OVERRIDE


def nvml_library() -> Any:
    """The NVML library in use: the one :func:`using_nvml_library` installed, else ``pynvml``
    (``None`` when ``nvidia-ml-py`` is not installed).

    Example::

        >>> with using_nvml_library(None):
        ...     nvml_library() is None
        True
    """
    if _override is not _NO_OVERRIDE:
        return _override
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but be forgiving in odd environments
        return None
    return pynvml


@contextlib.contextmanager
def using_nvml_library(library: Any) -> Iterator[Any]:
    """Make :func:`nvml_library` return ``library`` inside the block (process-wide; blocks nest).

    ``library`` is any object with ``pynvml``'s names (``nvmlInit``, ``NVMLError``, ...), or
    ``None`` for "nvidia-ml-py is not installed". A sampler started inside the block keeps using
    ``library`` until it stops.

    Example::

        >>> from lightning_gpuopt.testing._nvml import FakeNvml
        >>> fake = FakeNvml([])
        >>> with using_nvml_library(fake):
        ...     nvml_library() is fake
        True
    """
    global _override
    previous, _override = _override, library
    try:
        yield library
    finally:
        _override = previous


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def error_text(error: BaseException) -> str:
    """An error as one line naming its type, as a device's ``error`` and the doctor's checks show it.

    Example::

        >>> error_text(PermissionError("Insufficient Permissions"))
        'PermissionError: Insufficient Permissions'
    """
    return f"{type(error).__name__}: {error}"


def _shutdown(lib: Any) -> None:
    with contextlib.suppress(lib.NVMLError, OSError):
        lib.nvmlShutdown()


# ----------------------------------------------------------------------------- UUIDs and CUDA_VISIBLE_DEVICES


def uuid_candidates(uuid: str) -> list[str]:
    """The NVML spellings of a UUID: as given when it has a prefix, else with ``"GPU-"`` and ``"MIG-"``.

    Example::

        >>> uuid_candidates("5d2e-11")
        ['GPU-5d2e-11', 'MIG-5d2e-11']
        >>> uuid_candidates("MIG-5d2e-11")
        ['MIG-5d2e-11']
    """
    uuid = uuid.strip()
    return [uuid] if uuid.startswith(_PREFIXES) else [prefix + uuid for prefix in _PREFIXES]


def _unique_prefix_match(entry: str, uuids: Sequence[str]) -> Optional[int]:
    matches = [i for i, uuid in enumerate(uuids) if uuid and (uuid.startswith(entry) or uuid[4:].startswith(entry))]
    return matches[0] if len(matches) == 1 else None


def _visible_entries(
    device_uuids: Sequence[str], env: Optional[str], mig_parents: Mapping[str, str]
) -> Optional[list[tuple[int, Optional[str]]]]:
    """``(GPU index, MIG UUID or None)`` per ``CUDA_VISIBLE_DEVICES`` entry, in ``cuda:i`` order;
    ``None`` when the variable is unset (every device visible)."""
    if env is None:
        return None
    entries: list[tuple[int, Optional[str]]] = []
    for entry in (part.strip() for part in env.split(",")):
        mig: Optional[str] = None
        if not entry:
            break
        if entry.isdigit():
            index: Optional[int] = int(entry) if int(entry) < len(device_uuids) else None
        elif entry.startswith("MIG-GPU-"):  # legacy MIG-GPU-<uuid>/<gi>/<ci>
            index = _unique_prefix_match(entry[4:].split("/")[0], device_uuids)
        elif entry.startswith("MIG-"):
            found = [m for m in mig_parents if m.startswith(entry)]
            mig = found[0] if len(found) == 1 else None
            index = None if mig is None else _unique_prefix_match(mig_parents[mig], device_uuids)
        else:
            index = _unique_prefix_match(entry, device_uuids)
        if index is None:
            break  # CUDA stops at the first invalid entry
        entries.append((index, mig))
    return entries


def visible_gpu_indices(
    device_uuids: Sequence[str], env: Optional[str] = None, mig_parents: Optional[Mapping[str, str]] = None
) -> list[int]:
    """NVML indices of the GPUs this process may use, in torch's ``cuda:i`` order.

    ``CUDA_VISIBLE_DEVICES`` entries may be indices, GPU UUIDs (``"GPU-..."``, with or without
    the prefix, or a unique prefix of one), MIG UUIDs (``"MIG-<uuid>"``) or the legacy
    ``"MIG-GPU-<uuid>/<gi>/<ci>"``. A MIG entry maps to the index of the GPU it lives on (so a GPU
    can appear twice when two of its instances are listed); CUDA's rule holds: the list stops
    at the first entry that names no device.

    Args:
        device_uuids: UUIDs of all GPUs in NVML order (``"GPU-..."``; ``""`` for a GPU NVML could not read).
        env: the value of ``CUDA_VISIBLE_DEVICES`` (read from the environment when omitted).
        mig_parents: MIG UUID -> UUID of its GPU, for ``"MIG-<uuid>"`` entries (see :func:`nvml_devices`,
            which resolves them through NVML).

    Example::

        >>> visible_gpu_indices(["GPU-aa", "GPU-bb"], "MIG-cc,0", mig_parents={"MIG-cc": "GPU-bb"})
        [1, 0]
        >>> visible_gpu_indices(["GPU-aa", "GPU-bb"], "MIG-GPU-bb/1/0"), visible_gpu_indices(["GPU-aa"], "0,3,0")
        ([1], [0])
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    entries = _visible_entries(device_uuids, env, mig_parents or {})
    return list(range(len(device_uuids))) if entries is None else [index for index, _ in entries]


def _mig_parents(lib: Any, env: Optional[str]) -> dict[str, str]:
    """MIG UUID -> its GPU's UUID, through NVML, for each ``"MIG-<uuid>"`` entry of ``env``."""
    parents = {}
    for entry in (part.strip() for part in (env or "").split(",")):
        if not entry.startswith("MIG-") or entry.startswith("MIG-GPU-"):
            continue
        try:
            handle = lib.nvmlDeviceGetHandleByUUID(entry)
            parents[entry] = _text(lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)))
        except lib.NVMLError:
            continue  # an entry NVML cannot resolve names no device: the visible list stops there
    return parents


# ----------------------------------------------------------------------------- devices


@dataclass
class NvmlDevice:
    """A GPU or MIG instance as NVML shows it; ``handle`` is ``None`` and ``error`` set when NVML refused it.

    ``index``: the NVML index of the GPU (for a MIG instance, of its GPU; ``None`` when unknown).
    ``visible``: ``CUDA_VISIBLE_DEVICES`` leaves it visible (a MIG instance: listed itself, or its
    GPU listed by index, GPU UUID or legacy ``MIG-GPU-`` entry).
    """

    index: Optional[int]
    uuid: str
    name: str = ""
    handle: Any = None
    mig: bool = False
    visible: bool = True
    error: Optional[str] = None
    stats: _Stats = field(default_factory=_Stats, repr=False)
    window: _Stats = field(default_factory=_Stats, repr=False)


def _open_gpu(lib: Any, index: int) -> NvmlDevice:
    device = NvmlDevice(index=index, uuid="")
    try:
        device.handle = lib.nvmlDeviceGetHandleByIndex(index)
        device.uuid = _text(lib.nvmlDeviceGetUUID(device.handle))
        device.name = _text(lib.nvmlDeviceGetName(device.handle))
    except lib.NVMLError as error:
        device.error = error_text(error)
    return device


def _open_uuid(lib: Any, uuid: str, gpus: Sequence[NvmlDevice]) -> NvmlDevice:
    device = NvmlDevice(index=None, uuid=uuid)
    try:
        device.handle, device.uuid = _handle_by_uuid(lib, uuid)
        device.mig = device.uuid.startswith("MIG-")
        parent_uuid = device.uuid
        if device.mig:
            parent_uuid = _text(lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device.handle)))
        device.index = next((gpu.index for gpu in gpus if gpu.uuid == parent_uuid), None)
        device.name = _text(lib.nvmlDeviceGetName(device.handle))
    except lib.NVMLError as error:
        device.error = error_text(error)
    return device


def _handle_by_uuid(lib: Any, uuid: str) -> tuple[Any, str]:
    """``(handle, the UUID NVML accepted)``, trying each of :func:`uuid_candidates`."""
    error: Optional[BaseException] = None
    for candidate in uuid_candidates(uuid):
        try:
            return lib.nvmlDeviceGetHandleByUUID(candidate), candidate
        except (lib.NVMLError_NotFound, lib.NVMLError_InvalidArgument) as not_this:
            error = not_this
    assert error is not None
    raise error


def nvml_devices(lib: Any, uuids: Optional[Sequence[str]] = None, env: Optional[str] = None) -> list[NvmlDevice]:
    """The GPUs NVML numbers (``uuids=None``), or the devices with ``uuids`` (GPUs or MIG
    instances, with or without the prefix; one :class:`NvmlDevice` each, in that order).

    NVML must be initialised. A device NVML refuses comes back with ``error`` set; only a failing
    ``nvmlDeviceGetCount`` raises. ``env`` is ``CUDA_VISIBLE_DEVICES`` (read when omitted).

    Example::

        >>> from lightning_gpuopt.testing._nvml import FakeNvml, FakeNvmlDevice
        >>> nvml = FakeNvml([FakeNvmlDevice("NVIDIA T4", "GPU-1", 16 << 30, error="no-permission"),
        ...                  FakeNvmlDevice("NVIDIA T4", "GPU-2", 16 << 30)])
        >>> nvml.nvmlInit()
        >>> [(device.index, device.uuid, device.error) for device in nvml_devices(nvml, env="1")]
        [(0, '', 'NVMLError_NoPermission: Insufficient Permissions'), (1, 'GPU-2', None)]
        >>> nvml.nvmlShutdown()
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    return _discover(lib, uuids, env)[0]


def _discover(lib: Any, uuids: Optional[Sequence[str]], env: Optional[str]) -> tuple[list[NvmlDevice], list[int]]:
    """:func:`nvml_devices` and :func:`visible_gpu_indices` for ``env``, with one pass over NVML."""
    gpus = [_open_gpu(lib, index) for index in range(int(lib.nvmlDeviceGetCount()))]
    devices = gpus
    if uuids is not None:
        devices = []
        for uuid in uuids:
            device = _open_uuid(lib, uuid, gpus)
            if device.handle is None or all(device.uuid != other.uuid for other in devices):
                devices.append(device)
    entries = _visible_entries([gpu.uuid for gpu in gpus], env, _mig_parents(lib, env))
    if entries is None:
        return devices, list(range(len(gpus)))
    listed = {index for index, _ in entries}
    listed_gpus = {index for index, mig in entries if mig is None}
    listed_migs = {mig for _, mig in entries if mig is not None}
    for device in devices:
        if device.mig:
            device.visible = device.uuid in listed_migs or device.index in listed_gpus
        else:
            device.visible = device.index in listed
    return devices, [index for index, _ in entries]


# ----------------------------------------------------------------------------- the sampler


class NvmlSampler:
    """Samples utilisation and memory of GPUs (or MIG instances) in a background thread.

    Args:
        interval_s: seconds between samples (NVML's own utilisation counter is averaged
            over 1/6 s to 1 s depending on the GPU, so faster adds no information).
        uuids: the devices to sample, by UUID (``"GPU-..."``, ``"MIG-..."`` or torch's form without
            the prefix, e.g. ``str(torch.cuda.get_device_properties(i).uuid)``); ``None``: every GPU
            NVML numbers (MIG instances are only sampled when named here).

    Example::

        >>> from lightning_gpuopt.testing._nvml import FakeNvml, FakeNvmlDevice
        >>> mig = FakeNvmlDevice("A100 MIG 1g.5gb", "MIG-7", 5 << 30, memory_used=1 << 30, utilization=None, mig=True)
        >>> with using_nvml_library(FakeNvml([mig])):
        ...     sampler = NvmlSampler(uuids=["7"])
        ...     sampler.start(), sampler.take_window("7")       # MIG: no utilisation, memory read
        ...     sampler.stop()[0].mig
        (True, (None, 0.2))
        True
    """

    def __init__(self, interval_s: float = 0.5, uuids: Optional[Sequence[str]] = None) -> None:
        self.interval_s = check_number("interval_s", interval_s, "interval_s=0.5", low=0, low_inclusive=False)
        if uuids is not None and (isinstance(uuids, str) or not all(isinstance(u, str) and u for u in uuids)):
            raise ValueError(f"uuids={uuids!r}: give a list of device UUIDs, e.g. uuids=['GPU-5d2e...'], or None")
        self.uuids = None if uuids is None else list(uuids)
        self._lib: Any = None
        self._devices: list[NvmlDevice] = []
        self._visible: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._final: list[GpuUsage] = []

    @property
    def available(self) -> bool:
        """NVML is running and at least one device answers."""
        return self._lib is not None and any(device.handle is not None for device in self._devices)

    @property
    def visible_indices(self) -> list[int]:
        """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, in ``cuda:i`` order
        (:func:`visible_gpu_indices`); ``[]`` before :meth:`start` or without a driver."""
        return list(self._visible)

    def start(self) -> bool:
        """Initialise NVML, find the devices and start sampling.

        ``False`` (NVML shut down again, no thread) without a driver, when ``nvmlDeviceGetCount``
        fails, or when no device answers. A device NVML refuses does not stop the others.
        """
        if self._thread is not None:
            return True
        lib = nvml_library()
        if lib is None:
            return False
        try:
            lib.nvmlInit()
        except (lib.NVMLError, OSError):
            return False
        try:
            started = self._start(lib)
        except BaseException as error:
            self._reset()
            _shutdown(lib)
            if isinstance(error, (lib.NVMLError, OSError)):
                return False
            raise
        if not started:
            self._reset()
            _shutdown(lib)
        return started

    def _start(self, lib: Any) -> bool:
        devices, visible = _discover(lib, self.uuids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not any(device.handle is not None for device in devices):
            return False
        self._lib, self._devices, self._visible = lib, devices, visible
        self._final = []
        self._stop.clear()
        self._sample_once()
        self._thread = threading.Thread(target=self._run, name="gpuopt-nvml-sampler", daemon=True)
        self._thread.start()
        return True

    def _reset(self) -> None:
        self._lib, self._devices, self._visible, self._thread = None, [], [], None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        lib = self._lib
        if lib is None:  # stopped while a sample was due
            return
        for device in self._devices:
            if device.handle is None:
                continue
            try:
                memory = lib.nvmlDeviceGetMemoryInfo(device.handle)
            except lib.NVMLError as error:
                device.error = error_text(error)
                continue
            try:
                util: Optional[float] = float(lib.nvmlDeviceGetUtilizationRates(device.handle).gpu)
            except lib.NVMLError:
                util = None  # MIG instances and GPUs in MIG mode have no utilisation
            with self._lock:
                device.stats.add(util, int(memory.used), int(memory.total))
                device.window.add(util, int(memory.used), int(memory.total))

    def _find(self, key: Union[str, int]) -> Optional[NvmlDevice]:
        if isinstance(key, int):
            return next((d for d in self._devices if d.index == key and not d.mig), None)
        candidates = {candidate.lower() for candidate in uuid_candidates(key)}
        return next((d for d in self._devices if d.uuid.lower() in candidates), None)

    def take_window(self, key: Union[str, int]) -> tuple[Optional[float], Optional[float]]:
        """(mean utilisation %, max memory used fraction) of one device since the last call.

        ``key`` is the device's UUID (with or without the ``"GPU-"``/``"MIG-"`` prefix) or, as
        before, the NVML index of a GPU. ``(None, None)`` for a device not sampled or without a
        sample; the utilisation is ``None`` on a MIG instance.
        """
        device = self._find(key) if self.available else None
        if device is None:
            return None, None
        with self._lock:
            window, device.window = device.window, _Stats()
        if not window.samples:
            return None, None
        memory = window.memory_used_max / window.memory_total if window.memory_total else None
        return window.util_mean, memory

    def usage(self) -> list[GpuUsage]:
        """Per-device figures over everything sampled so far, one per sampled device, in order."""
        with self._lock:
            return [
                GpuUsage(
                    index=device.index,
                    name=device.name,
                    uuid=device.uuid,
                    visible=device.visible,
                    samples=device.stats.samples,
                    util_mean=device.stats.util_mean,
                    util_max=device.stats.util_max if device.stats.util_samples else None,
                    memory_used_max_bytes=device.stats.memory_used_max,
                    memory_total_bytes=device.stats.memory_total,
                    mig=device.mig,
                    error=device.error,
                )
                for device in self._devices
            ]

    def stop(self) -> list[GpuUsage]:
        """Stop the thread, take a last sample, shut NVML down once, and return :meth:`usage`.

        Safe to call twice, and before or without a successful :meth:`start`.
        """
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None
            self._sample_once()
            self._final = self.usage()
            lib, self._lib = self._lib, None
            _shutdown(lib)
        return self._final


@contextlib.contextmanager
def nvml_session() -> Iterator[tuple[Any, str]]:
    """``(library, "")`` initialised inside the block (:func:`nvml_library`),
    or ``(None, why not)`` without a driver. Shuts NVML down once on leaving."""
    lib = nvml_library()
    if lib is None:
        yield None, "nvidia-ml-py (pynvml) is not installed"
        return
    try:
        lib.nvmlInit()
    except (lib.NVMLError, OSError) as error:
        yield None, f"no NVIDIA driver ({error})"
        return
    try:
        yield lib, ""
    finally:
        with contextlib.suppress(lib.NVMLError, OSError):
            lib.nvmlShutdown()


def driver_versions(lib: Any) -> tuple[int, str]:
    """``(CUDA version the driver supports, e.g. 12040; driver release, e.g. "550.54.15")``."""
    return int(lib.nvmlSystemGetCudaDriverVersion()), _text(lib.nvmlSystemGetDriverVersion())


def memory_info(lib: Any, handle: Any) -> Any:
    """The device's memory (``.total``, ``.used``, ``.free`` in bytes); NVML's errors propagate."""
    return lib.nvmlDeviceGetMemoryInfo(handle)


def compute_processes(lib: Any, handle: Any) -> list[Any]:
    """Processes computing on the device (``.pid``, ``.usedGpuMemory``); NVML's errors propagate."""
    return list(lib.nvmlDeviceGetComputeRunningProcesses(handle))


def utilisation_percent(lib: Any, handle: Any) -> Optional[int]:
    """% of time a kernel ran, as nvidia-smi shows it; ``None`` where NVML has no figure (MIG mode)."""
    try:
        return int(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
    except lib.NVMLError:
        return None


def process_name(lib: Any, pid: int) -> str:
    """The executable's name of process ``pid`` (``"?"`` when NVML cannot tell)."""
    try:
        return os.path.basename(_text(lib.nvmlSystemGetProcessName(pid)))
    except lib.NVMLError:
        return "?"
