"""The module's training step as the estimate traces it, outside any loop: a loss function (automatic
optimization) or the whole ``training_step`` with twin optimizers (manual), ``self.log`` off and the
schedulers and real optimizers' options put back."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine.state import cloned
from lightning_gpuopt.callbacks._engine.undo import Undo
from lightning_gpuopt.core._torch_compat import outside_dispatch_modes
from lightning_gpuopt.core.estimate import ManualStep, NotTraceable


@contextlib.contextmanager
def logging_disabled(module: Any) -> Iterator[None]:
    """``self.log``/``self.log_dict`` of ``module`` do nothing inside the block, and its Trainer's loggers
    are a ``DummyLogger`` (a step that writes to ``self.logger`` writes nowhere)."""
    trainer = getattr(module, "_trainer", None)
    with Undo().scope() as undo:
        undo.set(module, "log", lambda *_, **__: None)
        undo.set(module, "log_dict", lambda *_, **__: None)
        if trainer is not None and trainer.loggers:
            undo.set(trainer, "loggers", [compat.of_namespace(trainer, "loggers.logger", "DummyLogger")()])
        yield


def check_one_batch_step(module: Any) -> None:
    """Raise ``NotTraceable`` for a ``training_step(self, dataloader_iter)``: it pulls its own batches."""
    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        why = "training_step takes dataloader_iter and pulls its own batches"
        raise NotTraceable(f"{why}; the estimate traces one batch given to training_step")


def loss_function(module: Any) -> Any:
    """``module.training_step`` as ``batch -> loss`` (its tensor, or its ``"loss"`` entry), logging off.
    Raises ``NotTraceable`` under manual optimization, ``TypeError`` when the step returns no tensor."""

    def loss_of(batch: Any) -> torch.Tensor:
        check_one_batch_step(module)
        if not module.automatic_optimization:
            raise NotTraceable("manual optimization: training_step steps the optimizers itself (trace the whole step)")
        with logging_disabled(module):
            output = module.training_step(batch, 0)
        if isinstance(output, Mapping):
            output = output.get("loss")
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"training_step returned {type(output).__name__}, not a loss tensor")
        return output

    return loss_of


def manual_step(trainer: Any, module: Any, batches: int = 4) -> ManualStep:
    """A manual-optimization module's ``training_step`` as ``(batch, optimizers)``, run as ``batch_idx`` 0, 1, ...
    (at most ``batches``) until every given twin optimizer stepped, directly: no hook, no counted step, schedulers
    put back. Raises ``NotTraceable`` when an optimizer did not step."""

    def run(batch: Any, optimizers: list) -> None:
        check_one_batch_step(module)
        strategy, stepped = trainer.strategy, set[int]()
        with Undo().scope() as undo, logging_disabled(module), _schedulers_kept(trainer):
            twins = [_stepping_directly(optimizer, strategy, stepped) for optimizer in optimizers]
            saved = compat.swap_strategy_optimizers(strategy, list(optimizers), twins)
            undo.add("the strategy's optimizers", lambda: compat.swap_strategy_optimizers(strategy, *saved))
            undo.set(module, "manual_backward", lambda loss, *args, **kwargs: loss.backward(*args, **kwargs))
            for batch_idx in range(batches):
                module.training_step(batch, batch_idx)
                if len(stepped) == len(optimizers):
                    return
        raise NotTraceable(f"training_step did not step every optimizer in its first {batches} batches")

    return run


def _stepping_directly(optimizer: torch.optim.Optimizer, strategy: Any, stepped: set[int]) -> Any:
    """A LightningOptimizer whose ``step`` calls the optimizer's own (no hooks, no counting), noted in ``stepped``."""
    wrapper = compat.to_lightning_optimizer(optimizer, strategy)

    def step(closure: Any = None, **kwargs: Any) -> Any:
        stepped.add(id(optimizer))
        return optimizer.step(closure, **kwargs) if closure is not None else optimizer.step(**kwargs)

    wrapper.step = step  # type: ignore[method-assign]
    return wrapper


@contextlib.contextmanager
def _schedulers_kept(trainer: Any) -> Iterator[None]:
    """The LR schedulers' states and the real optimizers' param-group options (copied outside the trace's modes)."""
    schedulers = [config.scheduler for config in trainer.strategy.lr_scheduler_configs]
    real = trainer.strategy.optimizers
    with outside_dispatch_modes():
        states = [cloned(scheduler.state_dict()) for scheduler in schedulers]
        options = [[cloned({k: v for k, v in g.items() if k != "params"}) for g in o.param_groups] for o in real]
    try:
        yield
    finally:
        for scheduler, state in zip(schedulers, states):
            scheduler.load_state_dict(state)
        for optimizer, groups in zip(real, options):
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)
