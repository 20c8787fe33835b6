"""A LightningModule's ``training_step`` as the loss function the traces of :mod:`lightning_gpuopt.core.estimate`
take, and ``self.log`` switched off around steps that training never takes.

Shared by ``MemoryEstimator`` (the estimate before the first step), ``BatchSizeSearch`` (the
estimate that starts the search, and its trial steps), ``MemoryFill`` (the estimates in ``setup``
and the recomputation check of checkpointed blocks) and ``gpuopt estimate``. Under manual
optimization a step is traced whole with
:func:`lightning_gpuopt.callbacks.memory_estimator.manual_step` instead.

Example::

    estimate = StepEstimator(TrainingStep(model, batch, loss_function(model), optimizers=trainer.optimizers)).estimate()
    with logging_disabled(model):
        model.training_step(batch, 0)          # self.log(...) does nothing here
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_gpuopt.core.estimate import NotTraceable


def _ignore_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def logging_disabled(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` of ``pl_module`` do nothing inside: a traced step must not log
    fake values, nor a batch-size trial log figures of a step training never takes.

    Example::

        with logging_disabled(model):
            model.training_step(batch, 0)      # its self.log(...) calls are ignored
    """
    pl_module.log = _ignore_log  # type: ignore[method-assign]
    pl_module.log_dict = _ignore_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


def check_one_batch_step(pl_module: pl.LightningModule) -> None:
    """Raise :class:`~lightning_gpuopt.core.estimate.NotTraceable` for a
    ``training_step(self, dataloader_iter)``: it pulls its own batches, the trace gives it one."""
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise NotTraceable(
            "training_step takes dataloader_iter and pulls its own batches; the estimate traces one "
            "batch given to training_step"
        )


def loss_function(pl_module: pl.LightningModule) -> Any:
    """``pl_module.training_step`` as the ``loss_fn(batch)`` that
    :class:`~lightning_gpuopt.core.estimate.TrainingStep` takes: it returns the step's loss (``training_step``'s
    tensor, or its ``"loss"`` entry), with logging disabled (:func:`logging_disabled`). Called, it
    raises ``NotTraceable`` under manual optimization or for a ``training_step`` that takes
    ``dataloader_iter`` (:func:`check_one_batch_step`), and ``TypeError`` when the step returns no tensor.

    Example::

        step = TrainingStep(model, batch, loss_function(model), optimizers=trainer.optimizers)
    """

    def loss_of(batch: Any) -> torch.Tensor:
        check_one_batch_step(pl_module)
        if not pl_module.automatic_optimization:
            raise NotTraceable(
                "manual optimization: training_step steps the optimizers itself (trace it with manual_step)"
            )
        with logging_disabled(pl_module):
            output = pl_module.training_step(batch, 0)
        if isinstance(output, Mapping):
            output = output.get("loss")
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"training_step returned {type(output).__name__}, not a loss tensor")
        return output

    return loss_of
