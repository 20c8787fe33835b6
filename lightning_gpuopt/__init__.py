"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full."""

from lightning_gpuopt.callbacks import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, MemoryEstimator
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.loader import LoaderTuneResult
from lightning_gpuopt.core.memory import MemoryBudget, parse_memory
from lightning_gpuopt.core.search import BatchSizeSearchResult

__version__ = "0.1.0"

__all__ = [
    "BatchSizeSearch",
    "BatchSizeSearchResult",
    "DataLoaderTuner",
    "DataWaitMonitor",
    "DataWaitReport",
    "LoaderTuneResult",
    "MemoryBudget",
    "MemoryEstimate",
    "MemoryEstimator",
    "parse_memory",
    "__version__",
]
