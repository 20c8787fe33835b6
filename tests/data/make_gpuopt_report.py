"""Regenerate ``tests/data/gpuopt_report.json``: a real report with every section.

One short CPU ``fit`` under a simulated T4 (so the GPU-idle figures exist) with ````BatchSizeSearch``
(real trials under the card's memory) and ``GpuOpt`` tuning a deliberately slow loader, estimating
memory and monitoring data wait::

    PYTHONPATH=. python tests/data/make_gpuopt_report.py                 # rewrites the fixture
    PYTHONPATH=. python tests/data/make_gpuopt_report.py --out DIR       # elsewhere

The figures are measured, so every run writes different numbers; the tests read only the shape.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from lightning import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import BatchSizeSearch, GpuOpt
from lightning_gpuopt.core.report import REPORT_FILENAME
from lightning_gpuopt.testing import SimulatedGpu

HERE = Path(__file__).parent


class SlowDataset(Dataset):
    """Random features; each ``__getitem__`` sleeps ``delay_s`` like a disk read."""

    def __init__(self, size: int, features: int, delay_s: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=generator)
        self.y = torch.randint(0, 10, (size,), generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


class Classifier(LightningModule):
    def __init__(self, delay_s: float, features: int = 64, hidden: int = 8192, batch_size: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.batch_size = batch_size
        self.dataset = SlowDataset(4096, features, delay_s)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def make_report(out_dir: Path, steps: int = 80, delay_ms: float = 0.2, memory: str = "64MiB") -> Path:
    """Train once and return the path of the ``gpuopt_report.json`` it wrote into ``out_dir``."""
    seed_everything(0, verbose=False)
    # the search in front of GpuOpt: the loader is then tuned for the batch size that trains
    callbacks = [BatchSizeSearch(multiple_of=8), GpuOpt("diagnose", tune_loader=True, loader_max_seconds=6)]
    with SimulatedGpu("T4", memory=memory):
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            callbacks=callbacks,
            default_root_dir=out_dir,
            logger=CSVLogger(out_dir, name="", version=""),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=10,
        )
        trainer.fit(Classifier(delay_ms / 1e3))
    return Path(trainer.log_dir) / REPORT_FILENAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "gpuopt_report.json", help="where to copy the report")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    with tempfile.TemporaryDirectory() as tmp:
        report = make_report(Path(tmp), steps=args.steps)
        shutil.copyfile(report, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
