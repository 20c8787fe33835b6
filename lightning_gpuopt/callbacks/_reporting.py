"""Where every callback writes its section of ``gpuopt_report.json``, and how: a report never costs a run;
and how it logs its metrics (to the loggers and to ``trainer.callback_metrics``).

The report goes to ``trainer.log_dir`` (else ``trainer.default_root_dir``). A local directory is a
``Path``, written as before (atomic rename, sections merged); a remote one (``s3://bucket/run``,
``gcs://...``, ``memory://run``: any protocol but ``file``, as Lightning itself decides for its logs and
checkpoints) stays a URL string and the report and its PNGs are written through fsspec
(:mod:`lightning_gpuopt.core.storage`). A URL whose filesystem package is missing (``s3://`` without
``s3fs``) is one warning naming the URL and the package; the run goes on without the report.

Example::

    path = report_file(trainer)      # on every rank (a collective under DDP): a Path, or a URL
    if trainer.is_global_zero:
        write_report_section(path, "data_wait", to_dict(report))   # warns instead of raising
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

#: the report folders whose filesystem package was found missing, warned about once each (per process)
_UNAVAILABLE_WARNED: set[str] = set()


def report_dir(trainer: Trainer) -> Location:
    """Where ``gpuopt_report.json`` goes: ``trainer.log_dir`` (else ``trainer.default_root_dir``), a ``Path``
    when local, the URL string when remote (``s3://bucket/run``: ``Path`` would make it ``s3:/bucket/run``).
    ``trainer.log_dir`` is a collective under DDP (it broadcasts rank 0's value): call this on every rank.
    Local or remote is :func:`~lightning_gpuopt.core.storage.as_location`'s decision, the same one as
    Lightning's for its own logs (``tests/integration/test_lightning_compat.py`` checks that they agree)."""
    return as_location(trainer.log_dir or trainer.default_root_dir)


def report_file(trainer: Trainer) -> Location:
    """``report_dir(trainer) / "gpuopt_report.json"``, for a local folder and a URL alike (a collective
    under DDP: call it on every rank)."""
    return join_location(report_dir(trainer), REPORT_FILENAME)


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


def save_report_plots(trainer: Trainer, report_path: Location) -> list[Location]:
    """Rank 0, at the end of fit: draw the report's PNGs beside it (a local folder or a URL) and log them
    to every TensorBoard or W&B logger of the Trainer. Never fails the run: what cannot be drawn or
    logged is a warning.

    Returns the PNGs written (empty when nothing could be drawn).
    """
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
    """TensorBoard: ``add_image`` each PNG under ``gpuopt/NAME``; W&B (a logger with ``log_image``, as
    ``WandbLogger``): one ``log_image`` call per PNG (its path when local, its pixels when the PNG is at a
    URL); any other logger: nothing."""
    if isinstance(logger, compat.any_namespace("loggers", "TensorBoardLogger")):
        for path in paths:
            writer: Any = getattr(logger, "experiment")  # noqa: B009 - a TensorBoardLogger of either namespace
            writer.add_image(f"gpuopt/{_stem(path)}", _read_png(path)[..., :3], step, dataformats="HWC")
    elif callable(getattr(logger, "log_image", None)):
        for path in paths:
            image = str(path) if isinstance(path, Path) else _read_png(path)
            logger.log_image(key=f"gpuopt/{_stem(path)}", images=[image], step=step)


def _stem(path: Location) -> str:
    """The file name without its suffix, of a path or a URL."""
    return path.stem if isinstance(path, Path) else Path(path.rsplit("/", 1)[-1]).stem


def _read_png(path: Location) -> Any:
    """The pixels of a PNG (H x W x channels), read from a local path or through fsspec from a URL."""
    from matplotlib.image import imread

    if isinstance(path, Path):
        return imread(path)
    return imread(io.BytesIO(read_bytes(path)), format="png")


def write_report_section(path: str | os.PathLike, section: str, data: dict[str, Any]) -> Optional[Location]:
    """Write ``section`` of the report at ``path`` (a local path or a URL); the path (a URL stays a
    ``str``), or ``None`` when it could not be written.

    A report must never cost the user their run: a read-only directory, a full disk or any other
    ``OSError`` becomes one warning naming the file and the error, and training goes on. An existing
    report that is not valid JSON is kept aside as ``<name>.corrupt-<n>``, with a warning. At a URL,
    whatever the remote filesystem raises (credentials, network) is such a warning too, and a protocol
    whose package is not installed (``s3://`` without ``s3fs``) is one warning per folder, naming the
    URL and the package to install, however many sections are written there.
    """
    try:
        return update_json_section(path, section, data, warn=rank_zero_warn)
    except FilesystemUnavailableError as error:
        _warn_unavailable(error, path)
        return None
    except OSError as error:
        reason = error.strerror or str(error)
        code = f" [errno {error.errno}]" if error.errno is not None else ""
        rank_zero_warn(
            f"gpuopt: could not write the {section!r} section of the report {path}: {reason}{code}; "
            "training goes on without it."
        )
        return None
    except Exception as error:
        # at a URL only: a remote filesystem's own errors (credentials, network) are not OSError
        if not is_url(path):
            raise
        rank_zero_warn(
            f"gpuopt: could not write the {section!r} section of the report {path}: "
            f"{type(error).__name__}: {error}; training goes on without it."
        )
        return None


def _warn_unavailable(error: FilesystemUnavailableError, path: str | os.PathLike) -> None:
    """One warning per report folder whose filesystem package is missing (every section would repeat it)."""
    folder = str(parent_location(str(path)))
    if folder in _UNAVAILABLE_WARNED:
        return
    _UNAVAILABLE_WARNED.add(folder)
    rank_zero_warn(f"gpuopt: the report cannot be written: {error}. Training goes on without it.")
