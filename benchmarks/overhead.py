"""Overhead of DataWaitMonitor: step time with no callback, with DataWaitMonitor (with and
without its slow-pattern findings, and with its metrics not logged), and with Lightning's SimpleProfiler,
interleaved in one run.

Each round trains every variant once, in a shuffled order, on the same model and data; a
step is timed from the start of step ``--warmup`` to the end of the last step by the same
minimal stopwatch in every variant; the end of fit (last step's end to train end: the monitor's
report) is shown apart, and in a second ratio over the run's steps. A variant's ratio is its step time over the bare run's
in the same round; the table gives the median ratio over rounds (goal: DataWaitMonitor
<= 1.01x) with a 95% bootstrap interval (on this machine single rounds scatter by about ±5%), and the same
for the median step of each run (a loaded machine's pauses left out).

    python benchmarks/overhead.py                      # CPU
    python benchmarks/overhead.py --accelerator gpu    # make bench-gpu
    python benchmarks/overhead.py --cpu-clock          # a loaded machine: CPU seconds of the main thread
    git archive main lightning_gpuopt | tar -x -C /tmp/before && python benchmarks/overhead.py --before /tmp/before
                                                       # also the monitor of another copy of the package, interleaved
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import SimpleProfiler
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, Stopwatch, append

from lightning_gpuopt import DataWaitMonitor

#: the monitor of the package copy given by ``--before``
BEFORE = "DataWaitMonitor (--before)"
NOT_LOGGED = "DataWaitMonitor, metrics not logged"
VARIANTS = [
    "bare",
    "empty Callback",
    "DataWaitMonitor",
    "DataWaitMonitor(find_patterns=False)",
    NOT_LOGGED,
    "SimpleProfiler",
]
before_monitor: Any = None


def monitor_of(root: str) -> Any:
    """``DataWaitMonitor`` of the ``lightning_gpuopt`` copy under ``root``, imported apart (its own modules)."""
    ours = {name: module for name, module in sys.modules.items() if name.partition(".")[0] == "lightning_gpuopt"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        return importlib.import_module("lightning_gpuopt.callbacks.data_wait_monitor").DataWaitMonitor
    finally:
        sys.path.remove(root)
        for name in [name for name in sys.modules if name.partition(".")[0] == "lightning_gpuopt"]:
            del sys.modules[name]
        sys.modules.update(ours)


class StepStopwatch(Stopwatch):
    """Also notes the end of the last step: the steps end there; the rest, to train end, is the end of fit
    (the monitor's report: findings, table, JSON), a cost once a fit, shown apart."""

    ends: list[float]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.last_step_end = self.clock()
        if self.started is not None:  # each step's end: the median step, robust to a loaded machine's pauses
            self.ends = [*getattr(self, "ends", [self.started]), self.last_step_end]


def run_once(variant: str, args: argparse.Namespace, loader: DataLoader, root: Path) -> tuple[float, float, float]:
    """(seconds a step, from the start of step ``warmup`` to the end of the last one; seconds of the end of fit;
    the median step's seconds)."""
    seed_everything(0, verbose=False)
    stopwatch = StepStopwatch(args.warmup, time.thread_time if args.cpu_clock else time.perf_counter)
    callbacks: list[Callback] = [stopwatch]
    profiler = None
    if variant in ("DataWaitMonitor", BEFORE):
        callbacks.insert(0, (before_monitor if variant == BEFORE else DataWaitMonitor)(warmup_steps=args.warmup))
    if variant == "DataWaitMonitor(find_patterns=False)":  # the findings' share of the overhead
        callbacks.insert(0, DataWaitMonitor(warmup_steps=args.warmup, find_patterns=False))
    if variant == NOT_LOGGED:  # the share of its gpuopt/* metrics' logging (to the CSVLogger)
        callbacks.insert(0, DataWaitMonitor(warmup_steps=args.warmup, log_every_n_steps=10**9))
    if variant == "empty Callback":  # what Lightning charges for dispatching hooks to any callback
        callbacks.insert(0, Callback())
    if variant == "SimpleProfiler":
        profiler = SimpleProfiler(dirpath=root, filename="simple-profiler")
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.warmup + args.steps,
        callbacks=callbacks,
        profiler=profiler,
        logger=CSVLogger(root, name=variant),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(args.features, args.hidden), loader)
    assert stopwatch.started is not None and stopwatch.ended is not None
    median = statistics.median(end - start for start, end in zip(stopwatch.ends, stopwatch.ends[1:]))
    return (
        (stopwatch.last_step_end - stopwatch.started) / stopwatch.steps,
        stopwatch.ended - stopwatch.last_step_end,
        median,
    )


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (the rounds' ratios): how far this run's median can be
    from the machine's, given its round-to-round noise."""
    draw = random.Random(1)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--cpu-clock",
        action="store_true",
        help="time the main thread's CPU seconds, torch on one thread (a machine loaded by other work)",
    )
    parser.add_argument("--before", help="a folder holding another lightning_gpuopt: its DataWaitMonitor too")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.before:
        global before_monitor
        before_monitor = monitor_of(args.before)
        VARIANTS.insert(3, BEFORE)
    if args.cpu_clock:
        torch.set_num_threads(1)

    generator = torch.Generator().manual_seed(0)
    samples = args.batch_size * (args.warmup + args.steps)
    dataset = TensorDataset(
        torch.randn(samples, args.features, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    ends: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    ratios: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with_end: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    medians: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    order = random.Random(0)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        run_once("bare", args, loader, Path(root))  # import and allocator warm-up, not recorded
        for round_index in range(args.rounds):
            variants = list(VARIANTS)
            order.shuffle(variants)
            measured = {variant: run_once(variant, args, loader, Path(root)) for variant in variants}
            (bare_step, bare_end, bare_median) = measured["bare"]
            for variant in VARIANTS:
                step, end, median = measured[variant]
                medians[variant].append(median / bare_median)
                times[variant].append(step)
                ends[variant].append(end)
                ratios[variant].append(step / bare_step)
                with_end[variant].append((step * args.steps + end) / (bare_step * args.steps + bare_end))
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{v} {measured[v][0] * 1e3:.3f} ms" for v in VARIANTS),
                flush=True,
            )
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (2 cores)"

    table = Table(title=f"Step-time overhead, {args.rounds} interleaved rounds × {args.steps} steps; {load}")
    columns = ["variant", "median step time", "ratio to bare (median of rounds)", "95% interval", "min–max ratio"]
    columns += ["end of fit (median)", f"ratio with the end of fit, {args.steps} steps", "median step's ratio"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for column in columns:
        table.add_column(column)
    for variant in VARIANTS:
        step = statistics.median(times[variant]) * 1e3
        ratio = statistics.median(ratios[variant])
        spread = f"{min(ratios[variant]):.3f}–{max(ratios[variant]):.3f}"
        low, high = median_interval(ratios[variant])
        row = [variant, f"{step:.3f} ms", f"{ratio:.3f}x", f"{low:.3f}–{high:.3f}", spread]
        row.append(f"{statistics.median(ends[variant]) * 1e3:.1f} ms")
        row.append(f"{statistics.median(with_end[variant]):.3f}x")
        row.append(f"{statistics.median(medians[variant]):.3f}x")
        table.add_row(*row)
        lines.append("| " + " | ".join(row) + " |")
    Console().print(table)
    if not args.no_record:
        workload = (
            f"MLP {args.features}-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, preloaded data, "
            f"{args.accelerator}, CSVLogger in every variant"
            + (", the main thread's CPU time, torch on 1 thread" if args.cpu_clock else "")
        )
        path = append(
            "overhead.py: DataWaitMonitor vs SimpleProfiler vs bare",
            "\n".join(lines),
            f"Workload: {workload}. Steps end at the last step's end; 'end of fit' is from there to train end (the"
            f" monitor's report: findings, table, JSON; once a fit). This 2-core CPU machine, {load}."
            " Goal: DataWaitMonitor <= 1.01x a step.",
        )
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
