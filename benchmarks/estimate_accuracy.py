"""How close is the predicted peak memory of a training step to the measured one, and torchinfo's?

For each model x batch size a real ``Trainer.fit`` runs with :class:`MemoryEstimator`: it
predicts the peak before the first step (a fake-tensor trace, with the kernel workspaces learned
from a small real step on the host; torchinfo alongside) and measures it over the first real steps
(CPU: memory counted at the allocator by a dispatch mode, kernel workspaces included; CUDA: the caching
allocator's peak counter, reset as measuring starts). The table shows both relative errors ``(predicted - measured) / measured``
and the seconds each estimate took; a dated section is appended to ``benchmarks/RESULTS.md``
(``--no-write`` skips it).

The table also shows an independent allocator-level peak, and our error against it: on CPU, one more
steady-state step, every allocation and free the CPU allocator served, from ``torch.profiler``'s memory
events (``tests/helpers.py: profiler_peak_bytes``); on CUDA, ``torch.cuda.max_memory_allocated()`` over the
whole fit (its peak counter reset before it). "decoder" (causal
``F.scaled_dot_product_attention``) and "unet" (ConvTranspose2d, skip concatenations) are held
out: the estimate was not tuned on them.

Usage::

    .venv/bin/python benchmarks/estimate_accuracy.py                      # CPU, 6 models x 3 batch sizes
    PYTHONPATH=. python3 benchmarks/estimate_accuracy.py --accelerator gpu  # on a GPU machine
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append
from helpers import profiler_peak_bytes
from models_memory import MODELS, make_model

from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.report import format_bytes, format_seconds

RUNS = Path(__file__).with_name("_runs")  # the trainers' reports (git-ignored)
COLUMNS = (
    "model",
    "batch",
    "method",
    "measured peak",
    "ours",
    "our error",
    "torchinfo",
    "torchinfo error",
    "allocator peak",
    "our error vs allocator",
    "our seconds",
    "torchinfo seconds",
    "max batch",
)


def run(name: str, batch_size: int, accelerator: str, measure_steps: int) -> tuple[MemoryEstimate, int | None]:
    """Fit with MemoryEstimator; the allocator-level peak of one more step (CPU) or of the fit (CUDA)."""
    model = make_model(name, num_samples=batch_size * (measure_steps + 1))
    estimator = MemoryEstimator(measure_steps=measure_steps)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=measure_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[estimator],
        default_root_dir=RUNS,
    )
    on_cuda = accelerator in ("gpu", "cuda")
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is in estimate.notes
        trainer.fit(model, model.loader(batch_size))
    if on_cuda:
        return estimator.estimate, int(torch.cuda.max_memory_allocated())
    return estimator.estimate, allocator_peak_bytes(model, trainer.optimizers[0], next(iter(model.loader(batch_size))))


def allocator_peak_bytes(model: L.LightningModule, optimizer: torch.optim.Optimizer, batch: tuple) -> int:
    """CPU allocator peak of one steady-state step in Lightning's order (``training_step``,
    ``zero_grad``, backward, optimizer step), from ``torch.profiler``'s allocator events; the model,
    its gradients, the optimizer state and the batch count from the start."""
    model.train()
    model.log = lambda *args, **kwargs: None  # outside the Trainer's loop there is nothing to log to

    def step() -> None:
        loss = model.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    try:
        step()  # the gradients and optimizer state of a previous step are alive in the measured one
        return profiler_peak_bytes(step, existing=(model, optimizer, batch))
    finally:
        del model.log


def signed_percent(fraction: float | None) -> str:
    """``-0.00123`` -> ``'-0.12%'`` (two decimals: the traced errors are small)."""
    return "n/a" if fraction is None else f"{fraction * 100:+.2f}%"


def row(name: str, batch_size: int, estimate: MemoryEstimate, allocator_peak: int | None) -> tuple[str, ...]:
    return (
        name,
        str(batch_size),
        estimate.method,
        format_bytes(estimate.measured_peak_bytes),
        format_bytes(estimate.predicted_peak_bytes),
        signed_percent(estimate.estimate_error),
        format_bytes(estimate.torchinfo_total_bytes),
        signed_percent(estimate.torchinfo_error),
        format_bytes(allocator_peak),
        signed_percent(estimate.with_measured_peak(allocator_peak).estimate_error),
        format_seconds(estimate.trace_seconds),
        format_seconds(estimate.torchinfo_seconds),
        str(estimate.max_batch_size),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--measure-steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    rows = [
        row(name, batch_size, *run(name, batch_size, args.accelerator, args.measure_steps))
        for name in args.models
        for batch_size in args.batch_sizes
    ]
    table = Table(title="Predicted vs measured peak memory of a training step (Adam)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "method") else "right")
    for cells in rows:
        table.add_row(*cells)
    Console(width=240).print(table)
    notes = [
        "Errors are (predicted - measured) / measured over the first "
        f"{args.measure_steps} real steps; 'ours' is the fake-tensor trace (method 'traced') or, where the model "
        "cannot be traced, torchinfo's figures plus parameters, gradients and Adam's state ('torchinfo-fallback'). "
        "'our seconds' covers the workspace probe and both traces (batch B and 2B); max batch is for the memory free on the device. "
        "'measured peak' is the callback's measurement: memory counted at the allocator by a dispatch mode, kernel "
        "workspaces (e.g. oneDNN convolution reorders) included (CUDA: the caching allocator's peak counter); "
        "'allocator peak' is, on CPU, one more steady-state step read independently from torch.profiler's allocator "
        "events, on CUDA torch.cuda.max_memory_allocated() over the fit. Our prediction adds the kernel workspaces "
        "learned from a real forward and backward pass on the host at min(batch, 16) samples to the fake-tensor "
        "trace. 'decoder' and 'unet' are held out (the estimate was not tuned on them).",
    ]
    if not args.no_write:
        markdown = "\n".join(
            ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            + ["| " + " | ".join(cells) + " |" for cells in rows]
        )
        append("Memory estimate accuracy", markdown, "\n".join(notes))


if __name__ == "__main__":
    main()
