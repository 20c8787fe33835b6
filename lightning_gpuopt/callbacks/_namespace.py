"""Refuse a Trainer from the other Lightning namespace, naming the import that fits it.

``lightning.pytorch`` and ``pytorch_lightning`` hold distinct classes (see :mod:`lightning_gpuopt._mirror`):
a callback built on one cannot read the other's loops, precision plugins and strategies, and would
measure or decide wrongly rather than fail. Every callback calls :func:`check_trainer_namespace` first.

Example:
    >>> import lightning.pytorch as pl
    >>> check_trainer_namespace(pl.Trainer(logger=False), "GpuOpt")  # the namespace this module is built on
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

_IMPORT_FOR = {"lightning": "lightning_gpuopt", "pytorch_lightning": "lightning_gpuopt.pytorch_lightning"}


def check_trainer_namespace(trainer: Any, callback_name: str) -> None:
    """Raise ``TypeError`` unless ``trainer`` is a Trainer of the namespace this callback is built on."""
    if isinstance(trainer, Trainer):
        return
    ours = Trainer.__module__.split(".")[0]
    theirs = type(trainer).__module__.split(".")[0]
    fix = _IMPORT_FOR.get(theirs)
    advice = (
        f"import it as `from {fix} import {callback_name}`"
        if fix
        else f"use it with a Trainer from `{ours}` (`{type(trainer).__module__}.{type(trainer).__name__}` is neither)"
    )
    raise TypeError(
        f"{callback_name} from `{_IMPORT_FOR[ours]}` is built on `{ours}`, but the Trainer is "
        f"`{type(trainer).__module__}.{type(trainer).__name__}`: {advice}."
    )
