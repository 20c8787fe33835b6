"""Where DataWaitMonitor's per-step cost goes: cProfile over ``--steps`` training steps (the overhead.py workload,
torch on one thread), for a bare run, an empty Callback and the monitor (and, with ``--before DIR``, another copy's
monitor), from step :data:`SKIP` to the end of training (the monitor's report included). Python calls a step are exact (cProfile's times are inflated by its own cost a call: read them as shares).

    python benchmarks/overhead_profile.py --steps 2000 --before /tmp/before
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, append
from overhead import monitor_of

from lightning_gpuopt import DataWaitMonitor

#: steps before the profile starts (set-up, the monitor's first sampled steps)
SKIP = 40


class ProfileSteps(Callback):
    """cProfile from the start of step :data:`SKIP` to the end of training (every variant has it)."""

    def __init__(self) -> None:
        self.profiler = cProfile.Profile()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == SKIP:
            self.profiler.enable()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.profiler.disable()


def profile(callbacks: list[Any], steps: int, loader: DataLoader) -> pstats.Stats:
    seed_everything(0, verbose=False)
    profiled = ProfileSteps()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=SKIP + steps,
        callbacks=[*callbacks, profiled],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(256, 256), loader)
    return pstats.Stats(profiled.profiler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--before", help="a folder holding another lightning_gpuopt: its DataWaitMonitor too")
    parser.add_argument("--top", type=int, default=12, help="functions shown a monitor")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    samples = 64 * (SKIP + args.steps)
    features = torch.randn(samples, 256, generator=generator)
    loader = DataLoader(TensorDataset(features, torch.randint(0, 10, (samples,), generator=generator)), batch_size=64)
    variants: dict[str, Any] = {"bare": lambda: [], "empty Callback": lambda: [Callback()]}
    variants["DataWaitMonitor"] = lambda: [DataWaitMonitor(warmup_steps=20, verbose=False)]
    if args.before:
        before = monitor_of(args.before)
        variants["DataWaitMonitor (--before)"] = lambda: [before(warmup_steps=20, verbose=False)]
    calls: dict[str, float] = {}
    lines = [
        "| variant | function | calls a step | own share of the run | with callees, share |",
        "|---|---|---|---|---|",
    ]
    for name, callbacks in variants.items():
        stats = profile(callbacks(), args.steps, loader)
        table: Any = stats.stats  # type: ignore[attr-defined]  # pstats keeps its rows there
        calls[name] = sum(row[1] for row in table.values()) / args.steps
        total = stats.total_tt  # type: ignore[attr-defined]
        rows = [(row[2], row[3], row[1], f"{Path(key[0]).name}:{key[2]}", key[0]) for key, row in table.items()]
        mine = sorted((row[:4] for row in rows if "lightning_gpuopt" in row[4]), reverse=True)
        own = sum(row[0] for row in mine)
        lines.append(f"| {name} | all lightning_gpuopt functions | | {own / total:.2%} | |")
        for tottime, cumtime, ncalls, function in mine[: args.top]:
            lines.append(
                f"| {name} | {function} | {ncalls / args.steps:.2f} | {tottime / total:.2%} | {cumtime / total:.2%} |"
            )
        print(f"{name}: {calls[name]:.1f} Python calls a step, {own / total:.2%} of the profiled run in our functions")
    summary = ["| variant | Python calls a step | over an empty Callback |", "|---|---|---|"]
    summary += [f"| {name} | {count:.1f} | {count - calls['empty Callback']:+.1f} |" for name, count in calls.items()]
    print("\n".join([*summary, "", *lines]))
    if not args.no_record:
        path = append(
            f"overhead_profile.py: DataWaitMonitor's per-step cost under cProfile, {args.steps} steps",
            "\n".join([*summary, "", *lines]),
            "Workload: MLP 256-256-256-10, batch 64, preloaded data, cpu, torch on 1 thread, no logger. Calls a step are"
            " exact; shares are of the profiled run (cProfile charges every call, so they overstate many small calls)."
            " This 2-core CPU machine, loaded by other work.",
        )
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
