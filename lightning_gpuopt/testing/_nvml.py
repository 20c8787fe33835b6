"""A fake NVML library: :class:`FakeNvml` answers the ``pynvml`` calls lightning-gpuopt makes.

Install one with :func:`lightning_gpuopt.core.nvml.using_nvml_library` and every NVML call of
the package (the sampler, ``gpuopt doctor``) goes to it instead of the driver. It follows real
NVML where the package depends on it:

* calls before ``nvmlInit`` (or after the last ``nvmlShutdown``) raise ``NVMLError_Uninitialized``;
  init and shutdown are reference counted (:attr:`FakeNvml.initialised` is the depth);
* MIG instances (``mig=True``, UUID ``"MIG-..."``) are not counted by ``nvmlDeviceGetCount`` nor
  returned by ``nvmlDeviceGetHandleByIndex``; ``nvmlDeviceGetHandleByUUID`` finds GPUs and MIG
  instances by their full UUID (with the prefix);
* errors are the real ``pynvml`` exception classes (``pynvml.NVMLError_NotSupported``, ...), so
  ``except pynvml.NVMLError`` catches them;
* a device with ``error="no-permission"`` raises ``NVMLError_NoPermission`` from every query that
  takes its handle, and from ``nvmlDeviceGetHandleByIndex`` (as NVML documents); with
  ``error="not-supported"`` every query on its handle raises ``NVMLError_NotSupported``;
* ``utilization=None`` makes ``nvmlDeviceGetUtilizationRates`` raise ``NVMLError_NotSupported``
  (a MIG instance, or a GPU in MIG mode), while ``nvmlDeviceGetMemoryInfo`` still answers.

Example::

    >>> import pynvml
    >>> gpu = FakeNvmlDevice("NVIDIA A100-SXM4-40GB", "GPU-4b1c", memory_total=40 << 30,
    ...                      memory_used=lambda: 4 << 30, utilization=lambda: 87)
    >>> mig = FakeNvmlDevice("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG-9e3f", memory_total=5 << 30,
    ...                      utilization=None, mig=True, parent="GPU-4b1c")
    >>> nvml = FakeNvml([gpu, mig])
    >>> nvml.nvmlInit()
    >>> nvml.nvmlDeviceGetCount()                        # MIG instances are not counted
    1
    >>> handle = nvml.nvmlDeviceGetHandleByIndex(0)
    >>> nvml.nvmlDeviceGetUtilizationRates(handle).gpu, nvml.nvmlDeviceGetMemoryInfo(handle).used
    (87, 4294967296)
    >>> try:
    ...     nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByUUID("MIG-9e3f"))
    ... except pynvml.NVMLError as error:
    ...     print(type(error).__name__)
    NVMLError_NotSupported
    >>> nvml.nvmlShutdown()
    >>> nvml.init_calls, nvml.shutdown_calls, nvml.initialised
    (1, 1, 0)
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import pynvml

#: ``FakeNvmlDevice.error`` values and the NVML return codes they raise
DEVICE_ERRORS = {
    "no-permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "not-supported": pynvml.NVML_ERROR_NOT_SUPPORTED,
}

Reading = Union[int, Callable[[], int]]


@dataclass
class FakeNvmlDevice:
    """One GPU or MIG instance as :class:`FakeNvml` shows it.

    Args:
        name: what ``nvmlDeviceGetName`` returns.
        uuid: ``"GPU-..."`` for a GPU, ``"MIG-..."`` for a MIG instance.
        memory_total: bytes.
        memory_used: bytes in use, read at every ``nvmlDeviceGetMemoryInfo`` (a callable, or a fixed int).
        utilization: % of time a kernel ran, read at every ``nvmlDeviceGetUtilizationRates`` (a
            callable, or a fixed int); ``None``: NVML answers ``NotSupported`` (a MIG instance).
        error: ``None``, ``"no-permission"`` or ``"not-supported"``: every query on this device raises it.
        mig: a MIG instance (not counted by ``nvmlDeviceGetCount``).
        processes: ``(pid, used_bytes)`` of the processes computing on it.
        parent: the UUID of the GPU a MIG instance lives on (``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``).

    Example::

        >>> FakeNvmlDevice("NVIDIA T4", "GPU-1", memory_total=16 << 30, memory_used=2 << 30).mig
        False
    """

    name: str
    uuid: str
    memory_total: int
    memory_used: Reading = 0
    utilization: Optional[Reading] = 0
    error: Optional[str] = None
    mig: bool = False
    processes: list[tuple[int, int]] = field(default_factory=list)
    parent: Optional[str] = None

    def __post_init__(self) -> None:
        prefix = "MIG-" if self.mig else "GPU-"
        if not self.uuid.startswith(prefix):
            raise ValueError(f"uuid={self.uuid!r}: a {'MIG instance' if self.mig else 'GPU'} has a {prefix!r} UUID")
        if self.error is not None and self.error not in DEVICE_ERRORS:
            raise ValueError(f"error={self.error!r}: use None or one of {sorted(DEVICE_ERRORS)}")
        if self.parent is not None and not self.mig:
            raise ValueError("parent= is for a MIG instance (mig=True)")


@dataclass(frozen=True)
class FakeNvmlHandle:
    """The handle :class:`FakeNvml` hands out for a device (opaque to callers, like ``c_nvmlDevice_t``)."""

    uuid: str


def _read(value: Reading) -> int:
    return int(value() if callable(value) else value)


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # the matching subclass, e.g. NVMLError_NotFound


class FakeNvml:
    """A stand-in for the ``pynvml`` module over a list of :class:`FakeNvmlDevice`.

    Has the attribute names of ``pynvml`` for what the package uses: ``nvmlInit``, ``nvmlShutdown``,
    ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetHandleByUUID``,
    ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``, ``nvmlDeviceGetUtilizationRates``,
    ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetComputeRunningProcesses``,
    ``nvmlDeviceIsMigDeviceHandle``, ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``,
    ``nvmlSystemGetDriverVersion``, ``nvmlSystemGetCudaDriverVersion``, ``nvmlSystemGetProcessName``,
    ``NVMLError`` with every ``NVMLError_*`` class and the ``NVML_ERROR_*`` codes (``pynvml``'s own).

    Args:
        devices: GPUs and MIG instances; GPUs are numbered in list order.
        driver_version: ``nvmlSystemGetDriverVersion``.
        cuda_driver_version: ``nvmlSystemGetCudaDriverVersion`` (12040 is CUDA 12.4).
        process_names: pid -> ``nvmlSystemGetProcessName`` (a pid not listed raises ``NotFound``).
        failures: function name -> exception that call raises (e.g.
            ``{"nvmlDeviceGetCount": pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)}``); change it any time.

    Attributes:
        init_calls, shutdown_calls: calls so far (failed ones included).
        initialised: the init depth: successful inits minus successful shutdowns.
        calls: a ``collections.Counter`` of every call by function name.

    Example::

        >>> nvml = FakeNvml([FakeNvmlDevice("NVIDIA T4", "GPU-1", memory_total=16 << 30)])
        >>> nvml.nvmlDeviceGetCount()
        Traceback (most recent call last):
        ...
        pynvml.NVMLError_Uninitialized: Uninitialized
    """

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        devices: list[FakeNvmlDevice],
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        process_names: Optional[dict[int, str]] = None,
        failures: Optional[dict[str, BaseException]] = None,
    ) -> None:
        uuids = [device.uuid for device in devices]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"devices have duplicate UUIDs: {uuids}")
        for device in devices:
            if device.parent is not None and device.parent not in uuids:
                raise ValueError(f"MIG instance {device.uuid} names parent {device.parent}, which is not a device")
        self.devices = list(devices)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.process_names = dict(process_names or {})
        self.failures: dict[str, BaseException] = dict(failures or {})
        self.init_calls = 0
        self.shutdown_calls = 0
        self.initialised = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    # -- bookkeeping ------------------------------------------------------------------------
    def _enter(self, function: str, needs_init: bool = True) -> None:
        with self._lock:
            self.calls[function] += 1
            failure = self.failures.get(function)
            initialised = self.initialised
        if failure is not None:
            raise failure
        if needs_init and not initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpus(self) -> list[FakeNvmlDevice]:
        return [device for device in self.devices if not device.mig]

    def _device(self, handle: Any) -> FakeNvmlDevice:
        """The device behind ``handle``; raises its configured error."""
        uuid = handle.uuid if isinstance(handle, FakeNvmlHandle) else None
        device = next((device for device in self.devices if device.uuid == uuid), None)
        if device is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if device.error is not None:
            raise _error(DEVICE_ERRORS[device.error])
        return device

    # -- init -------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        with self._lock:
            self.init_calls += 1
        self._enter("nvmlInit", needs_init=False)
        with self._lock:
            self.initialised += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self.shutdown_calls += 1
        self._enter("nvmlShutdown")
        with self._lock:
            self.initialised -= 1

    # -- system -----------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._enter("nvmlSystemGetProcessName")
        if int(pid) not in self.process_names:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self.process_names[int(pid)]

    # -- handles ----------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        gpus = self._gpus()
        if not 0 <= int(index) < len(gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpus[index].error == "no-permission":
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        return FakeNvmlHandle(gpus[index].uuid)

    def nvmlDeviceGetHandleByUUID(self, uuid: Union[str, bytes]) -> FakeNvmlHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        if not text.startswith(("GPU-", "MIG-")):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not any(device.uuid == text for device in self.devices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeNvmlHandle(text)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int:
        self._enter("nvmlDeviceIsMigDeviceHandle")
        return int(self._device(handle).mig)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> FakeNvmlHandle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        device = self._device(handle)
        if not device.mig or device.parent is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT if not device.mig else pynvml.NVML_ERROR_NOT_FOUND)
        return FakeNvmlHandle(device.parent)

    # -- per-device queries ------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID")
        return self._device(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName")
        return self._device(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        """``.total``, ``.used`` and ``.free`` in bytes, like ``c_nvmlMemory_t``."""
        self._enter("nvmlDeviceGetMemoryInfo")
        device = self._device(handle)
        used = _read(device.memory_used)
        return SimpleNamespace(total=device.memory_total, used=used, free=device.memory_total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        """``.gpu`` (the device's utilisation) and ``.memory`` (always 0 here), like ``c_nvmlUtilization_t``."""
        self._enter("nvmlDeviceGetUtilizationRates")
        device = self._device(handle)
        if device.utilization is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=_read(device.utilization), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        """The device's processes (a GPU's include those of its MIG instances), with ``pid`` and ``usedGpuMemory``."""
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        device = self._device(handle)
        children = [child for child in self.devices if child.mig and child.parent == device.uuid]
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0, computeInstanceId=0)
            for owner in [device, *children]
            for pid, used in owner.processes
        ]


for _name in dir(pynvml):  # the error classes and codes, pynvml's own objects
    if _name.startswith(("NVMLError_", "NVML_ERROR_")):
        setattr(FakeNvml, _name, getattr(pynvml, _name))
del _name
