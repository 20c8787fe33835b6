"""Out-of-memory recovery in training: what :class:`MemoryFill` installs with ``on_oom="adapt"`` (docs/memory-fill.md).

From ``on_train_start`` to the fit's end the module's ``training_step`` is wrapped (through the callback's
:class:`Undo`; only the calls the fit loop makes are steps). The wrapper runs forward and backward itself, whole or in
micro-batches of the limit learned for samples of that size (:class:`~lightning_gpuopt.core.oom.MicroBatchLimits`,
halved on each out-of-memory error), and returns the loss through an autograd function that hands its gradients to
the parameters, so Lightning's backward, optimizer step and schedule run unchanged. Out of memory in the optimizer
step is raised saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpuopt.callbacks._engine.trials import gather_ranks
from lightning_gpuopt.callbacks._engine.undo import Undo
from lightning_gpuopt.callbacks._reporting import log_metrics
from lightning_gpuopt.core._torch_compat import grad_scale
from lightning_gpuopt.core.device import release_memory
from lightning_gpuopt.core.memory import is_out_of_memory_error
from lightning_gpuopt.core.oom import MicroBatchLimits, sample_elements, split_batch

#: what ``MemoryFill(on_oom=...)`` accepts
ON_OOM = ("adapt", "raise")
OnOom = Literal["adapt", "raise"]


class _HandGradients(torch.autograd.Function):
    """The loss value; its backward gives the parameters ``hand_over(grad_output)``: the wrapped step's gradients
    rescaled by the incoming gradient (a factor of 1 when Lightning backwards the value as usual)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, hand_over: Callable[[Any], list], *params: torch.Tensor) -> torch.Tensor:
        ctx.hand_over = hand_over
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        hand_over, ctx.hand_over = ctx.hand_over, None
        assert hand_over is not None, "the gradients of a split step were handed out twice"
        return (None, None, *hand_over(grad_output))


