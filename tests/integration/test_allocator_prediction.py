"""On a simulated card the search's prediction replays the fake trace's allocations through the caching
allocator's model: the reserved peak it predicts is the card's, where a line of allocated bytes is far off."""

from __future__ import annotations

import torch
from torch import nn

from lightning_gpuopt.core.allocator import largest_replayed_fit, replay
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep
from lightning_gpuopt.testing import SimulatedGpu

MIB = 2**20


class Tagger(nn.Module):
    """A GRU over token sequences: its per-timestep tensors fill the small pool's 2 MiB segments."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru, self.head = (
            nn.Embedding(256, 128),
            nn.GRU(128, 128, batch_first=True),
            nn.Linear(128, 16),
        )

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = self.gru(self.embedding(batch[0]))
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), batch[1].flatten())


def batch_of(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (size, 32), generator=torch.Generator().manual_seed(0))
    return tokens, tokens % 16


def two_steps(size: int) -> tuple[bool, int]:
    """Whether two training steps at ``size`` fit a fresh 96 MiB H100, and its reserved peak."""
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters())
    with SimulatedGpu("H100", memory="96MiB") as gpu:
        gpu.place(model, optimizer)
        try:
            for _ in range(2):
                batch = batch_of(size)
                gpu.place(batch)
                loss = model.loss(batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        except torch.OutOfMemoryError:
            return False, gpu.allocator.stats.peak_reserved_bytes
        return True, gpu.allocator.stats.peak_reserved_bytes


def test_the_replayed_reserved_peak_is_the_cards_where_the_line_of_allocated_bytes_is_far_off():
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters())
    with SimulatedGpu("H100", memory="96MiB") as gpu:
        gpu.place(model, optimizer)
        batch = batch_of(32)
        gpu.place(batch)
        capacity = gpu.allocator.limit_bytes  # what the allocator may reserve
        estimator = StepEstimator(TrainingStep(model, batch, model.loss, optimizers=[optimizer], batch_size=32))
        line = estimator.refined(estimator.estimate(capacity)).max_batch_size
    assert estimator.allocations
    replayed = largest_replayed_fit(estimator.allocations, capacity, 2 * line, steps=2)
    assert replayed is not None and line > 2 * replayed  # the line counts allocated bytes: 143 against 50
    low, high = sorted(estimator.allocations)[-2:]
    fits, reserved = two_steps(replayed - 1)
    predicted = replay(
        estimator.allocations[low].at(replayed - 1, low, estimator.allocations[high], high), capacity, steps=2
    )
    assert fits and predicted is not None and abs(predicted - reserved) <= 0.03 * reserved
    assert not two_steps(replayed + max(1, replayed // 32))[0]  # within 1/32 of the largest size that fits
    assert not two_steps(line)[0]
