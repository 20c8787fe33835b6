"""MemoryFill under a fixed memory budget: the largest micro-batch and samples/s for each lever, side by side.

Two models, each trained with Adam on synthetic data (fixed seeds) and a ``batch_size``
attribute that ``train_dataloader()`` reads: a Transformer (``nn.TransformerEncoder``, no
dropout, so the variants compute the same thing) and a CNN of residual blocks
(conv-bn-relu-conv-bn + skip) in an ``nn.Sequential``. One run trains, per model and with the
same global batch (the user's batch, ``--batch-size``) and the same ``max_memory``:

* ``user's default``: no MemoryFill -- the user's batch in one step, float32 (the reference);
* ``plain``: ``MemoryFill(precision=None, activation_checkpointing=False)`` -- micro-batch and accumulation only;
* ``+AMP``: ``MemoryFill(precision="bf16-mixed", activation_checkpointing=False)`` -- bf16-mixed (on CPU too);
* ``+checkpointing``: ``MemoryFill(precision=None, activation_checkpointing=True)``;
* ``+both``: ``MemoryFill(precision="bf16-mixed", activation_checkpointing=True)``;
* ``chosen plan``: ``MemoryFill()`` -- ``precision="auto"`` (bf16 on GPUs, float32 on CPU) and
  ``activation_checkpointing="auto"`` (on when the largest micro-batch would be below 8).

Per variant the table gives the plan (precision, checkpointed blocks, the largest micro-batch its
trials found, micro-batch x accumulation), the peak the trial of the largest fit measured and
the estimate's predicted peak at the micro-batch set (both plan fields), the seconds MemoryFill
took (estimate and trials), and training samples/s over ``--steps`` optimizer steps after
``--warmup`` ones, the search excluded. Every round trains every variant once, in a shuffled
order; samples/s is the median over ``--rounds`` rounds and each ratio the median of the
per-round ratios.

Then memory over real training after the plan ("peak / capacity", goal >= 0.85, and no OOM):

* CPU: ``max_memory`` is simulated (a ``MemoryBudget`` in MemoryFill's trials). In the first
  round, after the timed steps, the rest of the epoch (``--verify-steps`` optimizer steps) trains
  inside a ``MemoryBudget(max_memory)`` -- the same OOM path a CUDA OOM takes. An OOM there is
  shown as "OOM"; peak / capacity is that budget's peak over ``max_memory`` (MemoryFill's trials
  keep to ``1 - margin`` = 0.90 of it; a run above that is noted). The user's default is checked
  the same way, but its samples/s is timed before the check, without a budget, and labelled so.
* GPU (``--accelerator gpu``): nothing is simulated; ``max_memory`` is what the GPU has free (or
  ``--max-memory``, e.g. ``0.9``). Every run trains a whole epoch; peak / capacity is
  ``torch.cuda.max_memory_allocated()`` over the epoch after the plan over the device's
  ``total_memory``, and an OOM is a real CUDA OOM. The models are ``--scale`` times wider and
  longer (default 16 on a GPU; not tuned on hardware when this was written).

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/memory_fill.py                     # appends to RESULTS.md
    PYTHONPATH=. .venv/bin/python benchmarks/memory_fill.py --no-write --rounds 1
    PYTHONPATH=. python benchmarks/memory_fill.py --accelerator gpu   # sized for ~10 min on an H100 (not run there yet)
    PYTHONPATH=. python benchmarks/memory_fill.py --accelerator gpu --batch-size 256   # a user's default that may fit
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append

from lightning_gpuopt.callbacks.batch_size_search import NoBatchSizeFitsError
from lightning_gpuopt.callbacks.memory_fill import MemoryFill
from lightning_gpuopt.core.fill import MemoryFillPlan
from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error, parse_memory
from lightning_gpuopt.core.report import format_bytes

#: variant -> MemoryFill arguments (None: no MemoryFill, the user's own config)
VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "user's default": None,
    "plain": dict(precision=None, activation_checkpointing=False),
    "+AMP": dict(precision="bf16-mixed", activation_checkpointing=False),
    "+checkpointing": dict(precision=None, activation_checkpointing=True),
    "+both": dict(precision="bf16-mixed", activation_checkpointing=True),
    "chosen plan": dict(),
}
#: the simulated max_memory per model on CPU (--scale 1): the plain largest micro-batch is small
#: (< 16; below 8 for the transformer, so activation_checkpointing="auto" turns on there and not for the CNN)
CPU_BUDGETS = {"transformer": "11MB", "cnn": "8MB"}
#: defaults per accelerator. CPU: small models under a simulated budget, steps of tens of ms, a few
#: minutes in all. GPU: models 16x wider and longer (per-sample activations ~256x) and a global batch
#: the free memory of an 80 GB GPU does not hold in float32; not tuned on hardware when written
DEFAULTS = {
    "cpu": dict(scale=1, batch_size=64, rounds=3, warmup=2, steps=10, verify_steps=2),
    "gpu": dict(scale=16, batch_size=1024, rounds=1, warmup=2, steps=3, verify_steps=1),
}
NUM_CLASSES = 10


# ---------------------------------------------------------------------------------------- models


class Classifier(L.LightningModule):
    """``network`` over synthetic ``inputs`` with random labels (fixed seeds), cross-entropy and Adam."""

    def __init__(self, network: nn.Module, inputs: torch.Tensor, batch_size: int) -> None:
        super().__init__()
        self.network = network
        self.inputs = inputs
        self.targets = torch.randint(0, NUM_CLASSES, (len(inputs),), generator=torch.Generator().manual_seed(1))
        self.batch_size = batch_size  # read by train_dataloader(): what MemoryFill resizes

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.network(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.inputs, self.targets), batch_size=self.batch_size, shuffle=False)


class TokenTransformer(nn.Module):
    """Embedding + ``nn.TransformerEncoder`` (repeated ``TransformerEncoderLayer`` blocks) + mean pool + head."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)).mean(dim=1))


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn + skip, then relu."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + x)


