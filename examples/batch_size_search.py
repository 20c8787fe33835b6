"""BatchSizeSearch alone: the largest batch that fits, found with a few real training steps.

The model keeps its batch size in ``self.batch_size`` and its ``train_dataloader()`` reads it.
Before training, the search predicts the limit from a traced step, then checks it with real steps
through the Trainer. It sets the largest size that fitted, and training runs at it. On a CPU,
``max_memory`` is a simulated budget; on a GPU, ``--max-memory 0.9`` is 90% of the card.

    python examples/batch_size_search.py                          # CPU, a 16 MB budget
    python examples/batch_size_search.py --accelerator gpu --max-memory 0.9
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import BatchSizeSearch


class Classifier(L.LightningModule):
    def __init__(self, samples: int = 4096, features: int = 256, hidden: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        self.samples, self.features, self.batch_size = samples, features, batch_size
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.features, generator=generator)
        data = TensorDataset(x, torch.randint(0, 10, (self.samples,), generator=generator))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)  # reads self.batch_size


def main(argv: Optional[list[str]] = None) -> BatchSizeSearch:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-memory", default="16MB", help='bytes, "16MB", or a fraction of the GPU (0.9)')
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--root-dir", default=None, help="where the report goes (default: lightning_logs/)")
    args = parser.parse_args(argv)
    max_memory = float(args.max_memory) if args.max_memory.replace(".", "", 1).isdigit() else args.max_memory

    search = BatchSizeSearch(max_memory=max_memory, multiple_of=8)  # margin="auto": room for 1/32 more samples
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        callbacks=[search],
        default_root_dir=args.root_dir,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(samples=args.samples))

    result = search.result
    print(f"batch size set: {result.batch_size}, the largest that trained in {len(result.trials)} trial(s)")
    for trial in result.trials:
        print(
            f"  batch {trial.batch_size}: {'fits' if trial.fits else 'does not fit'}, peak {trial.peak_bytes:,} bytes"
        )
    return search


if __name__ == "__main__":
    main()
