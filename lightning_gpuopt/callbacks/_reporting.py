"""How every callback writes its section of ``gpuopt_report.json`` (a report never costs a run), in ``trainer.log_dir``
(else ``default_root_dir``: a local ``Path`` or a URL, see :mod:`lightning_gpuopt.core.storage`), draws its PNGs, and
logs its metrics (to the loggers and to ``trainer.callback_metrics``)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

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

_WARNED: set[str] = set()  #: the report failures warned about (a report and why it cannot be written): one warning each


def report_dir(trainer: Trainer) -> Location:
    """The report's folder: a ``Path`` when local, else the URL (a collective under DDP: call it on every rank)."""
    return as_location(trainer.log_dir or trainer.default_root_dir)


def report_file(trainer: Trainer) -> Location:
    """``report_dir(trainer) / "gpuopt_report.json"`` (a collective under DDP: call it on every rank)."""
    return join_location(report_dir(trainer), REPORT_FILENAME)


def report_section(
    trainer: Trainer, section: str, data: dict[str, Any], table: Optional[Callable[[], str]] = None
) -> Optional[Location]:
    """Rank 0 logs ``table()`` and writes ``section`` (:func:`write_report_section`; the path it wrote); the report's
    path is asked on every rank (a collective under DDP)."""
    path = report_file(trainer)
    if not trainer.is_global_zero:
        return None
    if table is not None:
        rank_zero_info(table())
    return write_report_section(path, section, data)


def log_metrics(trainer: Trainer, metrics: Mapping[str, Optional[float]]) -> None:
    """Log ``gpuopt/*`` metrics (``None``: unknown, left out) to every logger at the logged step; also into
    ``trainer.callback_metrics``."""
    values = {key: float(value) for key, value in metrics.items() if value is not None}
    step = compat.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)
    trainer.callback_metrics.update({key: torch.tensor(value) for key, value in values.items()})


def save_report_plots(trainer: Trainer, report_path: Location) -> list[Location]:
    """Rank 0: the report's PNGs drawn beside it and logged to each TensorBoard or W&B logger; failures warn."""
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
            drawn = f"the plots were drawn to {parent_location(report_path)} but not logged to {type(logger).__name__}"
            rank_zero_warn(f"gpuopt: {drawn}: {error}")
    return paths


def _log_pngs(logger: Any, paths: list[Location], step: int) -> None:
    """Each PNG as ``gpuopt/NAME``: TensorBoard's ``add_image``, or ``log_image`` (W&B's: a local path, else pixels)."""
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

    return imread(path if isinstance(path, Path) else io.BytesIO(read_bytes(path)), format="png")


def write_report_section(path: str | os.PathLike, section: str, data: dict[str, Any]) -> Optional[Location]:
    """Write ``section`` of the report at ``path``; the path, or ``None`` when it could not be written: any ``OSError``
    (at a URL, any error) or a missing fsspec package is one warning per report and reason, however many sections."""
    try:
        return update_json_section(path, section, data, warn=rank_zero_warn)
    except FilesystemUnavailableError as error:
        message = f"gpuopt: the report cannot be written: {error}. Training goes on without it."
    except Exception as error:
        if not isinstance(error, OSError) and not is_url(path):  # a remote filesystem's own errors are a warning
            raise
        reason = f"{type(error).__name__}: {error}"  # credentials, network: not OSError
        if isinstance(error, OSError):
            reason = (error.strerror or str(error)) + (f" [errno {error.errno}]" if error.errno is not None else "")
        blocker = None if is_url(path) else next((p for p in Path(path).parents if p.is_file()), None)
        if blocker is not None:
            reason = f"{blocker} is a file, not a folder (give a log dir or report_path in a folder)"
        kept = "the results stay on the callbacks: `.report`, `.result`, `.plan`, `.estimate`"
        message = f"gpuopt: could not write the report {path}: {reason}; training goes on without it ({kept})."
    if message not in _WARNED:
        _WARNED.add(message)
        rank_zero_warn(message)
    return None
