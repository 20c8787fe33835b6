"""BatchSizeSearch on users' shapes: accumulation by hand under manual optimization, accumulation under
automatic optimization, and a stream shorter than the batch (real CPU Trainers, MemoryBudget caps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import StreamDataset, quiet_trainer
from lightning import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch

SAMPLES = 1024


class StepCounter(Callback):
    """Counts the optimizer steps and batches of the first real epoch (after the search)."""

    def __init__(self) -> None:
        self.steps = self.batches = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(lambda *_: setattr(self, "steps", self.steps + 1))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
        self.batches += 1


class HandAccumulated(LightningModule):
    """Manual optimization stepping every ``every`` batches, as users write it."""

    def __init__(self, batch_size: int = 256, every: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size, self.every = batch_size, every
        self.net = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y) / self.every)
        if (batch_idx + 1) % self.every == 0:
            self.optimizers().step()
            self.optimizers().zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(SAMPLES, 16, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
        )
        return DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize("every", [3])
def test_manual_accumulation_by_hand_keeps_an_optimizer_step_per_epoch(tmp_path, every):
    search, counter = BatchSizeSearch(max_memory="50MB", verbose=False), StepCounter()
    quiet_trainer(tmp_path, [search, counter], max_epochs=1).fit(HandAccumulated(every=every))
    found = search.result.batch_size
    assert found == SAMPLES // every  # the whole dataset fits; `every` full batches an epoch step once
    assert counter.batches == -(-SAMPLES // found) and counter.steps == 1
    assert any(f"steps the optimizer once every {every} batches" in note for note in search.result.notes)


class Accumulating(HandAccumulated):
    def __init__(self, batch_size: int = 256) -> None:
        super().__init__(batch_size)
        self.automatic_optimization = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_automatic_accumulation_leaves_an_optimizer_step_per_epoch(tmp_path):
    search, counter = BatchSizeSearch(max_memory="50MB", verbose=False), StepCounter()
    quiet_trainer(tmp_path, [search, counter], max_epochs=1, accumulate_grad_batches=4).fit(Accumulating())
    assert search.result.batch_size == SAMPLES and counter.batches == 1 and counter.steps == 1


class Streamed(Accumulating):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(StreamDataset(300, features=16), batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.net(x).square().mean()


def test_a_stream_shorter_than_the_batch_is_called_that(tmp_path):
    search = BatchSizeSearch(max_memory="50MB", verbose=False)
    quiet_trainer(tmp_path, [search], max_steps=1).fit(Streamed(batch_size=1024))
    assert search.result.batch_size == 300
    assert any("the train stream holds 300 samples, fewer than" in note for note in search.result.notes), (
        search.result.notes
    )
