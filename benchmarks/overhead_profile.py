"""Where DataWaitMonitor's per-step cost goes: cProfile over ``--steps`` training steps (the overhead.py workload,
torch on one thread), for a bare run, an empty Callback and the monitor (and, with ``--before DIR``, another copy's
monitor), from step :data:`SKIP` to the end of training (the monitor's report included). Python calls a step are exact (cProfile's times are inflated by its own cost a call: read them as shares).

    python benchmarks/overhead_profile.py --steps 2000 --before /tmp/before

``--in-run``: instead, the monitor's two per-step hooks timed call by call inside a real fit of ``--steps`` steps
(the cost with the caches a real step leaves: several times the replayed cost).

``--replay N``: instead, CPU microseconds a step of Lightning's per-step profiler actions and hook calls replayed
N times a block inside a live fit (at step :data:`SKIP`), each variant's best of 7 blocks: a loaded machine's noise
left out, so a few microseconds show (the cost in a real step is larger: caches are cold after the step's compute).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
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


def fit(callbacks: list[Any], steps: int, loader: DataLoader) -> None:
    """The workload: MLP 256, :data:`SKIP` + ``steps`` steps on CPU, no logger."""
    seed_everything(0, verbose=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=SKIP + steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(256, 256), loader)


def profile(callbacks: list[Any], steps: int, loader: DataLoader) -> pstats.Stats:
    profiled = ProfileSteps()
    fit([*callbacks, profiled], steps, loader)
    return pstats.Stats(profiled.profiler)


class Replay(Callback):
    """At step :data:`SKIP`, replays ``steps`` times what Lightning calls a step (the fetch, the transfer hooks, the
    callbacks' and the module's per-step hooks inside their profiler actions), in 7 blocks; ``seconds``: each
    block's main-thread CPU seconds a step. Then stops the fit."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seconds = steps, []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != SKIP:
            return
        hooks = [
            (callback, f"[Callback]{callback.state_key}.") for callback in trainer.callbacks if callback is not self
        ]
        module, strategy = (
            f"[LightningModule]{type(pl_module).__name__}.",
            f"[Strategy]{type(trainer.strategy).__name__}.",
        )
        fetch = f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"
        inner_hooks = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")

        def action(name: str, call: Any = None, *args: Any) -> None:
            with trainer.profiler.profile(name):
                if call is not None:
                    call(trainer, pl_module, *args)

        for _ in range(7):
            started = time.thread_time()
            for index in range(self.steps):
                trainer.profiler.start(fetch)
                trainer.profiler.stop(fetch)
                for name in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"):
                    action(module + name)
                action(strategy + "batch_to_device")
                for callback, prefix in hooks:
                    action(prefix + "on_train_batch_start", callback.on_train_batch_start, batch, index)
                action(module + "on_train_batch_start")
                with trainer.profiler.profile("run_training_batch"):
                    action(strategy + "training_step")
                    for hook in inner_hooks:
                        args = () if hook == "on_after_backward" else (None,)
                        for callback, prefix in hooks:
                            if callable(call := getattr(callback, hook)):  # Lightning calls only a callable hook
                                action(prefix + hook, call, *args)
                        action(module + hook)
                for callback, prefix in hooks:
                    action(prefix + "on_train_batch_end", callback.on_train_batch_end, outputs, batch, index)
                action(module + "on_train_batch_end")
            self.seconds.append((time.thread_time() - started) / self.steps)
        trainer.should_stop = True


def hook_times(monitor_class: Any, steps: int, loader: DataLoader) -> dict[str, list[float]]:
    """Seconds of each call of the monitor's two per-step hooks inside a real fit (caches as a real step leaves
    them, which replaying does not), by a stopwatch around the call; after step :data:`SKIP`."""
    times: dict[str, list[float]] = {"on_train_batch_start": [], "on_train_batch_end": []}

    class Timed(monitor_class):  # type: ignore[misc, valid-type]
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            started = time.perf_counter()
            super().on_train_batch_start(trainer, *args)
            if trainer.global_step >= SKIP:
                times["on_train_batch_start"].append(time.perf_counter() - started)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            started = time.perf_counter()
            super().on_train_batch_end(trainer, *args)
            if trainer.global_step > SKIP:
                times["on_train_batch_end"].append(time.perf_counter() - started)

    fit([Timed(warmup_steps=20, verbose=False)], steps, loader)
    return times


