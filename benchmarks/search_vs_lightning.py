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

On simulated cards (``--device simulated``, the default; ``cpu`` the table above, ``all`` both): 2 cards
(H100, A100) x 4 model families (a small GPT, a convnet, an MLP, a GRU), each in an identical fresh
``SimulatedGpu(card, memory=M)`` (memory counted at the simulated caching allocator, an OOM is
``torch.OutOfMemoryError`` with CUDA's wording); ``--precisions``: 16-mixed and bf16-mixed on the GPT and the
convnet. Ours with its defaults (``BatchSizeSearch()``: the card's usable memory, ``margin="auto"``), Lightning's
``BatchSizeFinder(mode="binsearch")`` with its defaults, nothing wrapped. Truth: the largest size at which a
fresh model and Trainer on a fresh card train one whole shuffled epoch (3.5x the size in samples), by
bisection over that cached check, seeded with the found sizes' checks. Then the fill-memory cost:
``GpuOpt("fill-memory")`` for 20 steps against the same model trained by hand at the batch it chose.

Usage::

    .venv/bin/python benchmarks/search_vs_lightning.py               # 2 simulated cards x 4 families, appended to RESULTS.md
    .venv/bin/python benchmarks/search_vs_lightning.py --precisions  # 16-mixed and bf16-mixed on the convnet and GPT
    .venv/bin/python benchmarks/search_vs_lightning.py --device simulated --no-write --only MLP,GRU
    .venv/bin/python benchmarks/search_vs_lightning.py --smoke     # one tiny model on the simulated card
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append
from models import ResidualConvNet, TokenTransformer
from models_memory import make_model

from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch
from lightning_gpuopt.core.memory import (
    MemoryBudget,
    is_out_of_memory_error,
    parse_memory,
)
from lightning_gpuopt.core.report import format_bytes
from lightning_gpuopt.testing import SimulatedGpu

#: model -> (cap, training samples): caps chosen so the largest fit is tens to a thousand or more
WORKLOADS = {"mlp": ("16MB", 8192), "cnn": ("60MB", 2048), "transformer": ("60MB", 2048)}


def trainer(root: str, callbacks: list, max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


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
        except Exception as error:
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


# ----------------------------------------------------------------------------- simulated cards


class MLPClassifier(L.LightningModule):
    """A 3-layer MLP on synthetic 256-feature vectors (10 classes), Adam."""

    def __init__(self, hidden: int = 1024, num_samples: int = 512, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size, self.num_samples = batch_size, num_samples
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(self.num_samples, 256, generator=generator), torch.randint(0, 10, (self.num_samples,))
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True, generator=generator)


class GRUTagger(L.LightningModule):
    """An embedding, a 1-layer GRU and a per-token head on synthetic token sequences (a tagger), Adam."""

    def __init__(self, width: int = 128, seq_len: int = 32, num_samples: int = 512, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size, self.num_samples, self.seq_len = batch_size, num_samples, seq_len
        self.embedding = torch.nn.Embedding(256, width)
        self.gru = torch.nn.GRU(width, width, batch_first=True)
        self.head = torch.nn.Linear(width, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        hidden, _ = self.gru(self.embedding(batch[0]))
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (self.num_samples, self.seq_len), generator=generator)
        data = torch.utils.data.TensorDataset(tokens, tokens % 16)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True, generator=generator)


@dataclass(frozen=True)
class SimulatedWorkload:
    """A model built by ``make(num_samples=..., batch_size=...)`` on a ``card`` of ``memory`` in ``precision``;
    the searches see ``samples`` training samples (well above twice the largest fit, so that Lightning's
    doubling is not stopped by the data set's length)."""

    name: str
    make: Callable[..., L.LightningModule]
    memory: str
    samples: int
    description: str
    card: str = "H100"
    precision: str = "32-true"


_FAMILIES = [  # (name, make, memory, description): a largest fit of tens to hundreds of samples (MLP: thousands)
    ("small GPT", functools.partial(TokenTransformer, width=128, depth=4), "176MiB", "TokenTransformer(width=128, depth=4, seq_len=32), AdamW"),
    ("convnet", functools.partial(ResidualConvNet, channels=128, depth=2, image_size=8), "96MiB", "ResidualConvNet(channels=128, depth=2, image_size=8), Adam"),
    ("MLP", functools.partial(MLPClassifier, hidden=1024), "128MiB", "MLPClassifier(256 -> 1024 -> 1024 -> 10), Adam"),
    ("GRU", functools.partial(GRUTagger, width=128, seq_len=32), "96MiB", "GRUTagger(width=128, seq_len=32), Adam"),
]  # fmt: skip
#: 2 simulated cards x 4 model families, float32
SIMULATED_WORKLOADS = [
    SimulatedWorkload(name, make, memory, 16384 if name == "MLP" else 2048, description, card)
    for card in ("H100", "A100")
    for name, make, memory, description in _FAMILIES
]
#: mixed precision on the convnet and the transformer (the defaults' >= 0.95 of the truth, without OOM)
PRECISION_WORKLOADS = [
    SimulatedWorkload(name, make, memory, 2048, description, "H100", precision)
    for precision in ("16-mixed", "bf16-mixed")
    for name, make, memory, description in _FAMILIES[:2]
]

#: the smallest setting (``--smoke``, and the test of this script): the two cuBLAS workspaces (forward and
#: autograd threads, 32 MiB each on an H100) are most of the card
SMOKE_WORKLOADS = [
    SimulatedWorkload(
        "tiny-transformer",
        functools.partial(TokenTransformer, width=32, depth=1, seq_len=16),
        "80MiB",
        1024,
        "TokenTransformer(width=32, depth=1, seq_len=16), AdamW",
    ),
]


@dataclass
class EpochCheck:
    """One independent check: a whole shuffled epoch at ``batch_size`` on a fresh card."""

    batch_size: int
    trains: bool
    steps: int
    seconds: float
    peak_reserved: int
    peak_allocated: int


class EpochChecker:
    """``check(b)``: does a fresh model train a whole shuffled epoch at batch ``b`` on a fresh
    ``SimulatedGpu(card, memory)``? The data set holds ``10 * b + b // 2`` samples: ten full batches
    and a short last one (a GRU at the edge of its card first ran out of memory at its 4th step).
    Results are cached; ``checks`` lists the epochs run, in order."""

    def __init__(self, workload: SimulatedWorkload) -> None:
        self.workload = workload
        self.cache: dict[int, EpochCheck] = {}
        self.checks: list[EpochCheck] = []

    def check(self, batch_size: int) -> EpochCheck:
        if batch_size not in self.cache:
            model = self.workload.make(num_samples=10 * batch_size + max(1, batch_size // 2), batch_size=batch_size)
            steps = counting_steps(model)
            started = time.perf_counter()
            trains = True
            with tempfile.TemporaryDirectory() as root, simulated_card(self.workload) as gpu:
                try:
                    epoch_trainer(root, self.workload.precision).fit(model)  # train_dataloader() shuffles
                except Exception as error:
                    if not is_out_of_memory_error(error):
                        raise
                    trains = False
            result = EpochCheck(
                batch_size,
                trains,
                steps[0],
                time.perf_counter() - started,
                gpu.peak_reserved_bytes,
                gpu.peak_allocated_bytes,
            )
            self.cache[batch_size] = result
            self.checks.append(result)
        return self.cache[batch_size]

    def largest_fit(self, upper: int) -> int:
        """The largest size in [1, ``upper``] that trains an epoch: bisection between the largest
        size known to train and the smallest known not to (galloping up from the first when no size
        above it failed yet, halving down when nothing trained yet)."""
        fitted = [b for b, c in self.cache.items() if c.trains]
        while not fitted:
            smallest = min(self.cache, default=upper * 2)
            if smallest == 1:
                return 0
            fitted = [b for b in [max(1, smallest // 2)] if self.check(b).trains]
        low = max(fitted)
        failed = [b for b, c in self.cache.items() if not c.trains and b > low]
        high = min(failed) if failed else None
        step = 1
        while high is None:
            candidate = min(upper, low + step)
            if candidate == low:
                return low
            if self.check(candidate).trains:
                low, step = candidate, step * 2
            else:
                high = candidate
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.check(mid).trains else (low, mid)
        return low


def simulated_card(workload: SimulatedWorkload) -> SimulatedGpu:
    return SimulatedGpu(workload.card, memory=workload.memory)


def epoch_trainer(root: str, precision: str = "32-true", **kwargs: Any) -> L.Trainer:
    options = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return L.Trainer(
        accelerator="cpu", devices=1, precision=precision, default_root_dir=root, enable_model_summary=False,
        **{**options, **kwargs},
    )  # fmt: skip


def fit_catching_oom(trainer: L.Trainer, model: L.LightningModule) -> None:
    """``trainer.fit(model)``; a training step at the size found that runs out of memory ends it (the epoch
    check then says so)."""
    try:
        trainer.fit(model)
    except Exception as error:
        if not is_out_of_memory_error(error):
            raise


def run_ours_simulated(workload: SimulatedWorkload, **search_args: Any) -> dict:
    model = workload.make(num_samples=workload.samples, batch_size=16)
    steps = counting_steps(model)
    search = BatchSizeSearch(verbose=False, **search_args)
    with tempfile.TemporaryDirectory() as root, simulated_card(workload):
        started = time.perf_counter()
        fit_catching_oom(epoch_trainer(root, workload.precision, callbacks=[search], max_steps=1), model)
        seconds = time.perf_counter() - started
    result = search.result
    return dict(
        trials=len(result.trials),
        steps=steps[0] - 1,
        seconds=seconds,
        batch=result.batch_size,
        log=[(t.batch_size, t.fits, t.peak_bytes) for t in result.trials],
        budget=result.budget_bytes,
        predicted=result.predicted_batch_size,
    )


def run_lightning_simulated(workload: SimulatedWorkload, mode: str) -> dict:
    model = workload.make(num_samples=workload.samples, batch_size=2)
    steps = counting_steps(model)
    trials: list[int] = []
    original: Callable = batch_size_scaling._try_loop_run

    def counted_trial(trainer: L.Trainer, params: dict) -> None:
        trials.append(trainer.lightning_module.batch_size)
        original(trainer, params)

    finder = BatchSizeFinder(mode=mode)
    batch_size_scaling._try_loop_run = counted_trial
    try:
        with tempfile.TemporaryDirectory() as root, simulated_card(workload):
            started = time.perf_counter()
            fit_catching_oom(epoch_trainer(root, workload.precision, callbacks=[finder], max_steps=1), model)
            seconds = time.perf_counter() - started
    finally:
        batch_size_scaling._try_loop_run = original
    return dict(trials=len(trials), steps=steps[0] - 1, seconds=seconds, batch=finder.optimal_batch_size, log=trials)


def ratios(ours: dict, binsearch: dict) -> dict:
    """Our trials, training steps and seconds over Lightning's binsearch's (a row of ratios, no batch)."""
    return {key: ours[key] / binsearch[key] for key in ("trials", "steps", "seconds")} | {"batch": None}


METHODS = {
    "BatchSizeSearch()": lambda w: run_ours_simulated(w),
    "Lightning binsearch": lambda w: run_lightning_simulated(w, "binsearch"),
}


def run_simulated(workloads: list[SimulatedWorkload], echo: Callable[[str], None] = print) -> tuple[list, list[str]]:
    """Ours (defaults) and Lightning's binsearch on every workload, each found size checked with a whole
    shuffled epoch on a fresh card, and the truth bisected; one row per workload, and notes."""
    rows, notes = [], []
    for workload in workloads:
        methods = {method: run(workload) for method, run in METHODS.items()}
        checker = EpochChecker(workload)
        for method, figures in methods.items():
            figures["check"] = checker.check(figures["batch"])
            echo(f"{workload.name} {workload.card} {workload.precision} {method}: trials {figures['log']}")
        verifying = len(checker.checks)
        truth = checker.largest_fit(upper=workload.samples)
        methods["truth"] = dict(batch=truth, check=checker.check(truth) if truth else None, epochs=len(checker.checks))
        rows.append((workload, methods))
        ours = methods["BatchSizeSearch()"]
        notes.append(
            f"{workload.name} on {workload.card} {workload.memory}, {workload.precision}: {workload.description}; "
            f"truth {truth} from {len(checker.checks)} epochs ({verifying} checking the found sizes): "
            + ", ".join(f"{c.batch_size} {'trains' if c.trains else 'OOM'}" for c in checker.checks)
            + ". Ours: trials (size, fits, peak) "
            + ", ".join(f"({b}, {'yes' if f else 'no'}, {format_bytes(p) if p else '-'})" for b, f, p in ours["log"])
            + f", predicted {ours['predicted']}; Lightning binsearch's sizes {methods['Lightning binsearch']['log']}."
        )
    return rows, notes


SIMULATED_HEADERS = [
    "model", "card", "precision", "truth", "ours", "Lightning", "ours / truth", "Lightning / truth",
    "ours trains an epoch", "steps ours", "steps Lightning", "steps ratio", "s ours", "s Lightning", "s ratio",
]  # fmt: skip


def simulated_cells(workload: SimulatedWorkload, methods: dict) -> list[str]:
    ours, theirs, truth = methods["BatchSizeSearch()"], methods["Lightning binsearch"], methods["truth"]["batch"]
    share = lambda figures: f"{figures['batch'] / truth:.2f}" if truth and figures["batch"] else "n/a"  # noqa: E731
    trains = "yes" if ours["check"].trains else "NO: OOM"
    return [
        workload.name, f"{workload.card} {workload.memory}", workload.precision, str(truth), str(ours["batch"]),
        str(theirs["batch"]), share(ours), share(theirs), trains, str(ours["steps"]), str(theirs["steps"]),
        f"{ours['steps'] / theirs['steps']:.2f}x", f"{ours['seconds']:.1f}", f"{theirs['seconds']:.1f}",
        f"{ours['seconds'] / theirs['seconds']:.2f}x",
    ]  # fmt: skip


def markdown_table(title: str, headers: list[str], rows: list[list[str]]) -> list[str]:
    table = Table(title=title)
    for header in headers:
        table.add_column(header)
    for cells in rows:
        table.add_row(*cells)
    Console(width=220).print(table)
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(c) + " |" for c in rows),
    ]


def print_and_record_simulated(
    rows: list, notes: list[str], no_write: bool, wall_seconds: float, costs: Optional[list] = None
) -> None:
    title = "BatchSizeSearch() vs Lightning BatchSizeFinder(mode='binsearch') on simulated cards (CPU)"
    lines = markdown_table(title, SIMULATED_HEADERS, [simulated_cells(w, m) for w, m in rows])
    if costs:
        lines += [
            "",
            *markdown_table(COST_TITLE, COST_HEADERS, costs),
        ]
    for note in notes:
        print(note)
    if not no_write:
        text = (
            "Every method in an identical fresh `SimulatedGpu(card, memory=M)` on a CPU Trainer (memory counted at "
            "the simulated caching allocator, cuBLAS workspace, CUDA's OOM). Ours with its defaults "
            "(`BatchSizeSearch()`: max_memory None = the card's usable memory, margin 'auto': room for 1/32 more "
            "samples at the measured bytes per sample); Lightning's `BatchSizeFinder(mode='binsearch')` with its "
            "defaults (init_val=2, steps_per_trial=3, margin 5%). Truth: the largest size at which a fresh model and "
            "Trainer on a fresh card train one whole shuffled epoch (`max_epochs=1`, 10.5x the size in samples: "
            "ten full batches and a short last one), by bisection over that cached check. 'ours trains an epoch': "
            "the same check at our size. Steps: `training_step` calls on real tensors (failed trials included; the "
            "fake-tensor estimate is none). Seconds: the fit (search + one training step). Fill-memory cost: "
            "`GpuOpt('fill-memory')` (the preset as shipped: MemoryFill, MemoryEstimator, DataWaitMonitor) for "
            f"{COST_STEPS} steps against the same model trained by hand at the micro-batch it chose, no callbacks; "
            "'added' = the difference, in seconds and in training steps at that size (the by-hand run's median "
            f"step). Wall time: {wall_seconds:.0f} s, on this 2-core CPU machine, loaded by other work: the seconds "
            "are noisy, the steps are not.\n\n" + "\n\n".join(notes)
        )
        title = "mixed precision" if rows and rows[0][0].precision != "32-true" else "2 simulated cards"
        path = append(f"search_vs_lightning.py: defaults vs BatchSizeFinder, {title}", "\n".join(lines), text)
        print(f"appended to {path}")


COST_STEPS = 20
COST_TITLE = "GpuOpt('fill-memory') cost against the same settings by hand"
COST_HEADERS = [
    "model", "card", "batch chosen", "GpuOpt s", "by hand s", "added s", "added, in steps at that size",
    "estimates s", "trials s", "added - estimates, in steps",
]  # fmt: skip


class StepTimer(L.Callback):
    """Seconds of each training step (batch start to batch end)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def fill_memory_cost(workload: SimulatedWorkload) -> list[str]:
    """``GpuOpt("fill-memory")`` for ``COST_STEPS`` steps against the same settings by hand, on the same card."""
    from lightning_gpuopt import GpuOpt

    def timed(callbacks: list, batch_size: int) -> float:
        model = workload.make(num_samples=workload.samples, batch_size=batch_size)
        with tempfile.TemporaryDirectory() as root, simulated_card(workload):
            started = time.perf_counter()
            epoch_trainer(root, workload.precision, callbacks=callbacks, max_steps=COST_STEPS).fit(model)
            return time.perf_counter() - started

    gpuopt, timer = GpuOpt("fill-memory"), StepTimer()
    ours = timed([gpuopt, timer], 16)  # its training steps (the trials set callbacks aside) and the by-hand run's
    plan = gpuopt.report.memory_fill
    chosen = f"{plan.micro_batch_size} x {plan.accumulate_grad_batches}"
    try:
        by_hand = timed([timer], plan.micro_batch_size)
    except torch.OutOfMemoryError:  # the size fill-memory chose does not train by hand: say so, not a cost
        return [workload.name, f"{workload.card} {workload.memory}", chosen, f"{ours:.1f}", "OOM", *["-"] * 5]
    step = sorted(timer.seconds)[len(timer.seconds) // 2]
    added, trials, memory = ours - by_hand, gpuopt.report.batch_size_search.seconds, gpuopt.report.memory
    # MemoryFill's estimate (its plan's time but the search's) and MemoryEstimator's trace (with torchinfo)
    estimates = plan.seconds - trials + (memory.trace_seconds or 0.0) + (memory.torchinfo_seconds or 0.0)
    return [
        workload.name, f"{workload.card} {workload.memory}", chosen,
        f"{ours:.1f}", f"{by_hand:.1f}", f"{added:.1f}", f"{added / step:.1f}",
        f"{estimates:.1f}", f"{trials:.1f}", f"{(added - estimates) / step:.1f}",
    ]  # fmt: skip


def record_costs(costs: list, no_write: bool, wall_seconds: float) -> None:
    """The fill-memory cost table alone (``--cost-only``)."""
    lines = markdown_table(COST_TITLE, COST_HEADERS, costs)
    if not no_write:
        text = (
            f"`GpuOpt('fill-memory')` (the preset as shipped: MemoryFill, MemoryEstimator, DataWaitMonitor) for {COST_STEPS} "
            "steps against the same model trained by hand at the micro-batch it chose, no callbacks, each on a fresh "
            "`SimulatedGpu(card, memory=M)` on a CPU Trainer; 'added' = the difference, in seconds and in training "
            "steps at that size (the median training step of both runs); 'estimates': MemoryFill's plan outside its "
            "search (its estimate's traces) and MemoryEstimator's trace and torchinfo summary; 'trials': the search; "
            f"the goal counts 'added - estimates'. Wall time: {wall_seconds:.0f} s, on this 2-core CPU "
            "machine, loaded by other work: the seconds are noisy."
        )
        print(
            f"appended to {append('search_vs_lightning.py --cost-only: fill-memory cost', chr(10).join(lines), text)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--device",
        choices=("cpu", "simulated", "all"),
        default="simulated",
        help="cpu: MemoryBudget caps; simulated: 2 simulated cards x 4 model families (default); all: both",
    )
    parser.add_argument("--only", default="", help="comma-separated model families of the simulated table")
    parser.add_argument("--precisions", action="store_true", help="the mixed-precision table instead")
    parser.add_argument(
        "--smoke", action="store_true", help="the simulated table on one tiny model only (seconds; never written)"
    )
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="only the fill-memory cost table (the H100 rows; --only picks families)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.smoke:
        started = time.perf_counter()
        rows, notes = run_simulated(SMOKE_WORKLOADS)
        print_and_record_simulated(rows, notes, True, time.perf_counter() - started)
        return
    only = set(filter(None, args.only.split(",")))
    if args.cost_only:
        started = time.perf_counter()
        costs = [fill_memory_cost(w) for w in SIMULATED_WORKLOADS[:4] if not only or w.name in only]
        record_costs(costs, args.no_write, time.perf_counter() - started)
        return
    if args.device in ("cpu", "all"):
        run_cpu(args.no_write)
    if args.device in ("simulated", "all"):
        started = time.perf_counter()
        workloads = PRECISION_WORKLOADS if args.precisions else SIMULATED_WORKLOADS
        rows, notes = run_simulated([w for w in workloads if not only or w.name in only])
        costs = [] if args.precisions else [fill_memory_cost(w) for w in workloads[:4] if not only or w.name in only]
        print_and_record_simulated(rows, notes, args.no_write, time.perf_counter() - started, costs)


def run_cpu(no_write: bool) -> None:
    rows = []
    for name, (cap_text, samples) in WORKLOADS.items():
        cap = parse_memory(cap_text)
        ours = run_ours(name, samples, cap)
        power = run_lightning(name, samples, cap, "power")
        binsearch = run_lightning(name, samples, cap, "binsearch")
        truth, _measured = true_largest_fit(name, samples, cap, ours["batch"])
        for method, figures in (
            ("BatchSizeSearch", ours),
            ("Lightning power", power),
            ("Lightning binsearch", binsearch),
        ):
            rows.append((name, cap_text, method, figures, truth))
        rows.append(
            (
                name,
                cap_text,
                "ours / binsearch",
                ratios(ours, binsearch),
                truth,
            )
        )
    print_and_record(rows, no_write)


def _cell(value: Optional[float], ratio: bool) -> str:
    if value is None:
        return ""
    return f"{value:.2f}x" if ratio else (f"{value:.1f}" if isinstance(value, float) else str(value))


def print_and_record(rows: list, no_write: bool) -> None:
    headers = [
        "model",
        "cap",
        "method",
        "trials",
        "training steps",
        "seconds",
        "batch found",
        "true largest fit",
        "found / true",
    ]
    table = Table(title="BatchSizeSearch vs Lightning BatchSizeFinder (same simulated budget, CPU)")
    for header in headers:
        table.add_column(header)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, cap, method, figures, truth in rows:
        ratio = method.startswith("ours /")
        batch = figures["batch"]
        share = (
            "" if batch is None else f"{batch / truth:.0%}" + (" (OVER: untested or fails)" if batch > truth else "")
        )
        cells = [
            name,
            cap,
            method,
            _cell(figures["trials"], ratio),
            _cell(figures["steps"], ratio),
            f"{figures['seconds']:.2f}x" if ratio else f"{figures['seconds']:.1f}",
            "" if batch is None else str(batch),
            "" if ratio else str(truth),
            share,
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=160).print(table)
    if not no_write:
        notes = (
            "Budget: the same `MemoryBudget(cap)` around every trial of every method (ours with `margin=0`); "
            "Lightning with its defaults (init_val=2, steps_per_trial=3, binsearch margin 5%). True largest fit: "
            "bisection over an independent 2-step measurement in a fresh Trainer. Goal: ours <= 1/4 of "
            "Lightning's training steps and within 90-100% of the true largest fit."
        )
        path = append("search_vs_lightning.py: BatchSizeSearch vs BatchSizeFinder", "\n".join(lines), notes)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
