"""BatchSizeSearch vs Lightning's BatchSizeFinder ("power" and "binsearch") under the same budget.

Every method runs inside a real ``Trainer.fit`` on CPU with the same simulated device cap: our
trials run in a :class:`~lightning_gpuopt.core.memory.MemoryBudget` (``max_memory=CAP``,
``margin=0``); each of Lightning's trials (its ``_try_loop_run``) is wrapped in a
``MemoryBudget(CAP)`` that counts the same things (model, gradients, optimizer state and what the
steps allocate), and its OOM handling recognises the budget's "CUDA out of memory" error. Lightning
runs with its defaults (``init_val=2``, ``steps_per_trial=3``, ``margin=0.05`` in binsearch).

Per model the table shows trials, real training steps (``training_step`` calls on real tensors,
failed trials included; our fake-tensor estimate is not a training step), wall seconds of the
fit (the search plus one training step, the same for every method), the batch size found, and the true largest fit: found by bisection over an independent
measurement (a fresh model and Trainer running 2 steps inside a fresh ``MemoryBudget(CAP)``).
Goal: ours <= 1/4 of Lightning's training steps, and within [90%, 100%] of the true largest fit.

Usage::

    .venv/bin/python benchmarks/search_vs_lightning.py            # appends a section to RESULTS.md
    .venv/bin/python benchmarks/search_vs_lightning.py --no-write
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.tuner import batch_size_scaling
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append  # noqa: E402
from models_memory import make_model  # noqa: E402

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch  # noqa: E402
from lightning_gpuopt.core.memory import MemoryBudget, parse_memory  # noqa: E402
from lightning_gpuopt.core.memory import is_out_of_memory_error  # noqa: E402

#: model -> (cap, training samples): caps chosen so the largest fit is tens to a thousand or more
WORKLOADS = {"mlp": ("16MB", 8192), "cnn": ("60MB", 2048), "transformer": ("60MB", 2048)}


def trainer(root: str, callbacks: list, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, default_root_dir=root,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def counting_steps(model: L.LightningModule) -> list[int]:
    """Count ``training_step`` calls on real tensors (the estimate's fake-tensor trace is not a step)."""
    counter = [0]
    original = model.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        if not isinstance(batch[0], FakeTensor):
            counter[0] += 1
        return original(batch, batch_idx)

    model.training_step = training_step  # type: ignore[method-assign]
    return counter


class BudgetAroundTraining(L.Callback):
    """The independent measurement: a MemoryBudget from train start to train end."""

    def __init__(self, cap: int) -> None:
        self.cap, self.budget = cap, None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.budget = MemoryBudget(self.cap, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.budget.__exit__(None, None, None)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        if self.budget is not None:
            self.budget.__exit__(None, None, None)


def fits(name: str, samples: int, cap: int, batch_size: int) -> bool:
    with tempfile.TemporaryDirectory() as root:
        try:
            trainer(root, [BudgetAroundTraining(cap)], max_steps=2).fit(make_model(name, samples, batch_size))
        except Exception as error:  # noqa: BLE001
            if is_out_of_memory_error(error):
                return False
            raise
    return True


def true_largest_fit(name: str, samples: int, cap: int, hint: int) -> tuple[int, int]:
    """Bisection over the independent measurement; ``hint`` only seeds the bracket (checked both ways)."""
    measurements = 0

    def check(batch_size: int) -> bool:
        nonlocal measurements
        measurements += 1
        return fits(name, samples, cap, batch_size)

    low, high = max(1, hint), min(samples, max(2, hint * 2))
    while low > 1 and not check(low):
        high, low = low, low // 2
    if check(high):
        return high, measurements  # the data set length (or more than twice the hint) fits
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if check(mid) else (low, mid)
    return low, measurements


def run_ours(name: str, samples: int, cap: int) -> dict:
    model = make_model(name, samples, batch_size=16)
    steps = counting_steps(model)
    search = BatchSizeSearch(max_memory=cap, margin=0.0)
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        trainer(root, [search], max_steps=1).fit(model)
        seconds = time.perf_counter() - started
    return dict(trials=len(search.result.trials), steps=steps[0] - 1, seconds=seconds, batch=search.result.batch_size)


def run_lightning(name: str, samples: int, cap: int, mode: str) -> dict:
    model = make_model(name, samples, batch_size=2)
    steps = counting_steps(model)
    trials = [0]
    original: Callable = batch_size_scaling._try_loop_run

    def budgeted_trial(trainer: L.Trainer, params: dict) -> None:
        trials[0] += 1
        with MemoryBudget(cap, existing=(trainer.lightning_module, *trainer.optimizers), device="cpu"):
            original(trainer, params)

    finder = BatchSizeFinder(mode=mode)
    batch_size_scaling._try_loop_run = budgeted_trial
    try:
        with tempfile.TemporaryDirectory() as root:
            started = time.perf_counter()
            trainer(root, [finder], max_steps=1).fit(model)
            seconds = time.perf_counter() - started
    finally:
        batch_size_scaling._try_loop_run = original
    return dict(trials=trials[0], steps=steps[0] - 1, seconds=seconds, batch=finder.optimal_batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = []
    for name, (cap_text, samples) in WORKLOADS.items():
        cap = parse_memory(cap_text)
        ours = run_ours(name, samples, cap)
        power = run_lightning(name, samples, cap, "power")
        binsearch = run_lightning(name, samples, cap, "binsearch")
        truth, measured = true_largest_fit(name, samples, cap, ours["batch"])
        for method, figures in (("BatchSizeSearch", ours), ("Lightning power", power), ("Lightning binsearch", binsearch)):
            rows.append((name, cap_text, method, figures, truth))
        rows.append((name, cap_text, "ours / binsearch", dict(
            trials=ours["trials"] / binsearch["trials"], steps=ours["steps"] / binsearch["steps"],
            seconds=ours["seconds"] / binsearch["seconds"], batch=None), truth))  # fmt: skip
    print_and_record(rows, args.no_write)


def _cell(value: Optional[float], ratio: bool) -> str:
    if value is None:
        return ""
    return f"{value:.2f}x" if ratio else (f"{value:.1f}" if isinstance(value, float) else str(value))


def print_and_record(rows: list, no_write: bool) -> None:
    headers = ["model", "cap", "method", "trials", "training steps", "seconds", "batch found", "true largest fit",
               "found / true"]  # fmt: skip
    table = Table(title="BatchSizeSearch vs Lightning BatchSizeFinder (same simulated budget, CPU)")
    for header in headers:
        table.add_column(header)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, cap, method, figures, truth in rows:
        ratio = method.startswith("ours /")
        batch = figures["batch"]
        share = "" if batch is None else f"{batch / truth:.0%}" + (" (OVER: untested or fails)" if batch > truth else "")
        cells = [name, cap, method, _cell(figures["trials"], ratio), _cell(figures["steps"], ratio),
                 f"{figures['seconds']:.2f}x" if ratio else f"{figures['seconds']:.1f}",
                 "" if batch is None else str(batch), "" if ratio else str(truth), share]  # fmt: skip
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=160).print(table)
    if not no_write:
        notes = ("Budget: the same `MemoryBudget(cap)` around every trial of every method (ours with `margin=0`); "
                 "Lightning with its defaults (init_val=2, steps_per_trial=3, binsearch margin 5%). True largest fit: "
                 "bisection over an independent 2-step measurement in a fresh Trainer. Goal: ours <= 1/4 of "
                 "Lightning's training steps and within 90-100% of the true largest fit.")  # fmt: skip
        path = append("search_vs_lightning.py: BatchSizeSearch vs BatchSizeFinder", "\n".join(lines), notes)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
