"""lightning-gpuopt: Lightning callbacks that measure why a GPU waits and keep it busy and its memory full."""

__version__ = "0.1.0"

__all__ = ["__version__"]
