"""Variable-length data with rare long samples, a token model, and a memory cap held during training.

Shared by tests/test_oom_recovery.py, tests/ddp_script.py and benchmarks/oom_recovery.py.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from lightning import Callback, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.core.memory import MemoryBudget


class VariableLengthDataset(Dataset):
    """``size`` sequences of ``features``-dim tokens: ``short`` tokens long, ``long`` for the indices in ``long_at``."""

    def __init__(
        self, size: int, long_at: Sequence[int] = (), short: int = 8, long: int = 96, features: int = 16, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for index in range(size):
            length = long if index in set(long_at) else short
            self.items.append(
                (torch.randn(length, features, generator=generator), int(torch.randint(0, 10, (), generator=generator)))
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.items[index]


def pad_collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every sequence to the batch's longest (zeros), stack the labels."""
    tokens = nn.utils.rnn.pad_sequence([tokens for tokens, _ in samples], batch_first=True)
    return tokens, torch.tensor([label for _, label in samples])


class TokenModel(LightningModule):
    """A per-token MLP, mean over tokens, a classifier; memory grows with batch x length."""

    def __init__(
        self,
        dataset: Optional[Dataset] = None,
        batch_size: int = 16,
        features: int = 16,
        hidden: int = 64,
        lr: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dataset = dataset
        self.batch_size = batch_size
        self.lr = lr
        self.tokens = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(tokens).mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self(tokens), labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, collate_fn=pad_collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def train_by_hand(model: TokenModel, batch_size: int, steps: int, accumulate: int = 1) -> dict[str, torch.Tensor]:
    """The truth: the same batches trained unsplit, without a cap, by a loop written by hand."""
    optimizer = model.configure_optimizers()
    loader = DataLoader(model.dataset, batch_size=batch_size, shuffle=False, collate_fn=pad_collate)
    batches = iter(loader)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            tokens, labels = next(batches)
            (F.cross_entropy(model(tokens), labels) / accumulate).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


class CapDuringTraining(Callback):
    """A user's simulated device cap (MemoryBudget) held over the real training steps; from
    ``shrink_at`` on (a global step) it is ``shrunk_bytes``; ``died_at`` is the step of an exception."""

    def __init__(self, max_bytes: int, shrink_at: Optional[int] = None, shrunk_bytes: Optional[int] = None) -> None:
        self.max_bytes, self.shrink_at, self.shrunk_bytes = max_bytes, shrink_at, shrunk_bytes
        self.budget: Optional[MemoryBudget] = None
        self.died_at: Optional[int] = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.budget = MemoryBudget(self.max_bytes, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.budget is not None and self.shrink_at is not None and trainer.global_step >= self.shrink_at:
            self.budget.max_bytes = self.shrunk_bytes

    def _leave(self) -> None:
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._leave()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.died_at = trainer.global_step
        self._leave()


def step_peak(model: TokenModel, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Peak bytes of one plain training step (forward, backward, SGD step) of ``batch``, measured by
    a MemoryBudget without a cap: the independent figure the caps are set from."""
    optimizer = model.configure_optimizers()
    tokens, labels = batch
    with MemoryBudget(10**12, existing=(model, optimizer), device="cpu") as meter:
        for _ in range(2):  # the second step holds the momentum buffers the first created
            optimizer.zero_grad()
            F.cross_entropy(model(tokens), labels).backward()
            optimizer.step()
    return meter.peak_bytes
