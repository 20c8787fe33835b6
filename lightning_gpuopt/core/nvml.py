"""NVML (``nvidia-ml-py``, imported as ``pynvml``): GPU utilisation and memory, and the doctor's queries.

:class:`NvmlSampler` samples devices in a daemon thread (absent without a driver), matched by UUID (NVML numbers
GPUs in PCI order, CUDA fastest first). Every call goes through :func:`nvml_library` (a fake may answer).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

_PREFIXES = ("GPU-", "MIG-")


@dataclass
class GpuUsage:
    """One GPU's (or MIG instance's) figures over the sampled period: ``index`` is NVML's (a MIG instance's
    GPU's), ``util_*`` the % of time a kernel ran (``None`` on MIG), ``error`` the last NVML error."""

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
    util_max: Optional[float] = None
    used_max: int = 0
    total: int = 0

    def add(self, util: Optional[int], used: int, total: int) -> None:
        self.samples, self.used_max, self.total = self.samples + 1, max(self.used_max, used), total
        if util is not None:
            self.util_samples, self.util_sum = self.util_samples + 1, self.util_sum + util
            self.util_max = max(self.util_max or 0.0, float(util))

    @property
    def util_mean(self) -> Optional[float]:
        return self.util_sum / self.util_samples if self.util_samples else None


_overrides: list[Any] = []  #: the libraries :func:`using_nvml_library` installed, the innermost last


def nvml_library() -> Any:
    """What :func:`using_nvml_library` installed, else ``pynvml`` (``None`` when it is not installed)."""
    if _overrides:
        return _overrides[-1]
    with contextlib.suppress(ImportError):  # nvidia-ml-py is a dependency, but be forgiving in odd environments
        import pynvml

        return pynvml
    return None


@contextlib.contextmanager
def using_nvml_library(library: Any) -> Iterator[Any]:
    """Make :func:`nvml_library` return ``library`` inside the block (process-wide; blocks nest)."""
    _overrides.append(library)
    try:
        yield library
    finally:
        _overrides.pop()


@contextlib.contextmanager
def nvml_session() -> Iterator[tuple[Any, str]]:
    """``(library, "")`` initialised inside the block, or ``(None, why not)``; shut down once on leaving."""
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


def error_text(error: BaseException) -> str:
    """An error as one line naming its type: ``"NVMLError_NoPermission: Insufficient Permissions"``."""
    return f"{type(error).__name__}: {error}"


def same_device(uuid: Optional[str], other: Optional[str]) -> bool:
    """Whether two UUIDs name one device, as torch (bare hex) or NVML (``GPU-``/``MIG-``) spells them.

    >>> same_device("GPU-5d3c8f2e-7a41", "5D3C8F2E-7A41"), same_device("MIG-5d3c8f2e", "GPU-5d3c8f2e")
    (True, False)
    """
    first, second = ((u or "").strip().lower() for u in (uuid, other))
    prefixed = first[:4] in ("gpu-", "mig-"), second[:4] in ("gpu-", "mig-")
    return bool(first) and (first == second if all(prefixed) else first[4 * prefixed[0] :] == second[4 * prefixed[1] :])


def _unique_prefix_match(entry: str, uuids: Sequence[str]) -> Optional[int]:
    matches = [i for i, uuid in enumerate(uuids) if uuid and (uuid.startswith(entry) or uuid[4:].startswith(entry))]
    return matches[0] if len(matches) == 1 else None


def _visible_entries(gpu_uuids: Sequence[str], env: Optional[str], mig_parents: Mapping[str, str]) -> Optional[list]:
    """``(GPU index, MIG UUID or None)`` per ``CUDA_VISIBLE_DEVICES`` entry (``None``: unset)."""
    if env is None:
        return None
    entries: list[tuple[int, Optional[str]]] = []
    for entry in (part.strip() for part in env.split(",")):
        mig: Optional[str] = None
        if entry.isdigit():
            index: Optional[int] = int(entry) if int(entry) < len(gpu_uuids) else None
        elif entry.startswith("MIG-GPU-"):  # legacy MIG-GPU-<uuid>/<gi>/<ci>
            index = _unique_prefix_match(entry[4:].split("/")[0], gpu_uuids)
        elif entry.startswith("MIG-"):
            found = [m for m in mig_parents if m.startswith(entry)]
            mig = found[0] if len(found) == 1 else None
            index = None if mig is None else _unique_prefix_match(mig_parents[mig], gpu_uuids)
        else:
            index = _unique_prefix_match(entry, gpu_uuids) if entry else None
        if index is None:
            break  # CUDA stops at the first invalid entry
        entries.append((index, mig))
    return entries