class OomRecovery:
    """Wraps ``training_step`` so that out-of-memory errors are absorbed (see the module docstring), from its
    creation until ``undo`` unwinds; each adaptation goes to ``plan.oom_adaptations``, warned and logged."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Any, undo: Undo) -> None:
        self.trainer, self.module, self.plan = trainer, pl_module, plan
        self.limits, self._original = MicroBatchLimits(), pl_module.training_step
        self._strategy_step = trainer.strategy.training_step
        self._in_loop_step = self._zeroed_expected = self._zeroed_seen = self._handed = False
        undo.set(pl_module, "training_step", self._training_step)
        undo.set(trainer.strategy, "training_step", self._loop_step)
        self._strategy_optimizer_step = trainer.strategy.optimizer_step
        undo.set(trainer.strategy, "optimizer_step", self._optimizer_step)

    def _loop_step(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy's ``training_step``: only calls under it (the fit loop's) are real steps."""
        self._in_loop_step = True
        try:
            return self._strategy_step(*args, **kwargs)
        finally:
            self._in_loop_step = False

    def _optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """The strategy's ``optimizer_step``; out of memory once the gradients were handed over is the step's own."""
        self._handed = False
        try:
            return self._strategy_optimizer_step(optimizer, *args, **kwargs)
        except BaseException as exc:
            if not (self._handed and is_out_of_memory_error(exc)):
                raise
            step = f"the optimizer step ({type(optimizer).__name__}) of step {self.trainer.global_step}"
            why = "whose state (new for a layer unfrozen mid-run) micro-batches do not shrink; leave room for it (a smaller max_memory)"
            message = f"MemoryFill(on_oom='adapt') covers forward and backward only: out of memory in {step}, {why}. {_first_line(exc)}"
            raise torch.OutOfMemoryError(message) from exc

    def zero_grad_called(self) -> None:
        """Lightning zeroed the gradients (``on_before_zero_grad``): expected on a group's first batch."""
        self._zeroed_seen = True

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        if not self._in_loop_step or not trainer.training or not self.module.automatic_optimization:
            return self._original(*args, **kwargs)
        self._in_loop_step = False  # the micro-batches below call the original directly
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        first_of_group = batch_idx is not None and batch_idx % trainer.accumulate_grad_batches == 0
        try:
            batch_size = extract_batch_size(batch)
        except Exception:  # noqa: BLE001 - no tensor to count samples by: this batch is not recovered
            return self._original(*args, **kwargs)
        elements = sample_elements(batch, batch_size)
        params: list[torch.Tensor] = [p for p in self.module.parameters() if p.requires_grad]
        # a group's first batch: Lightning zeroes the gradients after this call; dropping them now frees their memory
        kept = [None] * len(params) if first_of_group else [p.grad for p in params]
        self._zeroed_expected, self._zeroed_seen = first_of_group, False
        value, output, grads = self._train_until_it_fits(
            batch, batch_size, elements, batch_idx, params, kept, args, kwargs
        )
        if value is None:  # training_step returned None: skipped, as Lightning would
            return None
        scaler = _enabled_scaler(trainer)
        # read without a host sync: the scale the micro-batches' losses were multiplied by
        expected = (grad_scale(scaler) if scaler is not None else 1.0) / trainer.accumulate_grad_batches

        def hand_over(grad_output: torch.Tensor) -> list:
            self._handed = True  # the gradients go to the parameters: what runs out of memory now is the step
            if self._zeroed_expected and not self._zeroed_seen:
                not_zeroed = "Lightning did not zero the gradients on the first batch of an accumulation group as expected, so the gradients set aside cannot be combined correctly; use on_oom='raise'."
                raise RuntimeError(f"MemoryFill(on_oom='adapt'): {not_zeroed}")
            factor = grad_output / expected
            return [None if grad is None else grad.mul_(factor.to(grad.dtype)) for grad in grads]

        loss = _HandGradients.apply(value, hand_over, *params)
        if isinstance(output, Mapping):
            return {**{k: v for k, v in output.items() if k != "loss"}, "loss": loss}
        return loss

    def _train_until_it_fits(
        self, batch: Any, size: int, elements: int, idx: Any, params: list, kept: list, *call: Any
    ) -> tuple:
        """Forward and backward in micro-batches, halved after each out-of-memory error, until every rank fitted."""
        done = False
        value = output = grads = None
        while True:
            error = attempted = phase = None
            if not done:
                attempted = min(self.limits.limit_for(elements) or size, size)
                for param in params:
                    param.grad = None
                try:
                    value, output = self._forward_backward(batch, size, attempted, *call)
                    grads = [p.grad for p in params]
                except BaseException as exc:
                    if not is_out_of_memory_error(exc):
                        raise
                    phase, error = self._phase, f"{self._phase}: {_first_line(exc)}"
                finally:
                    for param, grad in zip(params, kept):
                        param.grad = grad
                if error is not None:
                    value = output = grads = None
                    release_memory()
            failures = self._agree(phase, attempted, elements)
            if not failures:
                return value, output, grads
            done = error is None
            self._adapt(failures, error, idx)

    def _forward_backward(self, batch: Any, batch_size: int, size: int, args: tuple, kwargs: dict) -> tuple:
        """Each micro-batch's forward, then backward of its weighted loss as Lightning would backward it."""
        trainer = self.trainer
        scaler = _enabled_scaler(trainer)
        autocast_device = getattr(trainer.precision_plugin, "device", self.module.device.type)
        total, output = None, None
        for part, weight in split_batch(batch, size, batch_size=batch_size) if size < batch_size else [(batch, 1.0)]:
            self._phase = "forward"
            output = self._original(part, *args[1:], **kwargs) if args else self._original(**{**kwargs, "batch": part})
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if loss is None:
                if size < batch_size:
                    split = "a micro-batch of a batch split after an out-of-memory error; it cannot be skipped in part."
                    raise RuntimeError(f"MemoryFill(on_oom='adapt'): training_step returned None for {split}")
                return None, None
            weighted = loss if weight == 1.0 else loss * weight
            scaled = weighted / trainer.accumulate_grad_batches
            if scaler is not None:
                scaled = scaler.scale(scaled)
            self._phase = "backward"
            with torch.autocast(autocast_device, enabled=False):
                scaled.backward()
            total = weighted.detach() if total is None else total + weighted.detach()
            del loss, weighted, scaled
        if isinstance(output, Mapping):
            output = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
        return total, output

    def _agree(self, phase: Optional[str], attempted: Optional[int], elements: int) -> list[tuple[int, str, int, int]]:
        """``(rank, phase, attempted, elements)`` of each rank whose try ran out of memory (the same on every rank)."""
        mine = (_PHASES.index(phase) + 1 if phase is not None else 0, attempted or 0, elements)
        rows = gather_ranks(self.trainer, mine)
        return [(rank, _PHASES[int(row[0]) - 1], int(row[1]), int(row[2])) for rank, row in enumerate(rows) if row[0]]

    def _adapt(self, failures: list[tuple[int, str, int, int]], error: Optional[str], batch_idx: Any) -> None:
        """The same new limit on every rank (half the smallest failed micro-batch), recorded in
        ``plan.oom_adaptations``, warned and logged as ``gpuopt/oom_adaptations``/``gpuopt/oom_micro_batch_size``."""
        attempted, elements = min(failure[2] for failure in failures), min(failure[3] for failure in failures)
        where = ", ".join(f"{rank} ({phase})" for rank, phase, _, _ in failures)
        many = "s" if len(failures) > 1 else ""
        reason = f"out of memory on rank{many} {where}" if self.trainer.world_size > 1 else error or "out of memory"
        step, index = self.trainer.global_step, int(batch_idx or 0)
        adaptation = self.limits.adapt(
            step=step, attempted=attempted, elements=elements, reason=reason, batch_idx=index
        )
        self.plan.oom_adaptations.append(adaptation)
        at = f"at step {step} (batch {index}, {elements} elements per sample)"
        smaller = f"micro-batch {attempted} → {adaptation.new_micro_batch_size}, the batch is trained again ({reason})"
        rank_zero_warn(f"MemoryFill(on_oom='adapt'): out of memory {at}: {smaller}.")
        count, micro = float(len(self.plan.oom_adaptations)), float(adaptation.new_micro_batch_size)
        log_metrics(self.trainer, {"gpuopt/oom_adaptations": count, "gpuopt/oom_micro_batch_size": micro})

    _phase = "forward"


_PHASES = ("forward", "backward")


def _enabled_scaler(trainer: pl.Trainer) -> Any:
    """The precision plugin's AMP gradient scaler when it scales (``None`` otherwise)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 160 else line[:157] + "..."
