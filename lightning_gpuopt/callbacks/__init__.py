"""Lightning callbacks: thin adapters over :mod:`lightning_gpuopt.core`, one callback a file."""

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_gpuopt.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator

__all__ = ["BatchSizeSearch", "DataLoaderTuner", "DataWaitMonitor", "MemoryEstimator"]
