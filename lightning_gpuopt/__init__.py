"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full."""

from lightning_gpuopt.callbacks import (
    BatchSizeSearch,
    DataLoaderTuner,
    DataWaitMonitor,
    GpuOpt,
    GpuOptReport,
    MemoryEstimator,
    MemoryFill,
    NoBatchSizeFitsError,
)
from lightning_gpuopt.cli import GpuOptCLI
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.fill import MemoryFillPlan
from lightning_gpuopt.core.loader import LoaderTuneResult
from lightning_gpuopt.core.memory import MemoryBudget, parse_memory
from lightning_gpuopt.core.plot import save_plots
from lightning_gpuopt.core.search import BatchSizeSearchResult
from lightning_gpuopt.presets import available_presets, load_preset

__version__ = "0.1.0"

__all__ = [
    "BatchSizeSearch",
    "BatchSizeSearchResult",
    "DataLoaderTuner",
    "DataWaitMonitor",
    "DataWaitReport",
    "GpuOpt",
    "GpuOptCLI",
    "GpuOptReport",
    "LoaderTuneResult",
    "MemoryBudget",
    "MemoryEstimate",
    "MemoryEstimator",
    "MemoryFill",
    "MemoryFillPlan",
    "NoBatchSizeFitsError",
    "available_presets",
    "load_preset",
    "parse_memory",
    "save_plots",
    "__version__",
]
