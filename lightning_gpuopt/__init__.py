"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full."""

from lightning_gpuopt.callbacks import DataWaitMonitor
from lightning_gpuopt.core.diagnosis import DataWaitReport

__version__ = "0.1.0"

__all__ = ["DataWaitMonitor", "DataWaitReport", "__version__"]
