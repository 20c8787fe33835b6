"""Out-of-memory recovery: variable-length data with rare long samples under a memory cap.

A plan made on the first batches cannot see a rare long sequence. Four runs on the same samples
in the same order, under the same cap (a ``MemoryBudget`` held over training on CPU, the cap
MemoryFill planned with):

* ``on_oom="raise"``: MemoryFill plans on a stream (an IterableDataset: the first batches are all
  it sees); the first batch with a long sample runs out of memory and the run dies;
* ``on_oom="adapt"``: the same, but the failed batch is trained again as smaller accumulated
  micro-batches, kept for samples that long; the run finishes;
* ``planned on the longest``: the micro-batch a user would plan for the longest sample from the
  start -- the largest divisor of the batch whose plain step on the long samples fits the cap,
  measured by hand -- with gradient accumulation for the rest of the batch, for every step;
* ``truth``: a loop written by hand that trains the same batches unsplit without a cap.

Recorded: whether each run finished (and where it died), the steps adapted, samples/s of the
training steps, and the final weights' largest distance to the truth (absolute, and relative to
the largest weight of that tensor).

Run::

    PYTHONPATH=. .venv/bin/python benchmarks/oom_recovery.py            # appends to RESULTS.md
    PYTHONPATH=. .venv/bin/python benchmarks/oom_recovery.py --smoke    # tiny, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from lightning import Callback, LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append

from lightning_gpuopt import MemoryFill
from lightning_gpuopt.core.memory import MemoryBudget
from lightning_gpuopt.core.report import format_bytes


@dataclass
class Setting:
    samples: int
    long_samples: int
    batch_size: int
    short: int
    long: int
    features: int = 8
    hidden: int = 256


FULL = Setting(samples=2048, long_samples=4, batch_size=32, short=16, long=256)
SMOKE = Setting(samples=96, long_samples=2, batch_size=16, short=8, long=64, features=4, hidden=64)


# ---------------------------------------------------------------------- data and model


def make_samples(setting: Setting, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """Short sequences, and ``long_samples`` long ones spread over the second half of the epoch."""
    generator = torch.Generator().manual_seed(seed)
    step = setting.samples // 2 // max(1, setting.long_samples)
    long_at = {setting.samples // 2 + 3 + k * step for k in range(setting.long_samples)}
    return [
        (
            torch.randn(setting.long if index in long_at else setting.short, setting.features, generator=generator),
            int(torch.randint(0, 10, (), generator=generator)),
        )
        for index in range(setting.samples)
    ]


class Samples(Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


class Stream(IterableDataset):
    """The same samples as a stream: no sizes to look at ahead."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def pad_collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = nn.utils.rnn.pad_sequence([tokens for tokens, _ in samples], batch_first=True)
    return tokens, torch.tensor([label for _, label in samples])


