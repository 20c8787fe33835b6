"""MemoryEstimator: predict a training step's peak memory before it runs, then measure it.

The step is traced by :mod:`lightning_gpuopt.core.estimate`, torchinfo's summary beside it. Logged once, when the
measurement ends (or at the end of training), where known: ``gpuopt/mem_predicted_peak_bytes``,
``gpuopt/mem_measured_peak_bytes``, ``gpuopt/mem_estimate_error`` (``(predicted - measured) / measured``),
``gpuopt/mem_torchinfo_total_bytes``, ``gpuopt/mem_torchinfo_error``, ``gpuopt/mem_params_bytes``,
``gpuopt/mem_grads_bytes``, ``gpuopt/mem_optimizer_bytes``, ``gpuopt/mem_activation_bytes`` (the rest of the peak) and
``gpuopt/mem_max_batch_size`` (the largest batch predicted to fit). At the end of ``fit`` rank 0 logs a table and
writes the ``"memory"`` section of ``gpuopt_report.json``. See docs/memory-estimator.md."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine.state import rng_kept
from lightning_gpuopt.callbacks._engine.steps import loss_function, manual_step
from lightning_gpuopt.callbacks._reporting import log_metrics, report_file, write_report_section
from lightning_gpuopt.core.checks import check_bool, check_int
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.estimate import (
    MemoryEstimate,
    StepEstimator,
    TrainingStep,
    batch_to_trace,
    optimizer_state_rule_bytes,
)
from lightning_gpuopt.core.loader import batch_samples
from lightning_gpuopt.core.memory import MIN_MAX_MEMORY_BYTES, parse_memory
from lightning_gpuopt.core.op_memory import storage_bytes
from lightning_gpuopt.core.report import format_bytes, format_fraction, format_seconds, render_table, to_dict
from lightning_gpuopt.core.storage import Location

METRIC_PREFIX = "gpuopt/mem_"  #: prefix of every metric this callback logs
_LOGGED_FIELDS = (
    "predicted_peak_bytes", "measured_peak_bytes", "estimate_error", "torchinfo_total_bytes", "torchinfo_error",
    "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "max_batch_size",
)  # fmt: skip


class MemoryEstimator(Callback):
    """Predicts the peak memory of a training step before the first one, and measures it after.

    The step is traced on fake tensors at the batch size and twice it; the line through both gives the largest batch
    size that fits ``max_memory``. An untraceable step falls back to torchinfo's figures, with a warning. Under DDP
    the gradient buckets are added and measuring starts at the third step. See docs/memory-estimator.md.

    Args:
        max_memory: bytes, ``"20GiB"`` or a fraction of the device (``0.9``) to plan the largest batch with;
            ``None``: what the device has free plus what torch already holds.
        measure_steps: real steps to measure the peak over (at least ``2 * accumulate_grad_batches`` batches).
        verbose: log the estimate's table (the JSON report is written either way).

    Example::

        estimator = MemoryEstimator(max_memory="20GiB")
        Trainer(callbacks=[estimator]).fit(model)
        estimator.estimate.predicted_peak_bytes, estimator.estimate.measured_peak_bytes
    """

    def __init__(
        self, max_memory: int | float | str | None = None, measure_steps: int = 3, verbose: bool = True
    ) -> None:
        if max_memory is not None:  # validated now; a fraction is resolved on the device in the first step
            parse_memory(max_memory, "cpu", name="max_memory", minimum=MIN_MAX_MEMORY_BYTES)
        check_int("measure_steps", measure_steps, 1, "measure_steps=3 (real training steps to measure the peak over)")
        check_bool("verbose", verbose, "verbose=False")
        self.max_memory, self.measure_steps, self.verbose = max_memory, measure_steps, verbose
        self.progress = verbose  #: a line when the step is traced
        self.estimate: MemoryEstimate | None = None
        self._meter: Any = None
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compat.check_trainer_namespace(trainer, self)
        # a collective under DDP: asked here, as one right before the processes exit makes teardown racy
        self._report_file: Location = report_file(trainer)
        self.estimate = None
        self._batches_started = self._unmeasured_steps = 0
        self._peaks: list[int] = []
        self._measured = self._optimizer_needs_measuring = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.estimate is None:
            started, self.estimate = time.perf_counter(), self._predict(trainer, pl_module, batch)
            if self.progress and trainer.is_global_zero:
                seconds = format_seconds(time.perf_counter() - started)
                rank_zero_info(f"MemoryEstimator: step traced at batch {self.estimate.batch_size} ({seconds})")
        self._batches_started += 1
        if self._measured or self._batches_started <= self._unmeasured_steps:
            return
        self._meter = device_for(pl_module.device).peak_meter(
            existing=(pl_module, *trainer.optimizers, batch), baseline_bytes=self.estimate.untraced_bytes
        )
        self._meter.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._meter is None or not self._meter.running:
            return
        if (peak := self._stop_meter()) is not None:
            self._peaks.append(peak)
        if self._optimizer_needs_measuring and self.estimate is not None:
            self._optimizer_needs_measuring = False
            self.estimate = self.estimate.with_measured_optimizer_state(storage_bytes(*trainer.optimizers))
        # under accumulation the worst micro-batch (gradients and optimizer state alive) ends the second group
        if len(self._peaks) >= max(self.measure_steps, 2 * trainer.accumulate_grad_batches):
            self._finish_measuring(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_meter()
        if not self._measured:  # training was shorter than the measurement: log what there is
            self._finish_measuring(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.estimate is not None and trainer.is_global_zero:
            self._report(self._report_file)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_meter()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_meter()

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> MemoryEstimate:
        device, optimizers = pl_module.device, list(trainer.optimizers)
        if self.max_memory is not None:
            capacity = parse_memory(self.max_memory, device, name="max_memory", minimum=MIN_MAX_MEMORY_BYTES)
        else:
            capacity = device_for(device).usable_memory((pl_module, *optimizers))
        with rng_kept():  # reading samples may draw random augmentations
            traced, what, unseen = batch_to_trace(trainer.train_dataloader, batch)
        longest, batch = traced is not batch, batch if traced is batch else trainer.strategy.batch_to_device(traced)
        step = TrainingStep(
            pl_module,
            batch,
            loss_function(pl_module),
            manual_step=None if pl_module.automatic_optimization else manual_step(trainer, pl_module),
            optimizers=optimizers,
            batch_size=batch_samples(batch),  # unknown (None): no line, no max batch size
            step_context=trainer.precision_plugin.train_step_context,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            forward_input=_forward_input(trainer, pl_module, batch),
        )
        estimate = StepEstimator(step).estimate(capacity).traced_on(batch, what, unseen)
        if longest:
            estimate.notes.append("the first steps measured may have shorter batches than the one traced")
        self._optimizer_needs_measuring = estimate.method != "traced" and optimizer_state_rule_bytes(optimizers) is None
        for note in estimate.notes if estimate.method != "traced" else ():  # a traced estimate's are in the table
            rank_zero_warn(f"MemoryEstimator: {note}")
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            self._unmeasured_steps = 2  # DDP rebuilds its buckets in the second step
            if not trainer.strategy.model.gradient_as_bucket_view:
                buckets = storage_bytes([p for p in pl_module.parameters() if p.requires_grad])
                estimate = estimate.with_untraced_bytes(buckets, "DDP gradient buckets (a copy of the gradients)")
        return estimate

    def _stop_meter(self) -> int | None:
        meter, self._meter = self._meter, None
        return meter.stop() if meter is not None and meter.running else None

    def _finish_measuring(self, trainer: pl.Trainer) -> None:
        self._measured = True
        if self.estimate is None:
            return
        self.estimate = self.estimate.with_measured_peak(max(self._peaks, default=None))
        log_metrics(trainer, {METRIC_PREFIX + name: getattr(self.estimate, name) for name in _LOGGED_FIELDS})

    @rank_zero_only
    def _report(self, path: Location) -> None:
        assert self.estimate is not None
        if self.verbose:
            rank_zero_info(render_estimate(self.estimate))
        write_report_section(path, "memory", to_dict(self.estimate))


def render_estimate(estimate: MemoryEstimate) -> str:
    """The estimate as a text table (rich), for ``rank_zero_info``."""
    accumulation = estimate.accumulate_grad_batches
    rows = [
        ("method", estimate.method),
        *([("not traced because", estimate.not_traced_reason)] if estimate.not_traced_reason else []),
        ("batch size", str(estimate.batch_size)),
        *([("batch traced", estimate.traced_batch)] if estimate.traced_batch else []),
        *([("micro-batches per optimizer step", str(accumulation))] if accumulation > 1 else []),
        ("parameters", format_bytes(estimate.params_bytes)),
        ("gradients", format_bytes(estimate.grads_bytes)),
        ("optimizer state", format_bytes(estimate.optimizer_bytes)),
        ("buffers", format_bytes(estimate.buffers_bytes)),
        ("batch", format_bytes(estimate.batch_bytes)),
        ("outside the traced step", format_bytes(estimate.untraced_bytes)),
        ("activations and temporaries", format_bytes(estimate.activation_bytes)),
        ("predicted peak", format_bytes(estimate.predicted_peak_bytes)),
        ("measured peak", format_bytes(estimate.measured_peak_bytes)),
        ("estimate error", format_fraction(estimate.estimate_error)),
        ("torchinfo total", format_bytes(estimate.torchinfo_total_bytes)),
        ("torchinfo error", format_fraction(estimate.torchinfo_error)),
        ("memory limit", format_bytes(estimate.capacity_bytes, decimal=True)),
        ("largest batch (predicted)", f"{estimate.max_batch_size} (+{format_bytes(estimate.bytes_per_sample)}/sample)"),
        ("trace time", format_seconds(estimate.trace_seconds)),
    ]
    return render_table("gpuopt: memory estimate", rows, notes=estimate.notes)


def _forward_input(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Any:
    """What ``forward`` takes, for torchinfo: ``example_input_array`` (moved), else the batch or its first element."""
    example = pl_module.example_input_array
    if example is not None:
        return move_data_to_device(trainer.precision_plugin.convert_input(example), pl_module.device)
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return first if isinstance(first, torch.Tensor) else None
