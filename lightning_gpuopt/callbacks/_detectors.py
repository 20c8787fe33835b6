"""Probes: the measuring side of ``DataWaitMonitor``'s findings (:mod:`lightning_gpuopt.core.findings` decides).

A probe looks at a few sampled training steps, never at every one. Here: the base :class:`Probe`,
:class:`ModuleAndDeviceChecks`, :class:`KeptGraphProbe` and :class:`HostSyncProbe` (a read is the user's by the
innermost frame outside torch, us, the standard library and installed packages such as transformers, else
Lightning's; ``print(loss)`` is not seen: torch formats tensors with dispatch modes off). The hook, checkpoint and
disk probes are in ``_detect_hooks``."""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpuopt.core import findings as decide
from lightning_gpuopt.core._torch_compat import TorchDispatchMode, current_dispatch_mode
from lightning_gpuopt.core.device import Device, device_for
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.findings import Finding
from lightning_gpuopt.core.loader import usable_cpu_count

_SAMPLED_STEPS = (1, 2, 3)  #: steps (0-based from the start of ``fit``) whose batch ModuleAndDeviceChecks looks at
#: step starts at which the module's attributes are scanned (and after the last step)
GRAPH_STEPS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_MAX_GRAPH_NODES = 100_000  #: at most this many autograd nodes are walked per attribute
#: steps whose host reads are counted: unmeasured under the default ``warmup_steps=3``; step 0 does lazy set-up
SYNC_STEPS = (1, 2)
PROBE_STEPS = frozenset((*_SAMPLED_STEPS, *GRAPH_STEPS, *SYNC_STEPS))  #: the steps the probes' step hooks run on
_MAX_LINES = 5  #: source lines kept per run for the message


class Probe:
    """Base class, every hook a no-op. The monitor calls ``fit_start`` (``on_train_start``), ``step_start`` and
    ``step_end`` around training step ``step`` (0-based from the start of ``fit``) of :data:`PROBE_STEPS`, ``stop``
    on every exit path (undoing what the probe installed; perhaps more than once), then ``findings`` with the run's
    report, :attr:`steps_seen` and :attr:`sampled_steps` set (``HookTimes`` also hears of actions)."""

    steps_seen = sampled_steps = 0  #: steps ended; of them, those whose hooks were timed (``HOOK_SAMPLE_EVERY``)

    def fit_start(self, trainer: Any, pl_module: Any) -> None: ...
    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None: ...
    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None: ...
    def stop(self) -> None: ...

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        return []


def first_dataloader(loaders: Any) -> Optional[DataLoader]:
    """The first ``DataLoader`` in what ``trainer.train_dataloader`` returns (a loader or a collection)."""
    if isinstance(loaders, DataLoader):
        return loaders
    items = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    return next((found for found in map(first_dataloader, items) if found is not None), None)


def _tensors(batch: Any, depth: Optional[int] = None) -> list[torch.Tensor]:
    """The tensors in ``batch``: itself, or in its lists, tuples and dicts (``depth`` levels deep, sets too)."""
    if isinstance(batch, torch.Tensor) or depth == 0:
        return [batch] if isinstance(batch, torch.Tensor) else []
    sequences = (list, tuple) if depth is None else (list, tuple, set, frozenset)
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, sequences) else ()
    return [tensor for item in items for tensor in _tensors(item, None if depth is None else depth - 1)]


class ModuleAndDeviceChecks(Probe):
    """``data-parallel``, ``oversubscribed``; on CUDA ``tf32-off``, ``cudnn-benchmark-off`` and ``channels-last``."""

    def __init__(self) -> None:
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._inputs_nchw = self._on_cuda = False
        self._hooks: list[Any] = []

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_cuda = device_for(pl_module.device).is_cuda

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        if step not in _SAMPLED_STEPS:
            return
        self._shapes.add(tuple(tuple(tensor.shape) for tensor in _tensors(batch)))
        if self._on_cuda:  # what the convolutions are given, after any conversion in training_step
            convolutions = [module for module in pl_module.modules() if isinstance(module, nn.Conv2d)]
            self._hooks = [module.register_forward_pre_hook(self._see_conv_input) for module in convolutions]

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
            decide.data_parallel([name for name, module in modules if isinstance(module, nn.DataParallel)]),
            decide.oversubscription(torch.get_num_threads(), report.settings.processes_per_host, usable_cpu_count()),
        ]
        if self._on_cuda:
            precision = str(trainer.precision)
            convolutions = [(name, module) for name, module in modules if isinstance(module, nn.modules.conv._ConvNd)]
            conv2d = [(name, module) for name, module in convolutions if isinstance(module, nn.Conv2d)]
            nchw = [name for name, conv in conv2d if not conv.weight.is_contiguous(memory_format=torch.channels_last)]
            capability = device_for(pl_module.device).capabilities.compute_capability
            found += [
                decide.tf32_off(capability, torch.get_float32_matmul_precision(), precision),
                decide.cudnn_benchmark_off(bool(torch.backends.cudnn.benchmark), len(convolutions), len(self._shapes)),
                decide.channels_last(precision, nchw, self._inputs_nchw) if conv2d else None,
            ]
        return [finding for finding in found if finding is not None]


