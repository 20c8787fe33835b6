"""Where and how every callback writes its section of ``gpuopt_report.json`` (a report never costs a run), draws
its PNGs, and logs its metrics (to the loggers and to ``trainer.callback_metrics``).

The report goes to ``trainer.log_dir`` (else ``default_root_dir``): a local ``Path``, or a URL (any protocol but
``file``, as Lightning decides for its logs) written through fsspec (:mod:`lightning_gpuopt.core.storage`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.core.report import REPORT_FILENAME, update_json_section
from lightning_gpuopt.core.storage import (
    FilesystemUnavailableError,
    Location,
    as_location,
    is_url,
    join_location,
    parent_location,
    read_bytes,
)

#: the report folders whose filesystem package is missing, warned about once each
_UNAVAILABLE_WARNED: set[str] = set()


def report_dir(trainer: Trainer) -> Location:
    """The report's folder: a ``Path`` when local, else the URL string (a collective under DDP: call it on every
    rank)."""
    return as_location(trainer.log_dir or trainer.default_root_dir)


def report_file(trainer: Trainer) -> Location:
    """``report_dir(trainer) / "gpuopt_report.json"`` (a collective under DDP: call it on every rank)."""
    return join_location(report_dir(trainer), REPORT_FILENAME)


def log_metrics(trainer: Trainer, metrics: Mapping[str, float]) -> None:
    """Log ``gpuopt/*`` metrics to every logger at the logged step, and put them in ``trainer.callback_metrics``
    (as scalar tensors), so that ``EarlyStopping`` and ``ModelCheckpoint`` can monitor them."""
    values = {key: float(value) for key, value in metrics.items()}
    step = compat.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    trainer.callback_metrics.update({key: torch.tensor(value) for key, value in values.items()})


def save_report_plots(trainer: Trainer, report_path: Location) -> list[Location]:
    """Rank 0: draw the report's PNGs beside it and log them to every TensorBoard or W&B logger; the PNGs
    written. What cannot be drawn or logged is a warning."""
    try:
        from lightning_gpuopt.core.plot import save_plots

        paths = save_plots(report_path)
    except Exception as error:  # noqa: BLE001 - never fails the run: matplotlib missing (the message names the extra), a figure failed, or the remote folder refused the PNGs
        rank_zero_warn(f"gpuopt: the plots of {report_path} were not drawn: {error}")
        return []
    step = compat.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        try:
            _log_pngs(logger, paths, step)
        except Exception as error:  # noqa: BLE001 - a logger that cannot take images never fails the run
            rank_zero_warn(
                f"gpuopt: the plots were drawn to {parent_location(report_path)} but not logged to "
                f"{type(logger).__name__}: {error}"
            )
    return paths


def _log_pngs(logger: Any, paths: list[Location], step: int) -> None:
    """Each PNG as ``gpuopt/NAME``: TensorBoard's ``add_image``, or a ``log_image`` (W&B's; a path when local,
    the pixels at a URL)."""
    tensorboard = isinstance(logger, compat.any_namespace("loggers", "TensorBoardLogger"))
    if not tensorboard and not callable(getattr(logger, "log_image", None)):
        return
    for path in paths:
        key = f"gpuopt/{Path(str(path).rsplit('/', 1)[-1]).stem}"
        if tensorboard:
            writer: Any = getattr(logger, "experiment")  # noqa: B009 - a TensorBoardLogger of either namespace
            writer.add_image(key, _read_png(path)[..., :3], step, dataformats="HWC")
        else:
            logger.log_image(key=key, images=[str(path) if isinstance(path, Path) else _read_png(path)], step=step)


def _read_png(path: Location) -> Any:
    """The pixels of a PNG (H x W x channels), at a path or a URL."""
    from matplotlib.image import imread

    if isinstance(path, Path):
        return imread(path)
    return imread(io.BytesIO(read_bytes(path)), format="png")


def write_report_section(path: str | os.PathLike, section: str, data: dict[str, Any]) -> Optional[Location]:
    """Write ``section`` of the report at ``path``; the path, or ``None`` when it could not be written: any
    ``OSError`` (or, at a URL, any error) is a warning, a missing fsspec package one warning per folder."""
    try:
        return update_json_section(path, section, data, warn=rank_zero_warn)
    except FilesystemUnavailableError as error:
        folder = str(parent_location(str(path)))  # one warning per folder, however many sections
        if folder not in _UNAVAILABLE_WARNED:
            _UNAVAILABLE_WARNED.add(folder)
            rank_zero_warn(f"gpuopt: the report cannot be written: {error}. Training goes on without it.")
        return None
    except Exception as error:
        if isinstance(error, OSError):
            reason = (error.strerror or str(error)) + (f" [errno {error.errno}]" if error.errno is not None else "")
        elif is_url(path):  # a remote filesystem's own errors (credentials, network) are not OSError
            reason = f"{type(error).__name__}: {error}"
        else:
            raise
        rank_zero_warn(
            f"gpuopt: could not write the {section!r} section of the report {path}: {reason}; training goes on without it."
        )
        return None
