"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full.

The public names are imported on first use (PEP 562 ``__getattr__``), so that the ``gpuopt`` command,
``presets`` and ``core`` do not import Lightning.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

#: public name -> the module it is defined in
_PUBLIC = {
    name: f"lightning_gpuopt.{module}"
    for module, names in [
        ("callbacks", "BatchSizeSearch DataLoaderTuner DataWaitMonitor GpuOpt GpuOptReport MemoryEstimator MemoryFill"),
        ("callbacks", "NoBatchSizeFitsError"),
        ("cli.lightning_cli", "GpuOptCLI"),
        ("core.diagnosis", "DataWaitReport"),
        ("core.estimate", "MemoryEstimate"),
        ("core.fill", "MemoryFillPlan"),
        ("core.loader", "LoaderTuneResult"),
        ("core.memory", "MemoryBudget parse_memory"),
        ("core.plot", "save_plots"),
        ("core.search", "BatchSizeSearchResult"),
        ("presets", "available_presets load_preset"),
    ]
    for name in names.split()
}
#: subpackages that ``import lightning_gpuopt`` used to import, reachable as attributes (imported on first use)
_SUBMODULES = ("callbacks", "cli", "core", "presets")

__all__ = sorted(["__version__", *_PUBLIC])  # what `import *` gives; the typed imports below re-export each


def __getattr__(name: str) -> _Any:
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    names = {name for name in globals() if not name.startswith("_") or name.startswith("__")}
    return sorted((names - {"__getattr__", "__dir__"}) | set(_PUBLIC) | set(_SUBMODULES))


if _TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from lightning_gpuopt.callbacks import BatchSizeSearch as BatchSizeSearch
    from lightning_gpuopt.callbacks import DataLoaderTuner as DataLoaderTuner
    from lightning_gpuopt.callbacks import DataWaitMonitor as DataWaitMonitor
    from lightning_gpuopt.callbacks import GpuOpt as GpuOpt
    from lightning_gpuopt.callbacks import GpuOptReport as GpuOptReport
    from lightning_gpuopt.callbacks import MemoryEstimator as MemoryEstimator
    from lightning_gpuopt.callbacks import MemoryFill as MemoryFill
    from lightning_gpuopt.callbacks import NoBatchSizeFitsError as NoBatchSizeFitsError
    from lightning_gpuopt.cli.lightning_cli import GpuOptCLI as GpuOptCLI
    from lightning_gpuopt.core.diagnosis import DataWaitReport as DataWaitReport
    from lightning_gpuopt.core.estimate import MemoryEstimate as MemoryEstimate
    from lightning_gpuopt.core.fill import MemoryFillPlan as MemoryFillPlan
    from lightning_gpuopt.core.loader import LoaderTuneResult as LoaderTuneResult
    from lightning_gpuopt.core.memory import MemoryBudget as MemoryBudget
    from lightning_gpuopt.core.memory import parse_memory as parse_memory
    from lightning_gpuopt.core.plot import save_plots as save_plots
    from lightning_gpuopt.core.search import BatchSizeSearchResult as BatchSizeSearchResult
    from lightning_gpuopt.presets import available_presets as available_presets
    from lightning_gpuopt.presets import load_preset as load_preset
