"""Probes: the measuring side of ``DataWaitMonitor``'s findings (:mod:`lightning_gpuopt.core.findings` decides).

A probe looks at a few sampled training steps, never at every one. The monitor calls ``fit_start``
(``on_train_start``), ``step_start``/``step_end`` around each training step with its index since the
start of ``fit`` (0-based, warm-up included), ``action_timed`` with every action the trainer's profiler
times (only for probes that override it), ``stop`` on every exit path (perhaps more than once: it
undoes what the probe installed), then ``findings`` with the run's report. This module holds the base
and the module and device checks; the other probes are in ``_detect_hooks`` and ``_detect_steps``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.findings import (
    Finding,
    channels_last,
    cudnn_benchmark_off,
    data_parallel,
    oversubscription,
    tf32_off,
)
from lightning_gpuopt.core.loader import usable_cpu_count

#: training steps (0-based from the start of ``fit``) on which the module and device checks look at the batch
SAMPLED_STEPS = (1, 2, 3)


class Probe:
    """Base class: every hook does nothing."""

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The loaders and the model are on their device (``on_train_start``)."""

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        """Training step ``step`` (0-based since the start of ``fit``) starts."""

    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        """Training step ``step`` ended."""

    def action_timed(self, action: str, seconds: float, in_validation: bool) -> None:
        """A profiled action (a hook call, ``save_checkpoint``, ...) took ``seconds``; only for probes that
        override it (it runs on every hook call)."""

    def stop(self) -> None:
        """Undo everything installed."""

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        """What was found (after :meth:`stop`), given the run's report."""
        return []


def first_dataloader(loaders: Any) -> Optional[DataLoader]:
    """The first ``DataLoader`` in what ``trainer.train_dataloader`` returns (a loader or a collection)."""
    if isinstance(loaders, DataLoader):
        return loaders
    for item in (
        loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    ):
        found = first_dataloader(item)
        if found is not None:
            return found
    return None


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return [tensor for item in items for tensor in _tensors(item)]


class ModuleAndDeviceChecks(Probe):
    """``data-parallel``, ``oversubscribed``, and on CUDA ``tf32-off``, ``cudnn-benchmark-off`` and
    ``channels-last``: from the module, torch's settings, the sampled batches' shapes and (forward
    pre-hooks on the sampled steps) what each ``Conv2d`` is given."""

    def __init__(self) -> None:
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._inputs_nchw = False
        self._on_cuda = False
        self._hooks: list[Any] = []

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_cuda = device_for(pl_module.device).is_cuda

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        if step not in SAMPLED_STEPS:
            return
        self._shapes.add(tuple(tuple(tensor.shape) for tensor in _tensors(batch)))
        if self._on_cuda:  # what the convolutions are given, after any conversion in training_step
            self._hooks = [
                module.register_forward_pre_hook(self._see_conv_input)
                for module in pl_module.modules()
                if isinstance(module, nn.Conv2d)
            ]

    def _see_conv_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            self._inputs_nchw |= not args[0].is_contiguous(memory_format=torch.channels_last)

    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        self.stop()

    def stop(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        modules = list(pl_module.named_modules())
        found = [
            data_parallel([name for name, module in modules if isinstance(module, nn.DataParallel)]),
            oversubscription(torch.get_num_threads(), report.settings.processes_per_host, usable_cpu_count()),
        ]
        if self._on_cuda:
            precision = str(trainer.precision)
            convolutions = [(name, module) for name, module in modules if isinstance(module, nn.modules.conv._ConvNd)]
            conv2d = [(name, module) for name, module in convolutions if isinstance(module, nn.Conv2d)]
            nchw = [
                name for name, module in conv2d if not module.weight.is_contiguous(memory_format=torch.channels_last)
            ]
            capability = device_for(pl_module.device).capabilities.compute_capability
            found += [
                tf32_off(capability, torch.get_float32_matmul_precision(), precision),
                cudnn_benchmark_off(bool(torch.backends.cudnn.benchmark), len(convolutions), len(self._shapes)),
                channels_last(precision, nchw, self._inputs_nchw) if conv2d else None,
            ]
        return [finding for finding in found if finding is not None]