def _graph_nodes(tensors: list[torch.Tensor]) -> int:
    """Distinct autograd nodes reachable from the ``grad_fn`` of ``tensors`` (at most :data:`_MAX_GRAPH_NODES`)."""
    seen: set[Any] = set()
    stack = [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    while stack and len(seen) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return len(seen)


def _graphs_held(pl_module: torch.nn.Module) -> dict[str, tuple[int, bool]]:
    """``{attribute path: (autograd nodes, whether a container)}`` of each attribute (buffers included,
    parameters and submodules not) of ``pl_module``'s modules holding a tensor with a ``grad_fn``."""
    held: dict[str, tuple[int, bool]] = {}
    for prefix, module in pl_module.named_modules():
        skip = ("_parameters", "_buffers", "_modules")
        own = [(n, v) for n, v in vars(module).items() if n not in skip and not n.startswith(("_forward", "_backward"))]
        for name, value in own + list(module._buffers.items()):
            tensors = [tensor for tensor in _tensors(value, depth=1) if tensor.grad_fn is not None]
            if tensors:
                path = f"{prefix}.{name}" if prefix else name
                held[path] = (_graph_nodes(tensors), not isinstance(value, torch.Tensor))
    return held


class KeptGraphProbe(Probe):
    """``graph-kept``: autograd graphs held by module attributes across steps."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._nodes: list[dict[str, int]] = []
        self._live: list[Optional[int]] = []
        self._containers: set[str] = set()
        self._device: Optional[Device] = None

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._device = device_for(pl_module.device)

    def _sample(self, pl_module: Any, step: int) -> None:
        held = _graphs_held(pl_module)
        self._steps.append(step)
        self._nodes.append({path: nodes for path, (nodes, _) in held.items()})
        self._containers.update(path for path, (_, container) in held.items() if container)
        self._live.append(self._device.allocated_memory() if self._device is not None else None)

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        if step in GRAPH_STEPS:
            self._sample(pl_module, step)

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        # after the last step as well: a short run reaches few of the sampled steps
        if self.steps_seen and (not self._steps or self.steps_seen > self._steps[-1]):
            self._sample(pl_module, self.steps_seen)
        paths = sorted({path for sample in self._nodes for path in sample})
        nodes = {path: [sample.get(path, 0) for sample in self._nodes] for path in paths}
        found = decide.graph_kept(self._steps, nodes, self._live, containers=sorted(self._containers))
        return [found] if found is not None else []


def _package_dir(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(os.path.realpath(next(iter(spec.submodule_search_locations))), "")


_LIGHTNING_DIRS = tuple(filter(None, map(_package_dir, ("lightning", "pytorch_lightning", "lightning_fabric"))))
_LIBRARY_DIRS = tuple(filter(None, map(_package_dir, ("torch", "lightning_gpuopt"))))
_STDLIB_DIRS = tuple({os.path.join(os.path.realpath(sysconfig.get_path(key)), "") for key in ("stdlib", "platstdlib")})


def _where(filename: str) -> str:
    """``"lightning"``, ``"library"`` (torch, us, the standard library, installed packages) or ``"user"``."""
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    if path.startswith(_LIGHTNING_DIRS):
        return "lightning"
    installed = f"-packages{os.sep}" in path  # site-packages, dist-packages: transformers, timm, ...
    return "library" if path.startswith(("<", *_LIBRARY_DIRS, *_STDLIB_DIRS)) or installed else "user"


def _count_line(lines: dict[str, int], line: str, count: int = 1) -> None:
    if line in lines or len(lines) < _MAX_LINES:
        lines[line] = lines.get(line, 0) + count


class _HostReadCounter(TorchDispatchMode):
    """Counts reads from ``device`` to the host, by whose code asked (the user's line or Lightning)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # compiled code runs compiled under it (torch 2.9+)
        return True

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device, self.active = device, True
        self.user = self.lightning = 0
        self.lines: dict[str, int] = {}
        self._kinds: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active and self._is_host_read(func, args, out):
            self._count()
        return out

    def _is_host_read(self, func: Any, args: tuple, out: Any) -> bool:
        if func is torch.ops.aten._local_scalar_dense.default:
            source, target = args[0], None
        elif func is torch.ops.aten._to_copy.default:
            source, target = args[0], out
        elif func is torch.ops.aten.copy_.default and len(args) > 1:
            source, target = args[1], args[0]
        else:
            return False
        if not isinstance(source, torch.Tensor) or not self.device.holds(source):
            return False
        return target is None or (isinstance(target, torch.Tensor) and not self.device.holds(target))

    def _count(self) -> None:
        frame: Any = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            kind = self._kinds.get(filename) or self._kinds.setdefault(filename, _where(filename))
            if kind == "lightning":
                break
            if kind == "user":
                self.user += 1
                _count_line(self.lines, f"{filename}:{frame.f_lineno}")
                return
            frame = frame.f_back
        self.lightning += 1  # Lightning's, or no caller outside the libraries: not the user's code


class HostSyncProbe(Probe):
    """``host-sync``: reads from the card to the host inside the :data:`SYNC_STEPS` warm-up steps."""

    def __init__(self) -> None:
        self._device: Optional[Device] = None
        self._mode: Optional[_HostReadCounter] = None
        self.counts: list[tuple[int, int, int]] = []  #: per counted step: (step, the user's reads, Lightning's)
        self.lines: dict[str, int] = {}  #: ``file:line`` of the user's reads: their count over the counted steps

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        device = device_for(pl_module.device)
        self._device = device if device.is_cuda else None

    def step_start(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        if self._device is not None and step in SYNC_STEPS and self._mode is None:
            self._mode = _HostReadCounter(self._device)
            self._mode.__enter__()

    def step_end(self, trainer: Any, pl_module: Any, batch: Any, step: int) -> None:
        mode = self._mode
        self.stop()
        if mode is not None:
            self.counts.append((step, mode.user, mode.lightning))
            for line, count in mode.lines.items():
                _count_line(self.lines, line, count)

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.active = False  # counts nothing more, even where it cannot leave the stack
            if current_dispatch_mode() is mode:
                mode.__exit__(None, None, None)

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        if not self.counts:
            return []
        steps, user, lightning = zip(*self.counts)
        found = decide.host_sync(steps, user, lightning, self.lines)
        return [found] if found is not None else []
