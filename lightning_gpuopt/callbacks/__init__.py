"""Lightning callbacks: thin adapters over :mod:`lightning_gpuopt.core`, one callback a file."""

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch as BatchSizeSearch
from lightning_gpuopt.callbacks.batch_size_search import NoBatchSizeFitsError as NoBatchSizeFitsError
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor as DataWaitMonitor
from lightning_gpuopt.callbacks.dataloader_tuner import DataLoaderTuner as DataLoaderTuner
from lightning_gpuopt.callbacks.gpuopt import GpuOpt as GpuOpt
from lightning_gpuopt.callbacks.gpuopt import GpuOptReport as GpuOptReport
from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator as MemoryEstimator
from lightning_gpuopt.callbacks.memory_fill import MemoryFill as MemoryFill

__all__ = sorted(name for name in globals() if name[0].isupper())  # the classes above
