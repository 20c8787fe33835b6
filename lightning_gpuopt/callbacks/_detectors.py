"""The measuring side of ``DataWaitMonitor``'s findings (:mod:`lightning_gpuopt.core.findings` decides).

Each probe looks at a few sampled training steps, never at every one, and undoes whatever it
installed in :meth:`Probe.stop` (called from ``teardown`` and ``on_exception``). The monitor
calls, in order: ``fit_start`` (from ``on_train_start``), ``step_start``/``step_end`` around
each training step with the step's index since the start of ``fit`` (0-based, warm-up
included), ``stop``, then ``findings`` with :attr:`Probe.report` set to the run's report. A
probe that overrides :meth:`Probe.action_timed` is also called with every action the trainer's
profiler times (every hook call, ``save_checkpoint``, ...), from ``setup`` on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.findings import (
    Finding,
    channels_last,
    cudnn_benchmark_off,
    data_parallel,
    oversubscription,
    tf32_off,
)
from lightning_gpuopt.core.loader import usable_cpu_count

if TYPE_CHECKING:
    from lightning_gpuopt.core.diagnosis import DataWaitReport

#: training steps (0-based from the start of ``fit``) on which the probes look at the batch
SAMPLED_STEPS = (1, 2, 3)


class Probe:
    """Base class: every hook does nothing."""

    #: the run's report (numbers as ``samples_per_second``, ``data_wait_fraction``), set before :meth:`findings`
    report: Optional[DataWaitReport] = None

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Called once the loaders and the model are on their device (``on_train_start``)."""

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        """Called before training step ``step`` (0-based since the start of ``fit``)."""

    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        """Called after training step ``step``."""

    def action_timed(self, action: str, seconds: float, in_validation: bool) -> None:
        """Called with every profiled action's name and wall-clock seconds, and whether it ran in a
        validation run inside ``fit`` (only for probes that override it: it runs on every hook call)."""

    def stop(self) -> None:
        """Undo everything installed; called on every exit path, perhaps more than once."""

    def findings(self, trainer: Any, pl_module: Any) -> list[Finding]:
        """What was found (after :meth:`stop`)."""
        return []


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    if isinstance(batch, torch.Tensor):
        found.append(batch)
    elif isinstance(batch, dict):
        for value in batch.values():
            found.extend(_tensors(value))
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            found.extend(_tensors(value))
    return found


class ModuleAndDeviceChecks(Probe):
    """``data-parallel``, ``oversubscribed``, and on CUDA ``tf32-off``, ``cudnn-benchmark-off`` and
    ``channels-last``: read from the module, the torch settings, the sampled batches' shapes and
    (forward pre-hooks on the sampled steps) what each ``Conv2d`` is given."""

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
        if (
            args
            and isinstance(args[0], torch.Tensor)
            and args[0].dim() == 4
            and not args[0].is_contiguous(memory_format=torch.channels_last)
        ):
            self._inputs_nchw = True

    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        self.stop()

    def stop(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def findings(self, trainer: Any, pl_module: Any) -> list[Finding]:
        processes = trainer.num_devices if trainer.world_size > 1 else 1
        found = [
            data_parallel([name for name, module in pl_module.named_modules() if isinstance(module, nn.DataParallel)]),
            oversubscription(torch.get_num_threads(), processes, usable_cpu_count()),
        ]
        if self._on_cuda:
            card = device_for(pl_module.device)
            precision = str(trainer.precision)
            convolutions = [
                (name, module)
                for name, module in pl_module.named_modules()
                if isinstance(module, nn.modules.conv._ConvNd)
            ]
            conv2d_nchw = [
                name
                for name, module in convolutions
                if isinstance(module, nn.Conv2d) and not module.weight.is_contiguous(memory_format=torch.channels_last)
            ]
            has_conv2d = any(isinstance(module, nn.Conv2d) for _, module in convolutions)
            found += [
                tf32_off(card.capabilities.compute_capability, torch.get_float32_matmul_precision(), precision),
                cudnn_benchmark_off(bool(torch.backends.cudnn.benchmark), len(convolutions), len(self._shapes)),
                channels_last(precision, conv2d_nchw, self._inputs_nchw) if has_conv2d else None,
            ]
        return [finding for finding in found if finding is not None]


def make_probes() -> list[Probe]:
    """One probe of each kind, fresh for a ``fit``."""
    from lightning_gpuopt.callbacks._detect_hooks import DatasetDisk, HookTimes
    from lightning_gpuopt.callbacks._detect_steps import HostSyncProbe, KeptGraphProbe  # imports Probe from here

    return [ModuleAndDeviceChecks(), HookTimes(), DatasetDisk(), KeptGraphProbe(), HostSyncProbe()]


def listens_to_actions(probe: Probe) -> bool:
    """Whether ``probe`` overrides :meth:`Probe.action_timed`."""
    return type(probe).action_timed is not Probe.action_timed


def run_probe_findings(probes: list[Probe], trainer: Any, pl_module: Any, warn: Any) -> list[Finding]:
    """Every probe's findings; a probe that fails is named in a warning and skipped (a finding is
    advice: it never costs the run)."""
    found: list[Finding] = []
    for probe in probes:
        try:
            found.extend(probe.findings(trainer, pl_module))
        except Exception as error:  # noqa: BLE001 - advice must never end the run
            warn(f"DataWaitMonitor: the {type(probe).__name__} check failed and was skipped: {error!r}")
    return found


def stop_probes(probes: Optional[list[Probe]]) -> None:
    for probe in probes or ():
        probe.stop()
