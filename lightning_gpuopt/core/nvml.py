"""Background sampler of GPU utilisation and memory through NVML (``nvidia-ml-py``).

:class:`NvmlSampler` starts a daemon thread that reads, for every GPU the driver shows,
the utilisation (% of time a kernel ran during the driver's sample period, as
``nvidia-smi`` shows it) and the memory used, at a fixed interval. Without an NVIDIA
driver it is silently absent: :meth:`NvmlSampler.start` returns ``False`` and every figure
is ``None``.

GPUs are numbered as NVML numbers them (physical order). :func:`visible_gpu_indices`
maps ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) to those numbers, so torch's ``cuda:i``
is NVML GPU ``visible_gpu_indices()[i]``.

Example::

    >>> sampler = NvmlSampler(interval_s=0.5)
    >>> started = sampler.start()   # False on a machine without an NVIDIA driver
    >>> usage = sampler.stop()      # one GpuUsage per GPU ([] without a driver)
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from lightning_gpuopt.core.checks import check_number


@dataclass
class GpuUsage:
    """Utilisation and memory of one GPU over the sampled period."""

    index: int
    name: str
    uuid: str
    visible: bool
    samples: int
    util_mean: Optional[float]
    util_max: Optional[float]
    memory_used_max_bytes: int
    memory_total_bytes: int


@dataclass
class _Stats:
    samples: int = 0
    util_sum: float = 0.0
    util_max: float = 0.0
    memory_used_max: int = 0
    memory_total: int = 0

    def add(self, util: float, used: int, total: int) -> None:
        self.samples += 1
        self.util_sum += util
        self.util_max = max(self.util_max, util)
        self.memory_used_max = max(self.memory_used_max, used)
        self.memory_total = total


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is a dependency, but be forgiving in odd environments
        return None
    return pynvml


def visible_gpu_indices(device_uuids: list[str], env: Optional[str] = None) -> list[int]:
    """NVML indices of the GPUs this process may use, in torch's ``cuda:i`` order.

    Args:
        device_uuids: UUIDs of all GPUs in NVML order (``"GPU-..."``).
        env: the value of ``CUDA_VISIBLE_DEVICES`` (read from the environment when omitted).
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return list(range(len(device_uuids)))
    indices = []
    for entry in (part.strip() for part in env.split(",")):
        if not entry:
            break
        if entry.isdigit():
            index = int(entry)
            if index >= len(device_uuids):
                break  # CUDA stops at the first invalid entry
            indices.append(index)
            continue
        matches = [i for i, uuid in enumerate(device_uuids) if uuid.startswith(entry) or uuid[4:].startswith(entry)]
        if len(matches) != 1:
            break
        indices.append(matches[0])
    return indices


class NvmlSampler:
    """Samples utilisation and memory of every GPU in a background thread.

    Args:
        interval_s: seconds between samples (NVML's own utilisation counter is averaged
            over 1/6 s to 1 s depending on the GPU, so faster adds no information).
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = check_number("interval_s", interval_s, "interval_s=0.5", low=0, low_inclusive=False)
        self._pynvml = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._uuids: list[str] = []
        self._visible: list[int] = []
        self._stats: list[_Stats] = []
        self._window: list[_Stats] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._final: list[GpuUsage] = []

    @property
    def available(self) -> bool:
        return self._pynvml is not None and bool(self._handles)

    @property
    def visible_indices(self) -> list[int]:
        return list(self._visible)

    def start(self) -> bool:
        """Initialise NVML and start sampling; ``False`` (and no thread) without a driver."""
        if self._thread is not None:
            return True
        pynvml = _import_pynvml()
        if pynvml is None:
            return False
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except (pynvml.NVMLError, OSError):
            return False
        if not self._handles:
            pynvml.nvmlShutdown()
            return False
        self._pynvml = pynvml
        self._visible = visible_gpu_indices(self._uuids)
        self._stats = [_Stats() for _ in self._handles]
        self._window = [_Stats() for _ in self._handles]
        self._stop.clear()
        self._sample_once()
        self._thread = threading.Thread(target=self._run, name="gpuopt-nvml-sampler", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        pynvml = self._pynvml
        readings = []
        for handle in self._handles:
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError:
                readings.append(None)
                continue
            readings.append((float(util), int(memory.used), int(memory.total)))
        with self._lock:
            for i, reading in enumerate(readings):
                if reading is not None:
                    self._stats[i].add(*reading)
                    self._window[i].add(*reading)

    def take_window(self, index: int) -> tuple[Optional[float], Optional[float]]:
        """(mean utilisation %, max memory used fraction) of NVML GPU ``index`` since the last call."""
        if not self.available or not 0 <= index < len(self._handles):
            return None, None
        with self._lock:
            window, self._window[index] = self._window[index], _Stats()
        if not window.samples:
            return None, None
        memory = window.memory_used_max / window.memory_total if window.memory_total else None
        return window.util_sum / window.samples, memory

    def usage(self) -> list[GpuUsage]:
        """Per-GPU figures over everything sampled so far."""
        with self._lock:
            return [
                GpuUsage(
                    index=i,
                    name=self._names[i],
                    uuid=self._uuids[i],
                    visible=i in self._visible,
                    samples=stats.samples,
                    util_mean=stats.util_sum / stats.samples if stats.samples else None,
                    util_max=stats.util_max if stats.samples else None,
                    memory_used_max_bytes=stats.memory_used_max,
                    memory_total_bytes=stats.memory_total,
                )
                for i, stats in enumerate(self._stats)
            ]

    def stop(self) -> list[GpuUsage]:
        """Stop the thread, shut NVML down, and return :meth:`usage`. Safe to call twice."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None
            self._sample_once()
            usage = self.usage()
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass
            self._final = usage
        return self._final


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
