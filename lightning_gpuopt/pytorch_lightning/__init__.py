"""lightning-gpuopt for code that imports ``pytorch_lightning`` rather than ``lightning.pytorch``.

The classes here add ``pytorch_lightning``'s ``Callback`` (and ``LightningCLI``) as a base over the
same source, so a ``pytorch_lightning.Trainer`` takes them; results and ``core`` are shared.

    >>> from typing import TypeVar, cast

import pytorch_lightning as pl
    >>> from lightning_gpuopt.pytorch_lightning import GpuOpt
    >>> isinstance(GpuOpt("diagnose"), pl.Callback)
    True
"""

from typing import TypeVar, cast

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

_C = TypeVar("_C")


def _for_pl(cls: type[_C]) -> type[_C]:
    """``cls`` with ``pytorch_lightning``'s ``Callback`` as a base too (its hooks are typed with ``lightning.pytorch``)."""
    return cast(type[_C], type(cls.__name__, (cls, pl.Callback), {"__doc__": cls.__doc__, "__module__": __name__}))


BatchSizeSearch = _for_pl(_callbacks.BatchSizeSearch)
DataLoaderTuner = _for_pl(_callbacks.DataLoaderTuner)
DataWaitMonitor = _for_pl(_callbacks.DataWaitMonitor)
GpuOpt = _for_pl(_callbacks.GpuOpt)
MemoryEstimator = _for_pl(_callbacks.MemoryEstimator)
MemoryFill = _for_pl(_callbacks.MemoryFill)


class GpuOptArgumentParser(_cli.ResolvedDumps, LightningArgumentParser):
    """``pytorch_lightning``'s parser with :class:`~lightning_gpuopt.cli.lightning_cli.ResolvedDumps`."""


class GpuOptCLI(_cli.WithGpuOpt, LightningCLI):
    __doc__ = _cli.GpuOptCLI.__doc__
    gpuopt_class = GpuOpt
    default_parser_class = GpuOptArgumentParser


#: the public names of :mod:`lightning_gpuopt`, less ``__version__`` and ``save_plots``
__all__ = [name for name in _lightning_gpuopt.__all__ if name not in ("__version__", "save_plots")]