def replay(variants: dict[str, Any], steps: int, loader: DataLoader, rounds: int = 3) -> list[str]:
    """Each variant's replayed CPU microseconds a step, and against an empty Callback's: table rows."""
    best: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(rounds):  # interleaved
            for name, callbacks in variants.items():
                replayed = Replay(steps)
                trainer = Trainer(
                    accelerator="cpu",
                    max_steps=SKIP + 10,
                    callbacks=[*callbacks(), replayed],
                    logger=CSVLogger(root),
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    enable_checkpointing=False,
                )
                trainer.fit(MLP(256, 256), loader)
                best[name].append(min(replayed.seconds))
    empty = statistics.median(best["empty Callback"])
    middle = {name: statistics.median(seconds) for name, seconds in best.items()}
    return [f"| {name} | {mid * 1e6:.1f} µs | {(mid - empty) * 1e6:+.1f} µs |" for name, mid in middle.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--before", help="a folder holding another lightning_gpuopt: its DataWaitMonitor too")
    parser.add_argument("--top", type=int, default=12, help="functions shown a monitor")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument("--replay", type=int, default=0, help="replay this many steps a block instead")
    parser.add_argument("--in-run", action="store_true", help="instead, time the monitor's hooks in a real fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    samples = 64 * (SKIP + args.steps)
    features = torch.randn(samples, 256, generator=generator)
    loader = DataLoader(TensorDataset(features, torch.randint(0, 10, (samples,), generator=generator)), batch_size=64)
    variants: dict[str, Any] = {"bare": lambda: [], "empty Callback": lambda: [Callback()]}
    variants["DataWaitMonitor"] = lambda: [DataWaitMonitor(warmup_steps=20, verbose=False)]
    variants["DataWaitMonitor(find_patterns=False)"] = lambda: [
        DataWaitMonitor(warmup_steps=20, verbose=False, find_patterns=False)
    ]
    if args.before:
        before = monitor_of(args.before)
        variants["DataWaitMonitor (--before)"] = lambda: [before(warmup_steps=20, verbose=False)]
    if args.in_run:
        head = ["| monitor | hook | median µs a call | mean µs a call |", "|---|---|---|---|"]
        monitors = {"DataWaitMonitor": DataWaitMonitor}
        if args.before:
            monitors["DataWaitMonitor (--before)"] = monitor_of(args.before)
        rows = []
        for name, monitor_class in monitors.items():
            for hook, seconds in hook_times(monitor_class, args.steps, loader).items():
                mean, median = statistics.mean(seconds) * 1e6, statistics.median(seconds) * 1e6
                rows.append(f"| {name} | {hook} | {median:.1f} | {mean:.1f} |")
        table = "\n".join(head + rows)
        print(table)
        if not args.no_record:
            notes = "A stopwatch (perf_counter) around each call of the monitor's per-step hooks inside a real fit"
            notes += " (MLP 256, preloaded data, torch on 1 thread, no logger), after the first 40 steps; the stopwatch"
            notes += " itself costs about 0.5 µs a call. The means include the sampled steps and the periodic logging."
            append(
                f"overhead_profile.py --in-run: DataWaitMonitor's hooks in a real fit, {args.steps} steps", table, notes
            )
        return
    if args.replay:
        head = [
            "| variant | CPU a replayed step (median of 3 rounds' best block) | over an empty Callback |",
            "|---|---|---|",
        ]
        table = "\n".join(head + replay(variants, args.replay, loader))
        print(table)
        if not args.no_record:
            title = f"overhead_profile.py --replay: DataWaitMonitor's per-step code, {args.replay} steps a block"
            notes = (
                "Lightning's per-step profiler actions and hook calls replayed inside a live fit (MLP 256, CSVLogger)"
            )
            append(title, table, notes + "; main-thread CPU time. This 2-core CPU machine, loaded by other work.")
        return
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