def visible_gpu_indices(
    gpu_uuids: Sequence[str], env: Optional[str] = None, mig_parents: Optional[Mapping[str, str]] = None
) -> list[int]:
    """NVML indices of the GPUs ``env`` (default: ``CUDA_VISIBLE_DEVICES``) leaves visible, in ``cuda:i`` order:
    its entries are indices, GPU UUIDs or unique prefixes, MIG UUIDs (their GPU, ``mig_parents[mig]``) or legacy
    ``MIG-GPU-<uuid>/<gi>/<ci>``; like CUDA, the list stops at the first entry that names no device."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    entries = _visible_entries(gpu_uuids, env, mig_parents or {})
    return list(range(len(gpu_uuids))) if entries is None else [index for index, _ in entries]


@dataclass
class NvmlDevice:
    """A GPU or MIG instance as NVML shows it (``handle`` ``None`` and ``error`` set when NVML refused it)."""

    index: Optional[int]
    uuid: str
    name: str = ""
    handle: Any = None
    mig: bool = False
    visible: bool = True
    error: Optional[str] = None
    stats: _Stats = field(default_factory=_Stats, repr=False)
    window: _Stats = field(default_factory=_Stats, repr=False)

    def usage(self) -> GpuUsage:
        s = self.stats
        figures = (s.samples, s.util_mean, s.util_max, s.used_max, s.total)
        return GpuUsage(self.index, self.name, self.uuid, self.visible, *figures, self.mig, self.error)


def _gpu_uuid(lib: Any, mig_handle: Any) -> str:
    return str(lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_handle)))


def _open(lib: Any, gpus: Sequence[NvmlDevice], index: Optional[int] = None, uuid: str = "") -> NvmlDevice:
    """The GPU at NVML ``index``, or the GPU or MIG instance with ``uuid`` (``gpus`` give its GPU's index)."""
    device = NvmlDevice(index, uuid)
    try:
        if index is not None:
            device.handle = lib.nvmlDeviceGetHandleByIndex(index)
            device.uuid = str(lib.nvmlDeviceGetUUID(device.handle))
        else:
            uuid = uuid.strip()  # NVML's spellings: as given with a prefix, else with GPU- and MIG-
            *others, last = [uuid] if uuid.startswith(_PREFIXES) else [prefix + uuid for prefix in _PREFIXES]
            for candidate in others:  # the spelling NVML accepts
                with contextlib.suppress(lib.NVMLError_NotFound, lib.NVMLError_InvalidArgument):
                    device.handle, device.uuid = lib.nvmlDeviceGetHandleByUUID(candidate), candidate
                    break
            if device.handle is None:
                device.handle, device.uuid = lib.nvmlDeviceGetHandleByUUID(last), last
            device.mig = device.uuid.startswith("MIG-")
            gpu_uuid = _gpu_uuid(lib, device.handle) if device.mig else device.uuid
            device.index = next((gpu.index for gpu in gpus if gpu.uuid == gpu_uuid), None)
        device.name = str(lib.nvmlDeviceGetName(device.handle))
    except lib.NVMLError as error:
        device.error = error_text(error)
    return device


def nvml_devices(lib: Any, uuids: Optional[Sequence[str]] = None) -> tuple[list[NvmlDevice], list[int]]:
    """The GPUs NVML numbers, or the devices with ``uuids`` (MIG instances too), and :func:`visible_gpu_indices`;
    a device NVML refuses comes back with ``error`` set, only a failing ``nvmlDeviceGetCount`` raises."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [_open(lib, [], index=index) for index in range(int(lib.nvmlDeviceGetCount()))]
    devices = gpus if uuids is None else []
    for device in (_open(lib, gpus, uuid=uuid) for uuid in uuids or ()):
        if device.handle is None or all(device.uuid != other.uuid for other in devices):
            devices.append(device)
    parents = {}  # MIG UUID -> its GPU's, for each MIG-<uuid> entry of CUDA_VISIBLE_DEVICES NVML resolves
    for entry in (part.strip() for part in (env or "").split(",")):
        if entry.startswith("MIG-") and not entry.startswith("MIG-GPU-"):
            with contextlib.suppress(lib.NVMLError):
                parents[entry] = _gpu_uuid(lib, lib.nvmlDeviceGetHandleByUUID(entry))
    entries = _visible_entries([gpu.uuid for gpu in gpus], env, parents)
    if entries is None:
        return devices, list(range(len(gpus)))
    for device in devices:
        on_its_gpu = [mig for index, mig in entries if index == device.index]  # None: the GPU itself
        device.visible = (None in on_its_gpu or device.uuid in on_its_gpu) if device.mig else bool(on_its_gpu)
    return devices, [index for index, _ in entries]


def driver_versions() -> tuple[Optional[int], str]:
    """The CUDA version the driver supports (``12040``: 12.4) and its release (``"550.54.15"``); ``(None, "")``."""
    with nvml_session() as (lib, _):
        if lib is None:
            return None, ""
        return int(lib.nvmlSystemGetCudaDriverVersion()), str(lib.nvmlSystemGetDriverVersion())


def read_usage(lib: Any, handle: Any) -> tuple[Optional[int], int, int]:
    """``(utilisation % or None on MIG, memory used, memory total)`` of a device now; used from the v2 memory
    struct where the driver has it (v1's ``used`` counts the driver's reserved memory too)."""
    try:
        memory = lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2)
    except (lib.NVMLError, AttributeError, TypeError):  # a driver or nvidia-ml-py without it
        memory = lib.nvmlDeviceGetMemoryInfo(handle)
    util: Optional[int] = None
    with contextlib.suppress(lib.NVMLError):
        util = int(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
    return util, int(memory.used), int(memory.total)


def compute_processes(lib: Any, handle: Any) -> list[dict[str, Any]]:
    """The processes computing on the device (its MIG instances' included): ``pid``, ``name``, ``memory_bytes``."""
    processes = []
    for process in lib.nvmlDeviceGetComputeRunningProcesses(handle):
        name = "?"
        with contextlib.suppress(lib.NVMLError):
            name = os.path.basename(str(lib.nvmlSystemGetProcessName(process.pid)))
        used = getattr(process, "usedGpuMemory", None)
        processes.append({"pid": int(process.pid), "name": name, "memory_bytes": None if used is None else int(used)})
    return processes


class NvmlSampler:
    """Samples utilisation and memory of GPUs (or MIG instances) in a background thread.

    Args:
        interval_s: seconds between samples (NVML averages utilisation over 1/6 s to 1 s).
        uuids: the devices to sample, by UUID; ``None``: every GPU NVML numbers (MIG instances only by UUID).
    """

    def __init__(self, interval_s: float = 0.5, uuids: Optional[Sequence[str]] = None) -> None:
        self.interval_s, self.uuids = float(interval_s), None if uuids is None else list(uuids)
        self._lib: Any = None
        self._session = contextlib.ExitStack()
        self._devices: list[NvmlDevice] = []
        self._visible: list[int] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def visible_indices(self) -> list[int]:
        """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, in ``cuda:i`` order."""
        return list(self._visible)

    def start(self) -> bool:
        """Initialise NVML, find the devices and start sampling; ``False`` when no device answers."""
        if self._thread is not None:
            return True
        with contextlib.ExitStack() as session:
            lib, _ = session.enter_context(nvml_session())
            found: tuple[list[NvmlDevice], list[int]] = ([], [])
            if lib is not None:
                with contextlib.suppress(lib.NVMLError, OSError):
                    found = nvml_devices(lib, self.uuids)
            if all(device.handle is None for device in found[0]):  # no driver, no count, no device that answers
                return False
            self._lib, (self._devices, self._visible) = lib, found
            self._sample_once()
            self._session = session.pop_all()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpuopt-nvml-sampler", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        lib = self._lib
        for device in [d for d in self._devices if d.handle is not None] if lib is not None else []:
            try:
                reading = read_usage(lib, device.handle)
            except lib.NVMLError as error:
                device.error = error_text(error)
                continue
            with self._lock:
                device.stats.add(*reading)
                device.window.add(*reading)

    def take_window(self, key: Union[str, int]) -> tuple[Optional[float], Optional[float]]:
        """``(mean utilisation %, max memory used fraction)`` of one device (by UUID or NVML index) since the
        last call; ``(None, None)`` for a device not sampled or without a sample."""
        if isinstance(key, int):
            found = (d for d in self._devices if d.index == key and not d.mig)
        else:
            found = (d for d in self._devices if same_device(d.uuid, key))
        device = next(found, None) if self._lib is not None else None
        if device is None:
            return None, None
        with self._lock:
            window, device.window = device.window, _Stats()
        return window.util_mean, window.used_max / window.total if window.total else None

    def usage(self) -> list[GpuUsage]:
        """Each sampled device's figures over everything sampled so far, in order."""
        with self._lock:
            return [device.usage() for device in self._devices]

    def stop(self) -> list[GpuUsage]:
        """Stop the thread, take a last sample, shut NVML down and return :meth:`usage`; safe to repeat."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None
            self._sample_once()
            self._lib = None
            self._session.close()
        return self.usage()
