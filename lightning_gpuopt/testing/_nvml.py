"""A fake NVML (install it with :func:`lightning_gpuopt.core.nvml.using_nvml_library`): :class:`FakeNvml` answers
lightning-gpuopt's ``pynvml`` calls as NVML does (uninitialised calls, MIG instances, ``pynvml``'s errors)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import pynvml

_DEVICE_ERRORS = {"no-permission": pynvml.NVML_ERROR_NO_PERMISSION, "not-supported": pynvml.NVML_ERROR_NOT_SUPPORTED}

_Reading = Union[int, Callable[[], int]]


@dataclass(eq=False)
class FakeNvmlDevice:
    """One GPU (``uuid`` ``"GPU-..."``) or MIG instance (``mig=True``, ``"MIG-..."``, on the GPU ``parent``);
    ``memory_used`` and ``utilization`` (%, ``None``: ``NotSupported``) are an int or a callable read at every
    query; ``memory_reserved``: the driver's (the v1 memory struct counts it as used, v2 apart); ``error`` (``"no-permission"``, ``"not-supported"``) makes every query on the device raise it."""

    name: str
    uuid: str
    memory_total: int
    memory_used: _Reading = 0
    utilization: Optional[_Reading] = 0
    error: Optional[str] = None
    mig: bool = False
    processes: list[tuple[int, int]] = field(default_factory=list)
    parent: Optional[str] = None
    memory_reserved: int = 0


def _read(value: _Reading) -> int:
    return int(value() if callable(value) else value)


class FakeNvml:
    """A stand-in for the ``pynvml`` module over ``devices`` (GPUs numbered in list order); ``process_names``:
    pid -> ``nvmlSystemGetProcessName``; ``failures``: call name -> the exception it raises (change it any
    time); ``calls``: a ``Counter`` of calls by name; ``initialised``: inits minus shutdowns."""

    NVMLError, NVMLError_NotFound = pynvml.NVMLError, pynvml.NVMLError_NotFound  # what lightning-gpuopt catches
    NVMLError_InvalidArgument, nvmlMemory_v2 = pynvml.NVMLError_InvalidArgument, pynvml.nvmlMemory_v2

    def __init__(
        self,
        devices: list[FakeNvmlDevice],
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        process_names: Optional[dict[int, str]] = None,
        failures: Optional[dict[str, BaseException]] = None,
    ) -> None:
        self.devices, self.process_names = list(devices), dict(process_names or {})
        self.driver_version, self.cuda_driver_version = driver_version, cuda_driver_version
        self.failures, self.initialised = dict(failures or {}), 0
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _enter(self, call: str, handle: Any = None, init: int = 0) -> Any:
        """Count ``call``, raise its failure or ``Uninitialized``, add ``init``; the device behind ``handle``."""
        with self._lock:
            self.calls[call] += 1
            if (failure := self.failures.get(call)) is not None:
                raise failure
            if not self.initialised and call != "nvmlInit":
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
            self.initialised += init
        if handle is not None and handle.error is not None:
            raise pynvml.NVMLError(_DEVICE_ERRORS[handle.error])
        return handle

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", init=1)

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown", init=-1)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._enter("nvmlSystemGetProcessName")
        if int(pid) not in self.process_names:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.process_names[int(pid)]

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return sum(not device.mig for device in self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeNvmlDevice:
        self._enter("nvmlDeviceGetHandleByIndex")
        gpus = [device for device in self.devices if not device.mig]
        if not 0 <= int(index) < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpus[index].error == "no-permission":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeNvmlDevice:
        self._enter("nvmlDeviceGetHandleByUUID")
        return self._by_uuid(uuid)

    def _by_uuid(self, uuid: str) -> FakeNvmlDevice:
        found = next((device for device in self.devices if device.uuid == uuid), None)
        if found is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return found

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> FakeNvmlDevice:
        device = self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if not device.mig:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._by_uuid(device.parent or "")

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._enter("nvmlDeviceGetUUID", handle).uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._enter("nvmlDeviceGetName", handle).name)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Optional[int] = None) -> SimpleNamespace:
        device = self._enter("nvmlDeviceGetMemoryInfo", handle)
        reserved, used, total = device.memory_reserved, _read(device.memory_used), device.memory_total
        v1 = version != pynvml.nvmlMemory_v2  # v1's used counts the driver's reserved memory
        return SimpleNamespace(total=total, reserved=reserved, used=used + reserved * v1, free=total - used - reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        device = self._enter("nvmlDeviceGetUtilizationRates", handle)
        if device.utilization is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=_read(device.utilization), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        """The processes on the device and, for a GPU, on its MIG instances."""
        device = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        owners = [device, *(child for child in self.devices if child.mig and child.parent == device.uuid)]
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for owner in owners for pid, used in owner.processes]
