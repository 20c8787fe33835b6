"""Lightning callbacks: thin adapters over :mod:`lightning_gpuopt.core`, one callback a file."""

from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor

__all__ = ["DataWaitMonitor"]
