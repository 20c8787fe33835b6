"""Quickstart: is the model waiting for its data?

A small MLP trains on synthetic data whose dataset is deliberately slow: every sample
sleeps ``--delay-ms`` (a stand-in for disk reads or decoding). ``DataWaitMonitor`` measures
each step and reports what bounds the run. Then the same training runs again with
``DataLoaderTuner``, which times the loader over worker settings before training and applies
the best, and the monitor shows the data wait fall.

    python examples/quickstart.py                  # CPU, about a minute with start-up
    python examples/quickstart.py --accelerator gpu
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings
from typing import Optional

import torch
from lightning import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import DataLoaderTuner, DataWaitMonitor


class SlowDataset(Dataset):
    """Random features and labels; each ``__getitem__`` sleeps ``delay_s`` like a disk read."""

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
    def __init__(self, features: int = 64, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def train(args: argparse.Namespace, tune: bool) -> DataWaitMonitor:
    seed_everything(0, verbose=False)
    dataset = SlowDataset(args.samples, 64, args.delay_ms / 1e3)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)  # num_workers=0: PyTorch's default
    monitor = DataWaitMonitor(warmup_steps=2)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=args.epochs,
        callbacks=[DataLoaderTuner(max_seconds=args.tune_seconds), monitor] if tune else [monitor],
        default_root_dir=args.root_dir,
        logger=CSVLogger(args.root_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(Classifier(), loader)
    return monitor


class _NoProductTips(logging.Filter):
    """Lightning logs product tips on the same channel as these reports; keep the demo readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=0.5, help="per-sample loading delay")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tune-seconds", type=float, default=5.0, help="DataLoaderTuner's time budget")
    parser.add_argument("--root-dir", default=None, help="log dir (default: a temporary folder)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoProductTips())
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # torch/Lightning version skew, not ours
    if args.accelerator == "cpu":
        # Beside a GPU the model's math does not compete with loader workers for CPU cores; on a
        # CPU it does, and OpenMP threads stall when a worker takes their core. One intra-op
        # thread keeps this demo about the loader, as it would be on a GPU machine.
        torch.set_num_threads(1)
    args.root_dir = args.root_dir or tempfile.mkdtemp(prefix="gpuopt-quickstart-")

    print("\n=== Run 1: DataWaitMonitor, num_workers=0 (PyTorch's default) ===")
    first = train(args, tune=False).report
    print("\n=== Run 2: the same, with DataLoaderTuner ===")
    second = train(args, tune=True).report
    speed = (first.totals.samples_per_second, second.totals.samples_per_second)
    print(
        f"\ndata wait {first.data_wait_fraction:.0%} → {second.data_wait_fraction:.0%} of the step;"
        f" {speed[0]:,.0f} → {speed[1]:,.0f} samples/s ({speed[1] / speed[0]:.1f}x faster).\n"
        f"Verdict of run 1: {first.verdict} ({first.verdict_reason}).\nVerdict of run 2, measured again after tuning:"
        f" {'still ' if second.verdict == first.verdict else ''}{second.verdict} ({second.verdict_reason})."
    )
    print(f"JSON reports: {args.root_dir}/lightning_logs/version_{{0,1}}/gpuopt_report.json")


if __name__ == "__main__":
    main()
