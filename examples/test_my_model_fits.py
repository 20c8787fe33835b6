"""Check your GPU setup in CPU CI: copy this file into your tests and put your own model in.

``SimulatedGpu("T4", memory="64MiB")`` makes a CPU ``Trainer`` look, to lightning-gpuopt, like
one running on a T4 cut to 64 MiB. Memory is counted as the card's caching allocator would hold it,
and an allocation past the card raises CUDA's out-of-memory error. So the batch GpuOpt picks, and
whether it trains, are checked without a GPU. Speed is not simulated: a step takes CPU time.

    pytest examples/test_my_model_fits.py
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import GpuOpt
from lightning_gpuopt.testing import SimulatedGpu

CARD_MEMORY = 64 * 2**20  # the memory= below, in bytes


class MyModel(L.LightningModule):
    """Stands in for your model: any LightningModule whose train_dataloader() reads self.batch_size."""

    def __init__(self, batch_size: int = 8, samples: int = 512) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(self.samples, 128, generator=generator), torch.randint(0, 10, (self.samples,))
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)


def test_my_model_trains_a_global_batch_of_256_on_a_t4(tmp_path):
    gpuopt = GpuOpt("fill-memory", global_batch_size=256)
    with SimulatedGpu("T4", memory="64MiB") as gpu:
        trainer = L.Trainer(
            accelerator="cpu",  # the simulated card lives in the CPU process
            max_steps=3,
            callbacks=[gpuopt],
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(MyModel())
    plan = gpuopt.report.memory_fill
    assert trainer.global_step == 3  # trained, no out-of-memory error
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 256
    assert gpu.peak_reserved_bytes <= CARD_MEMORY
