"""Command lines: ``main``, the ``gpuopt`` console command, and :class:`GpuOptCLI` (Lightning imported on first use)."""

from __future__ import annotations

from typing import Any

from lightning_gpuopt.cli.command import main

__all__ = ["GpuOptCLI", "main"]


def __getattr__(name: str) -> Any:
    if name == "GpuOptCLI":  # Lightning is imported on first use only
        from lightning_gpuopt.cli.lightning_cli import GpuOptCLI

        return GpuOptCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
