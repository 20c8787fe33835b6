"""Users' model shapes (tests/models_users.py) through the estimate: a right answer or a clear refusal.

Truth is independent of the estimate: the torch profiler's allocator events on the host
(:func:`helpers.profiler_peak_bytes`) for a step sequence written by hand, and real training under
a :class:`~lightning_gpuopt.core.memory.MemoryBudget` at the reported batch size and above it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import lightning as L
import pytest
import torch
from helpers import profiler_peak_bytes
from models_users import ResNetModule
from torch.nn import functional as F

from lightning_gpuopt import GpuOpt, MemoryEstimator
from lightning_gpuopt.core.estimate import estimate_memory
from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error

#: the predicted peak against the profiler's allocator peak
ALLOCATOR_TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Trainers without a logger write the report into the working directory: keep it out of the repo."""
    monkeypatch.chdir(tmp_path)


def trainer_for(callbacks: list, **kwargs: Any) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def resnet_group_peak(micro_batch: int, accumulate: int, width: int = 32, size: int = 8) -> tuple[int, Any]:
    """The profiler's peak of one accumulation group of the ResNet written by hand (Lightning's order:
    forward, zero_grad on a group's first micro-batch, backward; clip and step after the last), in
    the steady state (after two groups); returns ``(peak, (model, optimizer, batch, loss_fn))``."""
    torch.manual_seed(0)
    model = ResNetModule(width=width, size=size, num_samples=micro_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    batch = (model.images[:micro_batch], model.labels[:micro_batch])

    def loss_fn(data: Any) -> torch.Tensor:
        return F.cross_entropy(model(data[0]), data[1])

    def group() -> None:
        for index in range(accumulate):
            loss = loss_fn(batch) / accumulate
            if index == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    group(), group()
    return profiler_peak_bytes(group, existing=(model, optimizer, batch)), (model, optimizer, batch, loss_fn)


# --------------------------------------------------------------------------- 12.5: accumulation


@pytest.mark.parametrize("accumulate", [1, 4])
def test_an_accumulating_step_is_traced_as_it_runs_and_matches_the_profiler(accumulate):
    # a ResNet with many parameters for its activations: its peak is at the optimizer step, where
    # the gradients already live; adding a set of gradients on top overshot by 18%
    truth, (model, optimizer, batch, loss_fn) = resnet_group_peak(16, accumulate)
    estimate = estimate_memory(model, loss_fn, batch, optimizer=optimizer, batch_size=16,
                               accumulate_grad_batches=accumulate)  # fmt: skip
    assert estimate.method == "traced" and estimate.accumulate_grad_batches == accumulate
    error = (estimate.predicted_peak_bytes - truth) / truth
    assert abs(error) <= ALLOCATOR_TOLERANCE, (estimate.predicted_peak_bytes, truth)
    assert estimate.untraced_bytes == 0  # nothing added outside the trace (and so to the measurement)
    assert any("accumulating 4 micro-batches" in note for note in estimate.notes) == (accumulate > 1)


class PeakUnderBudget(L.Callback):
    """The independent measurement: a MemoryBudget from train start to train end, its peak kept."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.budget: Optional[MemoryBudget] = None
        self.peak_bytes: Optional[int] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.budget = MemoryBudget(self.cap_bytes, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def _leave(self) -> None:
        if self.budget is not None:
            budget, self.budget = self.budget, None
            self.peak_bytes = budget.peak_bytes
            budget.__exit__(None, None, None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._leave()


def test_gpuopt_report_under_accumulation_agrees_with_the_plan_and_the_real_peak():
    # fill-memory plans micro-batches with accumulation under 12 MB; the combined report used to
    # show the estimator's figures with the gradients counted twice: a largest batch of 18 next to
    # a plan whose trials fitted 25 (a budget 10% below the estimator's capacity)
    gpuopt = GpuOpt("fill-memory", max_memory="12MB", global_batch_size=40, monitor=False, tune_loader=False)
    model = ResNetModule(width=32, size=8, num_samples=160, batch_size=8)
    trainer_for([gpuopt], gradient_clip_val=1.0).fit(model)
    plan, memory = gpuopt.report.memory_fill, gpuopt.report.memory
    assert plan.accumulate_grad_batches > 1 and memory.accumulate_grad_batches == plan.accumulate_grad_batches
    assert memory.batch_size == plan.micro_batch_size
    assert memory.max_batch_size >= plan.largest_fit  # what the trials fitted in a smaller budget fits
    assert memory.predicted_peak_bytes <= memory.capacity_bytes
    # the reported peak against the profiler's peak of the same step written by hand
    truth, _ = resnet_group_peak(plan.micro_batch_size, plan.accumulate_grad_batches)
    assert abs(memory.predicted_peak_bytes - truth) / truth <= ALLOCATOR_TOLERANCE
    assert abs(memory.measured_peak_bytes - truth) / truth <= ALLOCATOR_TOLERANCE