class TokenModel(LightningModule):
    """A per-token MLP, mean over the real tokens (padding, all zeros, masked out), a classifier:
    memory grows with batch x padded length; the loss does not depend on the padding."""

    def __init__(self, setting: Setting, data: Dataset, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.data, self.batch_size = data, batch_size
        self.tokens = nn.Sequential(
            nn.Linear(setting.features, setting.hidden), nn.Tanh(), nn.Linear(setting.hidden, setting.hidden), nn.Tanh()
        )
        self.head = nn.Linear(setting.hidden, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        real = (tokens != 0).any(dim=-1, keepdim=True).to(tokens.dtype)
        return self.head((self.tokens(tokens) * real).sum(dim=1) / real.sum(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self(tokens), labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False, collate_fn=pad_collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


# ---------------------------------------------------------------------- measuring


class CapAndClock(Callback):
    """The cap over the training steps (a MemoryBudget), a clock from the first step to the end,
    the samples trained and the step an exception ended the run at."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.budget: Optional[MemoryBudget] = None
        self.started = self.ended = 0.0
        self.samples = 0
        self.died_at: Optional[int] = None
        self.error = ""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.budget = MemoryBudget(self.cap, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.samples += len(batch[1])

    def _leave(self) -> None:
        self.ended = time.perf_counter()
        budget, self.budget = self.budget, None
        if budget is not None:
            budget.__exit__(None, None, None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._leave()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.died_at, self.error = trainer.global_step, f"{type(exception).__name__}"
        self._leave()


@dataclass
class Run:
    name: str
    finished: bool
    died_at: Optional[int] = None
    steps: int = 0
    samples_per_second: Optional[float] = None
    adapted_steps: list[int] = field(default_factory=list)
    adaptations: list[str] = field(default_factory=list)
    plan: str = ""
    weights: Optional[dict[str, torch.Tensor]] = None


def peak_of_plain_step(setting: Setting, batch: Any) -> int:
    """Peak bytes of two plain training steps of ``batch`` (the momentum buffers exist in the second)."""
    model = TokenModel(setting, Samples([]), 1)
    optimizer = model.configure_optimizers()
    with MemoryBudget(10**12, existing=(model, optimizer), device="cpu") as meter:
        for _ in range(2):
            optimizer.zero_grad()
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            optimizer.step()
    return meter.peak_bytes


def run_fill(name: str, setting: Setting, data: Dataset, cap: int, on_oom: str, steps: int, root: str) -> Run:
    model = TokenModel(setting, data, setting.batch_size)
    fill = MemoryFill(
        global_batch_size=setting.batch_size,
        max_memory=cap,
        margin=0.1,
        activation_checkpointing=False,
        on_oom=on_oom,
        verbose=False,
    )
    clock = CapAndClock(cap)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[fill, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    with contextlib.suppress(torch.OutOfMemoryError):
        trainer.fit(model)
    plan = fill.plan
    run = Run(name, finished=clock.died_at is None, died_at=clock.died_at, steps=trainer.global_step)
    if plan is not None:
        run.plan = f"micro-batch {plan.micro_batch_size} x {plan.accumulate_grad_batches}"
        run.adapted_steps = sorted({a.step for a in plan.oom_adaptations})
        run.adaptations = [
            f"step {a.step}: {a.old_micro_batch_size} → {a.new_micro_batch_size}" for a in plan.oom_adaptations
        ]
    if run.finished:
        run.samples_per_second = clock.samples / (clock.ended - clock.started)
        run.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def largest_micro_batch_for_the_longest(setting: Setting, items: list, cap: int) -> int:
    """The largest divisor of the batch whose plain step, on micro-batches holding a long sample, fits 90% of ``cap``."""
    long_index = next(i for i, (tokens, _) in enumerate(items) if len(tokens) == setting.long)
    for size in sorted((d for d in range(1, setting.batch_size + 1) if setting.batch_size % d == 0), reverse=True):
        if peak_of_plain_step(setting, pad_collate(items[long_index : long_index + size])) <= 0.9 * cap:
            return size
    raise RuntimeError("not even one long sample fits the cap: choose a larger cap")


def run_planned(setting: Setting, items: list, cap: int, steps: int, micro: int, root: str) -> Run:
    """Lightning at ``micro`` x accumulation from the start, under the cap (no MemoryFill)."""
    model = TokenModel(setting, Samples(items), micro)
    clock = CapAndClock(cap)
    accumulate = setting.batch_size // micro
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        accumulate_grad_batches=accumulate,
    )
    with contextlib.suppress(torch.OutOfMemoryError):
        trainer.fit(model)
    run = Run(
        "planned on the longest sample from the start",
        finished=clock.died_at is None,
        died_at=clock.died_at,
        steps=trainer.global_step,
        plan=f"micro-batch {micro} x {accumulate}",
    )
    if run.finished:
        run.samples_per_second = clock.samples / (clock.ended - clock.started)
        run.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def run_truth(setting: Setting, items: list, steps: int) -> Run:
    model = TokenModel(setting, Samples(items), setting.batch_size)
    optimizer = model.configure_optimizers()
    batches = iter(model.train_dataloader())
    started = time.perf_counter()
    for _ in range(steps):
        tokens, labels = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(tokens), labels).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    return Run(
        "truth: unsplit by hand, no cap",
        True,
        steps=steps,
        samples_per_second=steps * setting.batch_size / seconds,
        weights={k: v.detach().clone() for k, v in model.state_dict().items()},
    )


def distance(weights: Optional[dict], truth: dict) -> tuple[Optional[float], Optional[float]]:
    """Largest absolute difference, and largest difference relative to the tensor's largest weight."""
    if weights is None:
        return None, None
    absolute = max((weights[k] - truth[k]).abs().max().item() for k in truth)
    relative = max(((weights[k] - truth[k]).abs().max() / truth[k].abs().max().clamp_min(1e-30)).item() for k in truth)
    return absolute, relative


def measure(setting: Setting, root: str) -> tuple[list[Run], dict[str, Any]]:
    items = make_samples(setting)
    steps = setting.samples // setting.batch_size
    short = pad_collate(items[: setting.batch_size])
    long_index = next(i for i, (tokens, _) in enumerate(items) if len(tokens) == setting.long)
    long = pad_collate(items[long_index - long_index % setting.batch_size :][: setting.batch_size])
    short_peak, long_peak = peak_of_plain_step(setting, short), peak_of_plain_step(setting, long)
    # a cap (less MemoryFill's 10% margin) that holds the short batches with room to spare, not a long one
    cap = int(min(2 * short_peak, (short_peak + long_peak) / 2) / 0.9)
    truth = run_truth(setting, items, steps)
    runs = [
        run_fill("MemoryFill(on_oom='raise'), planned on a stream", setting, Stream(items), cap, "raise", steps, root),
        run_fill("MemoryFill(on_oom='adapt'), planned on a stream", setting, Stream(items), cap, "adapt", steps, root),
        run_planned(setting, items, cap, steps, largest_micro_batch_for_the_longest(setting, items, cap), root),
        truth,
    ]
    figures = dict(
        cap=cap,
        short_peak=short_peak,
        long_peak=long_peak,
        steps=steps,
        long_index=long_index,
        long_step=long_index // setting.batch_size,
    )
    return runs, figures


# ---------------------------------------------------------------------- reporting


def table(runs: list[Run], truth: Run) -> str:
    longest = next((run for run in runs if "longest" in run.name), None)
    lines = [
        "| run | finished | steps | plan | steps adapted | samples/s | vs planned on the longest | "
        "max abs distance to truth | max relative distance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        absolute, relative = distance(run.weights, truth.weights) if run is not truth else (None, None)
        speed = f"{run.samples_per_second:.0f}" if run.samples_per_second else "—"
        ratio = (
            f"{run.samples_per_second / longest.samples_per_second:.2f}x"
            if run.samples_per_second and longest and longest.samples_per_second and run is not truth
            else ""
        )
        finished = "yes" if run.finished else f"no: OOM at step {run.died_at}"
        lines.append(
            f"| {run.name} | {finished} | {run.steps} | {run.plan or '—'} | "
            f"{', '.join(map(str, run.adapted_steps)) or '—'} | {speed} | {ratio} | "
            f"{'' if absolute is None else f'{absolute:.1e}'} | {'' if relative is None else f'{relative:.1e}'} |"
        )
    return "\n".join(lines)


def notes(setting: Setting, figures: dict[str, Any], runs: list[Run], wall_s: float) -> str:
    adapted = next(run for run in runs if "adapt" in run.name)
    return (
        f"{setting.samples} sequences of {setting.features}-dim tokens, {setting.short} tokens long except "
        f"{setting.long_samples} of {setting.long} (the first at sample {figures['long_index']}, in step "
        f"{figures['long_step']}); batches of {setting.batch_size} padded to their longest; a per-token MLP "
        f"(hidden {setting.hidden}), mean over the real tokens (the loss does not depend on padding), SGD with momentum, {figures['steps']} steps, one epoch, "
        f"the same order in every run. Cap {format_bytes(figures['cap'])} (MemoryFill's max_memory, and a MemoryBudget "
        f"held over the training steps), set from plain steps measured by hand: a short batch peaks at "
        f"{format_bytes(figures['short_peak'])}, the first batch with a long sample at {format_bytes(figures['long_peak'])}. "
        f"'planned on a stream': an IterableDataset, so MemoryFill's trials see only the first batches; 'planned on "
        f"the longest sample': Lightning with the largest micro-batch (a divisor of the batch) whose plain step on the "
        f"long samples fits 90% of the cap, measured by hand, and accumulation for the rest. Adaptations: "
        f"{'; '.join(adapted.adaptations) or 'none'}. samples/s: samples trained / seconds from the first training step "
        f"to the end (recovery included; the truth is a plain loop without Lightning or a cap). Distance: final weights "
        f"against the truth (float32; the split sums in another order). On CPU every op pays the MemoryBudget's "
        f"bookkeeping (a dispatch mode), so more, smaller micro-batches cost more per sample than they would on a GPU: "
        f"the samples/s ratio is this machine's. Wall time: {wall_s:.0f} s."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting; prints, writes nothing")
    parser.add_argument("--no-write", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    setting = SMOKE if args.smoke else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        runs, figures = measure(setting, root)
    truth = runs[-1]
    text = table(runs, truth)
    note = notes(setting, figures, runs, time.perf_counter() - started)
    print(text)
    print()
    print(note)
    if not (args.smoke or args.no_write):
        print(f"appended to {append('Out-of-memory recovery: rare long samples under a cap', text, note)}")


if __name__ == "__main__":
    main()
