"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full."""

from lightning_gpuopt.callbacks import DataLoaderTuner, DataWaitMonitor
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.loader import LoaderTuneResult

__version__ = "0.1.0"

__all__ = ["DataLoaderTuner", "DataWaitMonitor", "DataWaitReport", "LoaderTuneResult", "__version__"]
