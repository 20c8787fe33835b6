"""Where every callback writes its section of ``gpuopt_report.json``, and how: a report never costs a run;
and how it logs its metrics (to the loggers and to ``trainer.callback_metrics``).

Example::

    path = report_dir(trainer) / REPORT_FILENAME      # on every rank (a collective under DDP)
    if trainer.is_global_zero:
        write_report_section(path, "data_wait", to_dict(report))   # warns instead of raising
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.core.report import update_json_section


def report_dir(trainer: Trainer) -> Path:
    """Where ``gpuopt_report.json`` goes. ``trainer.log_dir`` is a collective under DDP (it
    broadcasts rank 0's value): call this on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def log_metrics(trainer: Trainer, metrics: Mapping[str, float]) -> None:
    """Log ``gpuopt/*`` metrics to every logger of the trainer, at the trainer's step, and put them in
    ``trainer.callback_metrics`` (as scalar tensors, as Lightning stores what ``self.log`` logs), so that
    ``EarlyStopping`` and ``ModelCheckpoint`` can monitor them, with or without a logger.

    Example::

        log_metrics(trainer, {"gpuopt/batch_size": 256.0})
        trainer.callback_metrics["gpuopt/batch_size"]       # tensor(256.)
    """
    values = {key: float(value) for key, value in metrics.items()}
    step = compat.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    trainer.callback_metrics.update({key: torch.tensor(value) for key, value in values.items()})


def save_report_plots(trainer: Trainer, report_path: Path) -> list[Path]:
    """Rank 0, at the end of fit: draw the report's PNGs beside it and log them to every TensorBoard or
    W&B logger of the Trainer. Never fails the run: what cannot be drawn or logged is a warning.

    Returns the PNGs written (empty when nothing could be drawn).
    """
    try:
        from lightning_gpuopt.core.plot import save_plots

        paths = save_plots(report_path)
    except Exception as error:  # noqa: BLE001 - never fails the run: matplotlib missing (the message names the extra), or a figure failed
        rank_zero_warn(f"gpuopt: the plots of {report_path} were not drawn: {error}")
        return []
    step = compat.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        try:
            _log_pngs(logger, paths, step)
        except Exception as error:  # noqa: BLE001 - a logger that cannot take images never fails the run
            rank_zero_warn(
                f"gpuopt: the plots were drawn to {report_path.parent} but not logged to "
                f"{type(logger).__name__}: {error}"
            )
    return paths


def _log_pngs(logger: Any, paths: list[Path], step: int) -> None:
    """TensorBoard: ``add_image`` each PNG under ``gpuopt/NAME``; W&B (a logger with ``log_image``, as
    ``WandbLogger``): one ``log_image`` call per PNG; any other logger: nothing."""
    if isinstance(logger, TensorBoardLogger):
        from matplotlib.image import imread

        for path in paths:
            logger.experiment.add_image(f"gpuopt/{path.stem}", imread(path)[..., :3], step, dataformats="HWC")
    elif callable(getattr(logger, "log_image", None)):
        for path in paths:
            logger.log_image(key=f"gpuopt/{path.stem}", images=[str(path)], step=step)


def write_report_section(path: str | os.PathLike, section: str, data: dict[str, Any]) -> Optional[Path]:
    """Write ``section`` of the report at ``path``; the path, or ``None`` when it could not be written.

    A report must never cost the user their run: a read-only directory, a full disk or any other
    ``OSError`` becomes one warning naming the file and the error, and training goes on. An existing
    report that is not valid JSON is kept aside as ``<name>.corrupt-<n>``, with a warning.
    """
    try:
        return update_json_section(path, section, data, warn=rank_zero_warn)
    except OSError as error:
        reason = error.strerror or str(error)
        rank_zero_warn(
            f"gpuopt: could not write the {section!r} section of the report {path}: {reason} "
            f"[errno {error.errno}]; training goes on without it."
        )
        return None
