"""Lightning callbacks: thin adapters over :mod:`lightning_gpuopt.core`, one callback a file."""

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch, NoBatchSizeFitsError
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_gpuopt.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_gpuopt.callbacks.gpuopt import GpuOpt, GpuOptReport
from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator
from lightning_gpuopt.callbacks.memory_fill import MemoryFill

__all__ = [
    "BatchSizeSearch",
    "DataLoaderTuner",
    "DataWaitMonitor",
    "GpuOpt",
    "GpuOptReport",
    "MemoryEstimator",
    "MemoryFill",
    "NoBatchSizeFitsError",
]
