"""Command lines: ``main``, the ``gpuopt`` console command, and :class:`GpuOptCLI`, ``LightningCLI`` with ``--gpuopt``.

``main`` (:mod:`~lightning_gpuopt.cli.command`) imports only the standard library until a subcommand
runs; ``GpuOptCLI`` (:mod:`~lightning_gpuopt.cli.lightning_cli`) imports Lightning on first use.

Example:
    >>> from lightning_gpuopt.cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    gpuopt ...
    0
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_gpuopt.cli.command import main

__all__ = ["GpuOptCLI", "main"]


def __getattr__(name: str) -> Any:
    if name != "GpuOptCLI":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = importlib.import_module(f"{__name__}.lightning_cli").GpuOptCLI
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
