"""Where every callback writes its section of ``gpuopt_report.json``, and how: a report never costs a run.

Example::

    path = report_dir(trainer) / REPORT_FILENAME      # on every rank (a collective under DDP)
    if trainer.is_global_zero:
        write_report_section(path, "data_wait", to_dict(report))   # warns instead of raising
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpuopt.core.report import update_json_section


def report_dir(trainer: Trainer) -> Path:
    """Where ``gpuopt_report.json`` goes. ``trainer.log_dir`` is a collective under DDP (it
    broadcasts rank 0's value): call this on every rank."""
    return Path(trainer.log_dir or trainer.default_root_dir)


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
        rank_zero_warn(f"gpuopt: could not write the {section!r} section of the report {path}: {reason} "
                       f"[errno {error.errno}]; training goes on without it.")  # fmt: skip
        return None
