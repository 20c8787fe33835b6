"""lightning-gpuopt for code that imports ``pytorch_lightning`` rather than ``lightning.pytorch``.

The classes here add ``pytorch_lightning``'s ``Callback`` (and ``LightningCLI``) as a base over the
same source, so a ``pytorch_lightning.Trainer`` takes them; results and ``core`` are shared.

    >>> import pytorch_lightning as pl
    >>> from lightning_gpuopt.pytorch_lightning import GpuOpt
    >>> isinstance(GpuOpt("diagnose"), pl.Callback)
    True
"""

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

import lightning_gpuopt as _lightning_gpuopt
from lightning_gpuopt import callbacks as _callbacks
from lightning_gpuopt.callbacks import GpuOptReport as GpuOptReport
from lightning_gpuopt.callbacks import NoBatchSizeFitsError as NoBatchSizeFitsError
from lightning_gpuopt.cli import lightning_cli as _cli
from lightning_gpuopt.core.diagnosis import DataWaitReport as DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate as MemoryEstimate
from lightning_gpuopt.core.fill import MemoryFillPlan as MemoryFillPlan
from lightning_gpuopt.core.loader import LoaderTuneResult as LoaderTuneResult
from lightning_gpuopt.core.memory import MemoryBudget as MemoryBudget
from lightning_gpuopt.core.memory import parse_memory as parse_memory
from lightning_gpuopt.core.search import BatchSizeSearchResult as BatchSizeSearchResult
from lightning_gpuopt.presets import available_presets as available_presets
from lightning_gpuopt.presets import load_preset as load_preset


class BatchSizeSearch(_callbacks.BatchSizeSearch, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.BatchSizeSearch.__doc__


class DataLoaderTuner(_callbacks.DataLoaderTuner, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.DataLoaderTuner.__doc__


class DataWaitMonitor(_callbacks.DataWaitMonitor, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.DataWaitMonitor.__doc__


class GpuOpt(_callbacks.GpuOpt, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.GpuOpt.__doc__


class MemoryEstimator(_callbacks.MemoryEstimator, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.MemoryEstimator.__doc__


class MemoryFill(_callbacks.MemoryFill, pl.Callback):  # type: ignore[misc]  # hooks typed with lightning.pytorch classes
    __doc__ = _callbacks.MemoryFill.__doc__


class GpuOptArgumentParser(_cli.ResolvedDumps, LightningArgumentParser):
    """``pytorch_lightning``'s parser with :class:`~lightning_gpuopt.cli.lightning_cli.ResolvedDumps`."""


class GpuOptCLI(_cli.WithGpuOpt, LightningCLI):
    __doc__ = _cli.GpuOptCLI.__doc__
    gpuopt_class = GpuOpt
    default_parser_class = GpuOptArgumentParser


#: the public names of :mod:`lightning_gpuopt`, less ``__version__`` and ``save_plots``
__all__ = [name for name in _lightning_gpuopt.__all__ if name not in ("__version__", "save_plots")]
