"""lightning-gpuopt for code that imports ``pytorch_lightning`` rather than ``lightning.pytorch``.

The same callbacks, built on the ``pytorch_lightning`` package's classes (see
:mod:`lightning_gpuopt._mirror`). Use these with ``pytorch_lightning.Trainer``; the callbacks from
``lightning_gpuopt`` itself are for ``lightning.pytorch.Trainer`` (``from lightning import Trainer``),
and each refuses the other namespace's Trainer with a message naming the import to use.

Example:
    >>> import pytorch_lightning as pl
    >>> from lightning_gpuopt.pytorch_lightning import GpuOpt
    >>> isinstance(GpuOpt("diagnose"), pl.Callback)
    True
"""

from lightning_gpuopt import _mirror

_mirror.install()

from lightning_gpuopt.core.diagnosis import DataWaitReport  # noqa: E402
from lightning_gpuopt.core.estimate import MemoryEstimate  # noqa: E402
from lightning_gpuopt.core.fill import MemoryFillPlan  # noqa: E402
from lightning_gpuopt.core.loader import LoaderTuneResult  # noqa: E402
from lightning_gpuopt.core.memory import MemoryBudget, parse_memory  # noqa: E402
from lightning_gpuopt.core.search import BatchSizeSearchResult  # noqa: E402
from lightning_gpuopt.presets import available_presets, load_preset  # noqa: E402
from lightning_gpuopt.pytorch_lightning.callbacks import (  # noqa: E402
    BatchSizeSearch,
    DataLoaderTuner,
    DataWaitMonitor,
    GpuOpt,
    GpuOptReport,
    MemoryEstimator,
    MemoryFill,
    NoBatchSizeFitsError,
)
from lightning_gpuopt.pytorch_lightning.cli import GpuOptCLI  # noqa: E402

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
]
