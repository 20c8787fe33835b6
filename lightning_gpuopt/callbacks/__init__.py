"""Lightning callbacks: thin adapters over :mod:`lightning_gpuopt.core`, one callback a file."""
