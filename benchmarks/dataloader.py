"""Training throughput on an I/O-latency workload: PyTorch's default loader (num_workers=0),
Lightning's suggestion (``suggested_max_num_workers``), DataLoaderTuner's choice, and the
compute ceiling (the same data preloaded in memory), and that preloaded data passed through
the tuner's worker processes (the cost of moving batches between processes alone).

Every sample's ``__getitem__`` sleeps ``--delay-ms`` (a stand-in for a read from disk or
network). Samples/s are timed by the same stopwatch in every variant, from step ``--warmup``
to the end of training; the tuner's own time (before training) is reported apart. Variants
run interleaved for ``--rounds`` rounds; the table gives medians. Goal: ours >= 0.9 of the
ceiling.

On CPU the model runs on one intra-op thread, so that the loader, not the model's math,
competes for the cores -- as beside a GPU.

    python benchmarks/dataloader.py
    python benchmarks/dataloader.py --accelerator gpu     # on a GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning import Trainer, seed_everything
from lightning.fabric.utilities.data import suggested_max_num_workers
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, LatencyDataset, Stopwatch, append

from lightning_gpuopt import DataLoaderTuner


def train(
    args: argparse.Namespace, dataset: Dataset, root: Path, num_workers: int = 0, tuner: bool = False
) -> tuple[float, float, int]:
    """Samples/s of training, the tuner's seconds, and the num_workers the fit used."""
    seed_everything(0, verbose=False)
    stopwatch = Stopwatch(args.warmup)
    callbacks: list[Any] = [stopwatch]
    tuning = DataLoaderTuner(max_seconds=args.tune_seconds) if tuner else None
    if tuning is not None:
        callbacks.insert(0, tuning)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.warmup + args.steps,
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(args.features, args.hidden, log_loss=False), loader)
    used = tuning.result.num_workers if tuning is not None and tuning.result is not None else num_workers
    return stopwatch.samples_per_second, (tuning.result.seconds if tuning and tuning.result else 0.0), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="per-sample loading latency")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune-seconds", type=float, default=10.0)
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(1)

    samples = args.batch_size * (args.warmup + args.steps + 1)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, args.features, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    slow = LatencyDataset(features, labels, args.delay_ms / 1e3)
    lightning_workers = suggested_max_num_workers(1)
    variants = {
        "num_workers=0 (PyTorch default)": lambda root: train(args, slow, root, 0),
        f"num_workers={lightning_workers} (Lightning's suggestion)": lambda root: train(
            args, slow, root, lightning_workers
        ),
        "DataLoaderTuner": lambda root: train(args, slow, root, 0, tuner=True),
        "ceiling: preloaded in memory": lambda root: train(args, TensorDataset(features, labels), root, 0),
        # the same preloaded data through the tuner's worker count: what passing batches between
        # processes alone costs the main process (a floor no worker setting can beat)
        "preloaded, through the tuner's workers": lambda root: train(
            args, TensorDataset(features, labels), root, chosen[-1] if chosen else 1
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tune_seconds: list[float] = []
    chosen: list[int] = []
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(args.rounds):
            for name, run in variants.items():
                rate, seconds, workers = run(Path(root))
                rates[name].append(rate)
                if name == "DataLoaderTuner":
                    tune_seconds.append(seconds)
                    chosen.append(workers)
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{name} {values[-1]:,.0f}/s" for name, values in rates.items()),
                flush=True,
            )

    ceiling = statistics.median(rates["ceiling: preloaded in memory"])
    table = Table(title=f"Training samples/s, {args.delay_ms} ms per-sample latency, batch {args.batch_size}")
    lines = ["| loader | samples/s (median) | of ceiling |", "|---|---|---|"]
    for column in ("loader", "samples/s (median)", "of ceiling"):
        table.add_column(column)
    for name, values in rates.items():
        median = statistics.median(values)
        label = name + (f" → num_workers {chosen}" if name == "DataLoaderTuner" else "")
        table.add_row(label, f"{median:,.0f}", f"{median / ceiling:.2f}")
        lines.append(f"| {label} | {median:,.0f} | {median / ceiling:.2f} |")
    Console().print(table)
    note = (
        f"Workload: MLP {args.features}-{args.hidden}-{args.hidden}-10 on {args.accelerator}"
        f"{' (1 intra-op thread)' if args.accelerator == 'cpu' else ''}, {args.steps} timed steps, "
        f"{args.rounds} interleaved rounds; tuning took {statistics.median(tune_seconds):.1f} s (median) before "
        "training and is not in samples/s. Goal: DataLoaderTuner >= 0.9 of the ceiling."
    )
    print(note)
    if not args.no_record:
        print(
            f"appended to {append('dataloader.py: DataLoaderTuner vs defaults vs the ceiling', chr(10).join(lines), note)}"
        )


if __name__ == "__main__":
    main()