class ResidualCNN(nn.Module):
    """A conv-bn-relu stem, ``nn.Sequential`` of residual blocks, pool, head; uint8 images in (a
    quarter of the host memory and copy of float ones), scaled to [0, 1] on the device."""

    def __init__(self, channels: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, NUM_CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images.float() / 255)))


def make_model(name: str, scale: int, samples: int, batch_size: int) -> Classifier:
    """``"transformer"``: width 64*scale, sequences of 32*scale tokens, 6 layers; ``"cnn"``: 16
    channels, 8 residual blocks, images of (16*scale)^2 pixels. The same weights every call."""
    if name not in ("transformer", "cnn"):
        raise ValueError(f"unknown model {name!r}; expected 'transformer' or 'cnn'")
    torch.manual_seed(0)
    if name == "transformer":
        width = 64 * scale
        network: nn.Module = TokenTransformer(vocab=1000, width=width, heads=max(4, width // 64), layers=6)
    else:
        network = ResidualCNN(channels=16, blocks=8)
    return Classifier(network, synthetic_inputs(name, scale, samples), batch_size)


@functools.lru_cache(maxsize=2)
def synthetic_inputs(name: str, scale: int, samples: int) -> torch.Tensor:
    """Token ids or uint8 images (fixed seed), made once and shared by every run (read only)."""
    generator = torch.Generator().manual_seed(0)
    if name == "transformer":
        return torch.randint(0, 1000, (samples, 32 * scale), generator=generator)
    return torch.randint(0, 256, (samples, 3, 16 * scale, 16 * scale), generator=generator, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------- measuring


class Meter(L.Callback):
    """Times optimizer steps ``[warmup, warmup + steps)`` of real training (CUDA synchronised at both
    ends; micro-batches of accumulation included) and measures the memory of the epoch:

    * ``cap`` (CPU): from the end of the timed steps to the end of training, a ``MemoryBudget(cap)``
      counting the model, its gradients and the optimizer state: an OOM past it ends the fit;
    * on CUDA: ``max_memory_allocated`` from train start (after MemoryFill's trials) to train end.
    """

    def __init__(self, warmup: int, steps: int, cap: Optional[int]) -> None:
        self.warmup, self.steps, self.cap = warmup, steps, cap
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.samples = 0
        self.budget: Optional[MemoryBudget] = None
        self.peak_bytes: Optional[int] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and self.started is None:
            _synchronize(pl_module)
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.started is None or self.ended is not None:
            return
        self.samples += len(batch[0])
        if trainer.global_step == self.warmup + self.steps:  # the last timed optimizer step is done
            _synchronize(pl_module)
            self.ended = time.perf_counter()
            if self.cap is not None:
                self.budget = MemoryBudget(self.cap, existing=(pl_module, *trainer.optimizers), device="cpu")
                self.budget.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._leave()
        if self.started is not None and self.ended is None:  # the epoch ended first (a short last group)
            _synchronize(pl_module)
            self.ended = time.perf_counter()
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._leave()
        if pl_module.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated()

    def _leave(self) -> None:
        if self.budget is not None:
            budget, self.budget = self.budget, None
            budget.__exit__(None, None, None)
            self.peak_bytes = budget.peak_bytes

    @property
    def samples_per_second(self) -> Optional[float]:
        if self.started is None or self.ended is None:
            return None
        return self.samples / (self.ended - self.started)


def _synchronize(pl_module: Any) -> None:
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Run:
    """One variant's fit in one round."""

    plan: Optional[MemoryFillPlan]
    samples_per_second: Optional[float]
    #: peak over training after the plan (CPU: inside the verifying budget; CUDA: the epoch)
    peak_bytes: Optional[int]
    #: an OOM in training after the plan; None: not checked (CPU rounds after the first)
    oom: Optional[bool]
    error: str = ""


def run_one(name: str, variant: str, args: argparse.Namespace, max_memory: Any, verify: bool, root: str) -> Run:
    cuda = args.accelerator != "cpu"
    total_steps = args.warmup + args.steps + args.verify_steps
    model = make_model(name, args.scale, samples=args.batch_size * total_steps, batch_size=args.batch_size)
    cap = parse_memory(max_memory, "cpu") if verify and not cuda else None
    meter = Meter(args.warmup, args.steps, cap)
    fill_arguments = VARIANTS[variant]
    fill = (
        None
        if fill_arguments is None
        else MemoryFill(global_batch_size=args.batch_size, max_memory=max_memory, verbose=False, **fill_arguments)
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=1,
        max_steps=-1 if verify else args.warmup + args.steps,
        callbacks=[*([fill] if fill else []), meter],
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    oom, error = (False if verify else None), ""
    try:
        trainer.fit(model)
    except NoBatchSizeFitsError as raised:
        error = f"nothing fits: {raised}"
    except Exception as raised:
        if not is_out_of_memory_error(raised):
            raise
        oom = True
    run = Run(fill.plan if fill else None, meter.samples_per_second, meter.peak_bytes, oom, error)
    del trainer, model, fill, meter
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return run


# ---------------------------------------------------------------------------------------- the run


def measure_model(name: str, args: argparse.Namespace, max_memory: Any) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {variant: [] for variant in VARIANTS}
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(args.rounds):
            variants = list(VARIANTS)
            order.shuffle(variants)
            verify = args.accelerator != "cpu" or round_index == 0
            for variant in variants:
                started = time.perf_counter()
                run = run_one(name, variant, args, max_memory, verify, root)
                runs[variant].append(run)
                plan = run.plan
                described = (
                    ""
                    if plan is None
                    else (
                        f"{plan.precision}, {len(plan.checkpointed_modules)} ckpt, "
                        f"largest {plan.largest_fit}, {plan.micro_batch_size} x "
                        f"{plan.accumulate_grad_batches}, "
                    )
                )
                speed = "n/a" if run.samples_per_second is None else f"{run.samples_per_second:,.0f} samples/s"
                print(
                    f"  {name} round {round_index + 1}/{args.rounds} {variant}: {described}{speed}"
                    f"{', OOM' if run.oom else ''}{', ' + run.error[:80] if run.error else ''} "
                    f"({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
    return runs


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _ratios(runs: list[Run], reference: list[Run]) -> Optional[float]:
    """Median over rounds of samples/s relative to the reference variant in the same round."""
    return _median(
        [
            None
            if r.samples_per_second is None or not ref.samples_per_second
            else r.samples_per_second / ref.samples_per_second
            for r, ref in zip(runs, reference)
        ]
    )


def _plan_key(plan: Optional[MemoryFillPlan]) -> Optional[tuple]:
    if plan is None:
        return None
    return (
        plan.precision,
        len(plan.checkpointed_modules),
        plan.largest_fit,
        plan.micro_batch_size,
        plan.accumulate_grad_batches,
    )


def table_rows(
    name: str, runs: dict[str, list[Run]], args: argparse.Namespace, capacity: int
) -> tuple[list[list[str]], list[str]]:
    """Cells per variant, and notes (plans that differed between rounds, peaks above the trials' target)."""
    cuda = args.accelerator != "cpu"
    rows, notes = [], []
    plain_plan = runs["plain"][0].plan
    for variant, variant_runs in runs.items():
        first = variant_runs[0]
        plan = first.plan
        keys = {_plan_key(run.plan) for run in variant_runs}
        if len(keys) > 1:
            notes.append(f"{name} {variant}: the plan differed between rounds: {sorted(keys, key=str)}")
        speed = _median([run.samples_per_second for run in variant_runs])
        verified = [run for run in variant_runs if run.oom is not None]
        oom = any(run.oom for run in verified)
        peaks = [run.peak_bytes for run in verified if run.peak_bytes is not None and not run.oom]
        peak_share = "" if not peaks or oom else f"{max(peaks) / capacity:.2f}"
        if plan is not None and not cuda and peaks and not oom and max(peaks) > plan.budget_bytes:
            notes.append(
                f"{name} {variant}: training at {plan.micro_batch_size} x {plan.accumulate_grad_batches} "
                f"peaked at {format_bytes(max(peaks))}, above the {format_bytes(plan.budget_bytes)} "
                f"(max_memory less the margin) that its trial of {plan.largest_fit} kept to "
                f"({format_bytes(plan.measured_peak_bytes)})."
            )
        speed_cell = "n/a" if speed is None else f"{speed:,.0f}"
        if plan is None and not cuda and speed is not None:
            speed_cell += " (no budget)"
        largest = "—"
        if plan is not None and plan.largest_fit is not None:
            largest = str(plan.largest_fit) + (
                " (= global batch: the cap)" if plan.largest_fit >= args.batch_size else ""
            )
        largest_ratio = "—"
        if plan is not None and plain_plan is not None and plan.largest_fit and plain_plan.largest_fit:
            largest_ratio = f"{plan.largest_fit / plain_plan.largest_fit:.2f}x"
        vs_plain, vs_user = _ratios(variant_runs, runs["plain"]), _ratios(variant_runs, runs["user's default"])
        rows.append(
            [
                name,
                variant,
                plan.precision if plan else "32-true",
                str(len(plan.checkpointed_modules)) if plan else "0",
                largest,
                f"{plan.micro_batch_size} × {plan.accumulate_grad_batches}" if plan else f"{args.batch_size} × 1",
                format_bytes(plan.measured_peak_bytes) if plan else "—",
                format_bytes(plan.predicted_peak_bytes) if plan else "—",
                f"{statistics.median(run.plan.seconds for run in variant_runs if run.plan):.1f}" if plan else "—",
                speed_cell,
                "n/a" if vs_plain is None else f"{vs_plain:.2f}x",
                "n/a" if vs_user is None else f"{vs_user:.2f}x",
                largest_ratio,
                peak_share,
                first.error[:60] if first.error else ("OOM" if oom else ("no" if verified else "not checked")),
            ]
        )
    return rows, notes


HEADERS = [
    "model",
    "variant",
    "precision",
    "ckpt blocks",
    "largest micro-batch",
    "micro × accum",
    "trial peak (at largest)",
    "predicted peak (at micro)",
    "search s",
    "samples/s",
    "÷ plain",
    "÷ user's default",
    "largest ÷ plain",
    "peak / capacity",
    "OOM",
]


def print_and_record(
    rows: list[list[str]], notes: list[str], args: argparse.Namespace, budgets: dict[str, Any], seconds: float
) -> None:
    cuda = args.accelerator != "cpu"
    table = Table(title=f"MemoryFill: levers under a fixed budget ({args.accelerator}), global batch {args.batch_size}")
    for header in HEADERS:
        table.add_column(header)
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for cells in rows:
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=240).print(table)
    budget_text = ", ".join(
        f"{name} {budget if budget is not None else 'free GPU memory'}" for name, budget in budgets.items()
    )
    memory_note = (
        "peak / capacity: `torch.cuda.max_memory_allocated()` over an epoch of real training after the plan "
        "/ the GPU's total memory (goal >= 0.85); OOM: a real CUDA OOM in that epoch."
        if cuda
        else f"max_memory is simulated (MemoryBudget in MemoryFill's trials, margin 0.1). peak / capacity: in round 1, "
        f"the {args.verify_steps} optimizer steps after the timed ones trained inside `MemoryBudget(max_memory)`; its "
        "peak / max_memory (MemoryFill's trials keep to 0.90 of it: max_memory less the margin); OOM: that budget raised. The user's default is "
        "checked the same way, but its samples/s (and so every '÷ user's default') is timed before, without a "
        "budget: a reference, not a run that fits."
    )
    summary = (
        f"Models (--scale {args.scale}): Transformer 6 x TransformerEncoderLayer(width {64 * args.scale}, "
        f"{32 * args.scale} tokens, no dropout); CNN 8 residual conv-bn-relu-conv-bn blocks, 16 channels, "
        f"{16 * args.scale}x{16 * args.scale} uint8 images; Adam, synthetic data. max_memory: {budget_text}. The user's "
        f"default: batch {args.batch_size}, no accumulation, 32-true; every MemoryFill variant: "
        f"global_batch_size={args.batch_size}. samples/s: median of {args.rounds} interleaved rounds over "
        f"{args.steps} optimizer steps after {args.warmup} (search excluded; 'search s' is MemoryFill's estimate + "
        f"trials); ratios: medians of per-round ratios. {memory_note} Wall time: {seconds:.0f} s."
    )
    for note in [summary, *notes]:
        print(note)
    if not args.no_write:
        path = append(
            f"memory_fill.py: MemoryFill levers under a fixed budget ({args.accelerator})",
            "\n".join(lines),
            "\n\n".join([summary, *notes]),
        )
        print(f"appended to {path}")


def _memory_argument(text: Optional[str]) -> Union[float, str, None]:
    if text is None:
        return None
    try:
        return float(text)  # a fraction of the device
    except ValueError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", help="cpu (simulated budget) or gpu")
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--batch-size", type=int, help="the user's batch, also every variant's global batch")
    parser.add_argument(
        "--max-memory", help="bytes, '20GiB' or a fraction; default: per-model budgets on CPU, the free memory on a GPU"
    )
    parser.add_argument("--scale", type=int, help="model size factor (width and sequence length / image side)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, help="optimizer steps before timing")
    parser.add_argument("--steps", type=int, help="timed optimizer steps")
    parser.add_argument(
        "--verify-steps",
        type=int,
        help="optimizer steps after the timed ones (CPU: trained "
        "inside MemoryBudget(max_memory) in round 1; GPU: the rest of the epoch)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    cuda = args.accelerator != "cpu"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--accelerator {args.accelerator} but torch sees no CUDA device")
    for option, value in DEFAULTS["gpu" if cuda else "cpu"].items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    if not cuda:
        torch.set_num_threads(1)  # a steady measurement on a shared machine
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    started = time.perf_counter()
    rows, notes, budgets = [], [], {}
    for name in args.models.split(","):
        max_memory = _memory_argument(args.max_memory)
        if max_memory is None and not cuda:
            if args.scale != 1:
                parser.error("on CPU with --scale other than 1, pass --max-memory (the default budgets fit scale 1)")
            max_memory = CPU_BUDGETS[name]
        budgets[name] = max_memory
        capacity = torch.cuda.get_device_properties(0).total_memory if cuda else parse_memory(max_memory, "cpu")
        parameters = sum(p.numel() for p in make_model(name, args.scale, samples=1, batch_size=1).parameters())
        notes.append(
            f"{name}: {parameters:,} parameters; float32 weights + gradients + Adam's two moments = "
            f"{format_bytes(16 * parameters)}, {16 * parameters / capacity:.0%} of the "
            f"{'GPU' if cuda else 'max_memory'} before any activation."
        )
        model_rows, model_notes = table_rows(name, measure_model(name, args, max_memory), args, capacity)
        rows += model_rows
        notes += model_notes
    print_and_record(rows, notes, args, budgets, time.perf_counter() - started)


if __name__ == "__main__":
    main()
