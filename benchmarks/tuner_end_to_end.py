"""End to end: epoch time of a fit with DataLoaderTuner's choice against the user's default loader
(``num_workers=0``), on three workloads:

* ``io-bound``: each sample sleeps ``--delay-ms`` (a read from disk or network), a small MLP;
* ``pil-decode``: 256 PNG images (made on the fly, 96x96 noise) decoded with PIL in ``__getitem__``, a small CNN;
* ``compute-bound``: preloaded tensors, a CNN whose step dominates.

Epoch time: the median over ``--epochs`` epochs of the wall time from each epoch's start to its end
(training only: the tuner's own seconds, before training, are reported apart). The model runs with
torch's default intra-op threads, as a user's would. Variants run interleaved for ``--rounds`` rounds.
Goal: the tuned fit is never slower than the default (ratio >= 0.95 allowing for noise).

    python benchmarks/tuner_end_to_end.py
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import Callback, LightningModule, Trainer, seed_everything
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from _common import LatencyDataset, append

from lightning_gpuopt import DataLoaderTuner


def sleeping(size: int, delay_s: float) -> LatencyDataset:
    generator = torch.Generator().manual_seed(0)
    features, labels = torch.randn(size, 64, generator=generator), torch.randint(0, 10, (size,), generator=generator)
    return LatencyDataset(features, labels, delay_s)


class PngDataset(Dataset):
    """PNG files in memory, decoded by PIL on every access."""

    def __init__(self, count: int = 256, size: int = 96) -> None:
        rng = np.random.default_rng(0)
        self.files = []
        for _ in range(count):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="PNG")
            self.files.append(buffer.getvalue())
        self.labels = rng.integers(0, 10, count)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = np.asarray(Image.open(io.BytesIO(self.files[index])).convert("RGB"), dtype=np.float32) / 255
        return torch.from_numpy(image).permute(2, 0, 1), int(self.labels[index])


class Model(LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def cnn(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


class EpochClock(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def workloads(args: argparse.Namespace) -> dict[str, tuple[Dataset, Any]]:
    generator = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(256, 3, 32, 32, generator=generator), torch.randint(0, 10, (256,)))
    mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))  # noqa: E731
    return {
        f"io-bound ({args.delay_ms} ms/sample)": (sleeping(512, args.delay_ms / 1e3), mlp),
        "pil-decode (256 PNGs)": (PngDataset(), lambda: cnn(16)),
        "compute-bound (preloaded)": (images, lambda: cnn(64)),
    }


def fit(args: argparse.Namespace, dataset: Dataset, net: Any, root: str, tuned: bool) -> tuple[float, float, str]:
    """Median epoch seconds, the tuner's seconds, and the loader setting the fit used."""
    seed_everything(0, verbose=False)
    clock, tuner = EpochClock(), DataLoaderTuner(max_seconds=args.tune_seconds, verbose=False) if tuned else None
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[clock] if tuner is None else [tuner, clock],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model(net()), DataLoader(dataset, batch_size=32, shuffle=True))
    setting = "num_workers=0" if tuner is None or tuner.result is None else tuner.result.setting.short()
    return statistics.median(clock.seconds), tuner.result.seconds if tuner and tuner.result else 0.0, setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tune-seconds", type=float, default=5.0)
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = ["| workload | round | default epoch (s) | tuned epoch (s) | tuned / default speed | chosen | tuning (s) |"]
    rows.append("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(1, args.rounds + 1):
            for name, (dataset, net) in workloads(args).items():
                default, _, _ = fit(args, dataset, net, root, tuned=False)
                tuned, seconds, setting = fit(args, dataset, net, root, tuned=True)
                row = f"| {name} | {round_index} | {default:.3f} | {tuned:.3f} | {default / tuned:.2f}x | {setting} |"
                rows.append(f"{row} {seconds:.1f} |")
                print(rows[-1], flush=True)
    table = "\n".join(rows)
    note = (
        f"Machine: this 2-core CPU machine, loaded by other work (other sessions' tests and benchmarks ran at the"
        f" same time; load average at the end: {', '.join(f'{x:.1f}' for x in __import__('os').getloadavg())})."
        f" {args.epochs} epochs a fit, batch 32, shuffled; torch's default intra-op threads"
        f" ({torch.get_num_threads()}). Speed = default epoch time / tuned epoch time (above 1: the tuned fit is"
        " faster)."
    )
    print(note)
    if not args.no_record:
        print(f"appended to {append('tuner_end_to_end.py: DataLoaderTuner end to end vs the default', table, note)}")


if __name__ == "__main__":
    main()
