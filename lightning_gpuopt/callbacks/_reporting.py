"""Where every callback writes its section of ``gpuopt_report.json``."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer


def report_dir(trainer: Trainer) -> Path:
    """Where ``gpuopt_report.json`` goes. ``trainer.log_dir`` is a collective under DDP (it
    broadcasts rank 0's value): call this on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)
