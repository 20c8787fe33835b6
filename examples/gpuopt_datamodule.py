"""GpuOpt with a LightningDataModule: the batch size lives on the datamodule, and GpuOpt fills memory.

``GpuOpt("fill-memory", global_batch_size=512)`` trains 512 samples per optimizer step. It finds the
largest micro-batch that fits, with real training steps, sets it on the datamodule, and adds
gradient accumulation when 512 do not fit at once. On a CPU there is no card to fill, so
``--max-memory`` is a simulated budget; on a GPU, ``--max-memory 0.9`` is 90% of the card.

    python examples/gpuopt_datamodule.py                                  # CPU, a 16 MB budget
    python examples/gpuopt_datamodule.py --global-batch-size 4096         # more than fits: accumulation
    python examples/gpuopt_datamodule.py --accelerator gpu --max-memory 0.9
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import GpuOpt


class RandomFeatures(L.LightningDataModule):
    """Random features and labels. ``batch_size`` is an attribute, so GpuOpt can set it."""

    def __init__(self, samples: int = 4096, features: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.samples, self.features, self.batch_size = samples, features, batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.features, generator=generator)
        self.data = TensorDataset(x, torch.randint(0, 10, (self.samples,), generator=generator))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class Classifier(L.LightningModule):
    def __init__(self, features: int = 256, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: Optional[list[str]] = None) -> GpuOpt:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-memory", default="16MB", help='bytes, "16MB", or a fraction of the GPU (0.9)')
    parser.add_argument("--global-batch-size", type=int, default=512, help="samples per optimizer step")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--root-dir", default=None, help="where the report goes (default: lightning_logs/)")
    args = parser.parse_args(argv)
    max_memory = float(args.max_memory) if args.max_memory.replace(".", "", 1).isdigit() else args.max_memory

    datamodule = RandomFeatures(samples=args.samples, batch_size=16)
    gpuopt = GpuOpt("fill-memory", max_memory=max_memory, global_batch_size=args.global_batch_size)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        callbacks=[gpuopt],
        default_root_dir=args.root_dir,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), datamodule=datamodule)

    plan = gpuopt.report.memory_fill  # what trained; the datamodule's batch_size is put back after fit
    print("changed:", gpuopt.report.changes)
    print(
        f"trained {plan.micro_batch_size} x {plan.accumulate_grad_batches} = {plan.global_batch_size} samples per step"
    )
    return gpuopt


if __name__ == "__main__":
    main()
