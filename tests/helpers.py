"""Datasets, models and small callbacks shared by the tests and the DDP test script."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from lightning import Callback, LightningModule
from torch import nn
from torch.utils.data import Dataset, TensorDataset


class SlowDataset(Dataset):
    """Random features; each ``__getitem__`` sleeps ``delay_s`` (a stand-in for a disk read).

    ``delay_for`` (optional) returns the delay to use, so a test can make one rank slower.
    With ``num_workers=0``, ``durations`` holds how long each ``__getitem__`` really took (a
    loaded machine oversleeps): the ground truth the tests compare against.
    """

    def __init__(self, size: int, features: int = 32, delay_s: float = 0.0,
                 delay_for: Optional[Callable[[], float]] = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=generator)
        self.y = torch.randint(0, 10, (size,), generator=generator)
        self.delay_s = delay_s
        self.delay_for = delay_for
        self.durations: list[float] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        delay = self.delay_for() if self.delay_for is not None else self.delay_s
        if delay:
            time.sleep(delay)
        item = self.x[index], self.y[index]
        self.durations.append(time.perf_counter() - started)
        return item

    def loading_time(self, first_sample: int, last_sample: int | None = None) -> float:
        """Seconds ``__getitem__`` really took for samples ``first_sample:last_sample`` in fetch order."""
        return sum(self.durations[first_sample:last_sample])


def preloaded_dataset(size: int, features: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, features, generator=generator), torch.randint(0, 10, (size,), generator=generator))


def preloaded_batches(batches: int, batch_size: int, features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole batches already in memory: use with ``DataLoader(..., batch_size=None)``."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch_size, features, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator))
        for _ in range(batches)
    ]


class MLP(LightningModule):
    """An MLP classifier; ``step_sleep_s`` adds a fixed host-side cost to each training step."""

    def __init__(self, features: int = 32, hidden: int = 64, layers: int = 1, step_sleep_s: float = 0.0) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, 10))
        self.step_sleep_s = step_sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TrainingWallClock(Callback):
    """An independent stopwatch: wall time from the first epoch start to the end of training
    (validation and checkpointing inside it included), and the number of samples trained."""

    def __init__(self) -> None:
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.samples = 0

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.samples += len(batch[0])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.ended = time.perf_counter()

    @property
    def wall_s(self) -> float:
        assert self.started is not None and self.ended is not None
        return self.ended - self.started


class SlowHook(Callback):
    """Host work after every training step (like a heavy logging callback)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(self.seconds)


class CpuHeavyDataset(Dataset):
    """Each sample costs ~1 ms of pure-Python CPU work (decoding-like), no I/O wait."""

    def __init__(self, size: int, work: int = 30000) -> None:
        self.size, self.work = size, work

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = 0
        for k in range(self.work):
            total += k * k
        return torch.tensor([float(total % 7), float(index)]), torch.tensor(index % 10)


class StreamDataset(torch.utils.data.IterableDataset):
    """An iterable dataset that does not shard by worker."""

    def __init__(self, size: int, features: int = 32) -> None:
        self.size, self.features = size, features

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(self.size):
            yield torch.randn(self.features, generator=generator), torch.randint(0, 10, (), generator=generator)


class BatchRecorder(Callback):
    """Records the loader settings used and the first feature of every sample, in training order."""

    def __init__(self) -> None:
        self.loader_settings: Optional[tuple] = None
        self.first_values: list[float] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        self.loader_settings = (loader.num_workers, loader.prefetch_factor, loader.persistent_workers, loader.pin_memory)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.first_values.extend(batch[0][:, 0].tolist())
