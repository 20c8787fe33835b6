"""Shared by the benchmark scripts: the machine description, appending to RESULTS.md, and a
stopwatch callback that times training steps the same way in every variant."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning import Callback, LightningModule
from torch import nn
from torch.utils.data import Dataset

from lightning_gpuopt.core.loader import usable_cpu_count

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    cores = usable_cpu_count()  # the CPU affinity within the cgroup CPU quota: what the tuner counts
    device = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {cores} usable cores, {device}; torch {torch.__version__}"


def command() -> str:
    return " ".join(shlex.quote(arg) for arg in [Path(sys.executable).name, *sys.argv])


def append(title: str, markdown_table: str, notes: str = "") -> Path:
    """Append a dated section to benchmarks/RESULTS.md (never rewrites earlier sections)."""
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section was appended by the script it names.\n")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"\n## {title} — {stamp}\n\n- machine: {machine()}\n- command: `{command()}`\n\n{markdown_table}\n"
    if notes:
        section += f"\n{notes}\n"
    with RESULTS.open("a") as handle:
        handle.write(section)
    return RESULTS


class LatencyDataset(Dataset):
    """Tensors served one sample at a time, each ``__getitem__`` sleeping ``delay_s`` (a read from disk or network)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor, delay_s: float) -> None:
        self.features, self.labels, self.delay_s = features, labels, delay_s

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.features[index], self.labels[index]


class Stopwatch(Callback):
    """Times training from the start of step ``first_step`` to the end of training (CUDA synchronised
    at both ends), and counts the steps and samples in between."""

    def __init__(self, first_step: int, clock: Any = time.perf_counter) -> None:
        self.first_step, self.clock = first_step, clock
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.steps = 0
        self.samples = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.first_step and self.started is None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize()
            self.started = self.clock()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.started is not None:
            self.steps += 1
            self.samples += len(batch[0])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.ended = self.clock()

    @property
    def step_time_s(self) -> float:
        return (self.ended - self.started) / self.steps

    @property
    def samples_per_second(self) -> float:
        return self.samples / (self.ended - self.started)


class MLP(LightningModule):
    """The benchmarks' model: features -> hidden -> hidden -> 10, SGD; logs its loss every step
    when ``log_loss``."""

    def __init__(self, features: int, hidden: int, log_loss: bool = True) -> None:
        super().__init__()
        self.log_loss = log_loss
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
