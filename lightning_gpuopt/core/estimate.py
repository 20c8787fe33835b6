"""Peak memory of a training step, predicted before it runs: torchinfo's summary and a traced step.

torchinfo's "Estimated Total Size" (input + forward/backward pass + parameters) leaves out
gradients, optimizer state and what autograd saves beyond each layer's output, so it can be off
by several times against a real step. This module keeps torchinfo's figures for reference and
predicts the peak by *running* the step on fake tensors:

1. the module's parameters and buffers are swapped for ``FakeTensor`` twins (no memory; shapes,
   dtypes and devices kept), the batch is faked and, to vary the batch size, rebuilt with another
   first dimension;
2. under ``FakeTensorMode`` and a :class:`~lightning_gpuopt.core.op_memory.LiveTensorTracker`, two
   steps run in Lightning's order: forward (in the caller's ``step_context``, e.g. autocast),
   ``zero_grad(set_to_none=True)``, backward, the optimizer's ``step()`` on a twin of the real
   optimizer (same class, same param-group options). The second step starts with the first
   step's gradients and optimizer state alive, as every later real step does;
3. the tracker's peak is the prediction (on CUDA each storage counts in the caching allocator's
   512-byte blocks). Traced at batch sizes ``B`` and ``2B``, the peak gives a line
   ``bytes(b) = fixed_bytes + bytes_per_sample * b``, and so the largest batch that fits a
   capacity.

What a fake trace cannot see is the memory kernels allocate and free inside themselves: on CPU,
oneDNN's reorders around each convolution (as large as its output), BatchNorm backward's
temporaries, scratch buffers -- a quarter of a small CNN's peak. On a module on the host,
:func:`learn_workspaces` runs one real forward and backward at a small batch (at most
:data:`~lightning_gpuopt.core.workspace.PROBE_BATCH_SIZE` samples) on copies of the parameters and
buffers, learns what each op call needs beyond its outputs from the profiler's allocator events
(:mod:`.op_memory`), and the trace adds each call's workspace, scaled to the traced call's inputs,
while that call runs, and counts the outputs some real kernels make larger than their fake twins
(oneDNN's LSTM workspace) at the real size (:mod:`.workspace`); :attr:`MemoryEstimate.notes` and
:attr:`MemoryEstimate.workspace_bytes` say how much of the predicted peak that is. On
CUDA the host's kernels say nothing about cuDNN's and cuBLAS's workspaces: they, the CUDA context
and memory held outside the step (e.g. DDP's gradient buckets, which :func:`with_untraced_bytes`
adds) are not traced.

The trace allocates nothing real, and nothing is changed: module attributes, parameters,
buffers, gradients and the RNG state are as before (the probe's own allocations, on the host, are
freed when it ends). A step that needs real values (``.item()``, data-dependent control
flow, ops without a fake implementation) cannot be traced; :func:`estimate_memory` then falls
back to torchinfo's figures plus parameters, gradients and a rule for the optimizer state
(Adam/AdamW: 2x the trainable parameters, 3x with ``amsgrad``; SGD with momentum: 1x, without: 0),
and says why in :attr:`MemoryEstimate.notes`.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> batch = (torch.randn(16, 32), torch.randn(16, 1))
    >>> loss_fn = lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1])
    >>> estimate = estimate_memory(model, loss_fn, batch, optimizer=optimizer, batch_size=16,
    ...                            forward_input=batch[0], capacity_bytes=10**6)
    >>> estimate.method, estimate.optimizer_bytes >= 2 * estimate.params_bytes  # exp_avg, exp_avg_sq, step
    ('traced', True)
    >>> estimate.predicted_peak_bytes == estimate.fixed_bytes + 16 * estimate.bytes_per_sample
    True
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterator, Sequence, Union

import torch
import torchinfo

from lightning_gpuopt.core._torch_compat import FAKE_KERNEL_LOGGERS, FakeTensorMode, tree_leaves, tree_map
from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY, device_for, host_only
from lightning_gpuopt.core.op_memory import learning_possible, storage_bytes
from lightning_gpuopt.core.workspace import PROBE_BATCH_SIZE, WorkspaceProfile, WorkspaceRecorder, WorkspaceTracker

LossFn = Callable[[Any], torch.Tensor]
#: a whole training step under manual optimization: ``(batch, optimizers)``, where the step runs its
#: own backward passes and ``step()``/``zero_grad()`` calls on the optimizers it is given
ManualStep = Callable[[Any, list], None]
#: one optimizer, several (manual optimization), or none
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


class NotTraceable(Exception):
    """A step that cannot be traced, for a reason known before trying (e.g. ``training_step`` takes
    ``dataloader_iter``); its message is the reason, shown as it is in :attr:`MemoryEstimate.notes`
    and :attr:`MemoryEstimate.not_traced_reason`."""


@dataclass
class TracedStep:
    """Figures of one traced training step (all in bytes, as live at the step's end)."""

    batch_size: int | None
    peak_bytes: int
    params_bytes: int
    buffers_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    seconds: float
    #: kernel memory in the peak, learned by a probe (:func:`learn_workspaces`): workspaces, and
    #: outputs the real kernels make larger than the fake ones
    workspace_bytes: int = 0


@dataclass
class TorchinfoFigures:
    """torchinfo's summary of one forward pass; ``total_bytes`` is its "Estimated Total Size"."""

    total_params: int
    trainable_params: int
    mult_adds: int
    input_bytes: int
    forward_backward_bytes: int
    params_bytes: int
    total_bytes: int
    on_fake_tensors: bool
    seconds: float


@dataclass
class MemoryEstimate:
    """Predicted (and, once measured, actual) peak memory of a training step.

    ``predicted_peak_bytes`` = ``params_bytes + buffers_bytes + grads_bytes + optimizer_bytes +
    batch_bytes + untraced_bytes + activation_bytes``, where ``activation_bytes`` is everything else live at the
    peak (saved activations, temporaries, and the ``workspace_bytes`` that kernels allocate inside
    themselves, learned on the host by :func:`learn_workspaces`). Errors are relative and signed:
    ``(predicted - measured) / measured``, positive when the prediction is too high.
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None
    torchinfo_total_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    max_batch_size: int | None = None
    #: "traced" (fake-tensor trace), "torchinfo-fallback" or "parameters-only"
    method: str = "traced"
    batch_size: int | None = None
    buffers_bytes: int = 0
    batch_bytes: int = 0
    #: memory the real step holds outside the traced one (DDP's gradient buckets)
    untraced_bytes: int = 0
    #: kernel workspaces in the predicted peak (part of ``activation_bytes``; 0 where not learned:
    #: not on the host, or another profiler was running)
    workspace_bytes: int = 0
    fixed_bytes: float | None = None
    bytes_per_sample: float | None = None
    capacity_bytes: int | None = None
    #: the gradient accumulation the step was traced with (the gradients of earlier micro-batches alive)
    accumulate_grad_batches: int = 1
    param_dtype: str | None = None
    estimate_error: float | None = None
    torchinfo_error: float | None = None
    torchinfo_params: int | None = None
    torchinfo_trainable_params: int | None = None
    torchinfo_mult_adds: int | None = None
    trace_seconds: float | None = None
    torchinfo_seconds: float | None = None
    #: why the step was not traced (``method`` is then a fallback): what the estimate did not model
    not_traced_reason: str | None = None
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- fake twins


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


_CONTAINERS = (list, dict, set, collections.OrderedDict, collections.defaultdict)


def _container_contents(value: Any, seen: set[int]) -> Iterator[tuple[Any, Any]]:
    """``(container, shallow copy)`` for ``value`` and every list, dict or set nested in it (through
    tuples too), each once: a step that appends to ``self.outputs["train"]`` changes a nested list."""
    if id(value) in seen or type(value) not in (*_CONTAINERS, tuple):
        return
    seen.add(id(value))
    if type(value) is not tuple:
        yield value, copy.copy(value)
    for item in value.values() if isinstance(value, dict) else value:
        yield from _container_contents(item, seen)


@contextlib.contextmanager
def restored_attributes(*objects: Any) -> Iterator[None]:
    """Undo what the block does to the attributes of ``objects`` (a module: it and its submodules):
    (re)bindings, and changes to the contents of list, dict and set attributes, nested ones included
    (e.g. losses appended in a step to ``self.outputs["train"]``).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> model.outputs = {"train": []}
        >>> with restored_attributes(model):
        ...     model.outputs["train"].append(1.0)
        ...     model.step_count = 1
        >>> model.outputs, hasattr(model, "step_count")
        ({'train': []}, False)
    """
    owners = [sub for obj in objects for sub in (obj.modules() if isinstance(obj, torch.nn.Module) else [obj])]
    saved = [(owner, dict(vars(owner))) for owner in owners if hasattr(owner, "__dict__")]
    seen: set[int] = set()
    contents = [
        kept for _, attributes in saved for value in attributes.values() for kept in _container_contents(value, seen)
    ]
    try:
        yield
    finally:
        for value, content in contents:
            value.clear()
            if isinstance(value, list):
                value.extend(content)
            else:
                value.update(content)
        for owner, attributes in saved:
            current = vars(owner)
            for name in [name for name in current if name not in attributes]:
                del current[name]
            current.update(attributes)


@contextlib.contextmanager
def _swapped_tensors(module: torch.nn.Module, twin: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Replace every parameter and buffer of ``module`` by ``twin(tensor)`` inside the block."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    store: dict[str, Any]  # parameters or buffers; a parameter's twin is a plain tensor
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    swapped.append((store, name, tensor))
    try:
        for store, name, tensor in swapped:
            store[name] = twin(tensor)
        yield
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor


def _rebatched(batch: Any, batch_size: int | None, new_batch_size: int | None, keep: Callable[[Any], Any]) -> Any:
    """``batch`` with each tensor whose first dimension is ``batch_size`` replaced by zeros with
    ``new_batch_size`` rows (fake ones under ``FakeTensorMode``), and every other leaf ``keep(leaf)``."""

    def rebatched(value: Any) -> Any:
        is_batched = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size
        if new_batch_size is None or not is_batched:
            return keep(value)
        return torch.zeros((new_batch_size, *value.shape[1:]), dtype=value.dtype, device=value.device)

    return tree_map(rebatched, batch)


def _batch_twin(batch: Any, mode: FakeTensorMode, batch_size: int | None, new_batch_size: int | None) -> Any:
    """``batch`` as fake tensors, resized from ``batch_size`` to ``new_batch_size`` rows."""

    def keep(value: Any) -> Any:
        return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    with mode:
        return _rebatched(batch, batch_size, new_batch_size, keep)


def leading_dimension(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (``None`` without one).

    Example::

        >>> leading_dimension({"x": torch.zeros(5, 2), "y": torch.zeros(5)})
        5
    """
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: ``[]`` for ``None``, ``[optimizer]`` for one.

    Example::

        >>> optimizer_list(None), len(optimizer_list(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)))
        ([], 1)
    """
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _twin_optimizer(optimizer: torch.optim.Optimizer, twin_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer of the same class and param-group options over the twins of its parameters."""
    groups = []
    for group in optimizer.param_groups:
        options = {key: value for key, value in group.items() if key != "params"}
        groups.append({**options, "params": [twin_of[id(param)] for param in group["params"]]})
    # a subclass of Optimizer: its __init__ takes the groups alone (Optimizer's own also wants defaults)
    optimizer_class: Callable[..., torch.optim.Optimizer] = type(optimizer)
    return optimizer_class(groups)


@contextlib.contextmanager
def _twinned_module(
    module: torch.nn.Module, make: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block ``module`` holds ``make(tensor)`` twins of its parameters and buffers (one
    per tensor: tied weights stay tied), its attributes and the RNG state are restored after it;
    yields real id -> twin."""
    twin_of: dict[int, torch.Tensor] = {}

    def twin(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in twin_of:
            twin_of[id(tensor)] = make(tensor)
        return twin_of[id(tensor)]

    device = _module_device(module)
    rng_devices = [device] if device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=rng_devices),
        _host_rngs_kept(),
        restored_attributes(module),
        _swapped_tensors(module, twin),
    ):
        yield twin_of


@contextlib.contextmanager
def _host_rngs_kept() -> Iterator[None]:
    """Python's ``random`` and NumPy's global generator are as they were after the block: a traced
    step runs the user's code, which may draw from them (training must draw the same numbers)."""
    state = random.getstate()
    numpy = sys.modules.get("numpy")  # only when the user's code could have drawn from it
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)


#: loggers that report, at error level and with a traceback, each op a fake kernel fails on
#: before the error is raised (to the trace's caller, which reports it in one line)


@contextlib.contextmanager
def _fake_kernel_errors_quiet() -> Iterator[None]:
    """Inside the block torch does not log the fake kernels' failures (the error still propagates)."""
    loggers = [logging.getLogger(name) for name in FAKE_KERNEL_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _fake_module(module: torch.nn.Module, mode: FakeTensorMode) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block ``module`` holds fake twins of its tensors (and torch logs no fake kernel
    failure: the caller reports it); yields real id -> twin."""
    with _fake_kernel_errors_quiet(), _twinned_module(module, mode.from_tensor) as twin_of:
        yield twin_of


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy (same values, strides and ``requires_grad``; a parameter stays a parameter)."""
    copy = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


def sliced_batch(batch: Any, batch_size: int | None, new_batch_size: int | None) -> Any:
    """``batch`` with each tensor whose first dimension is ``batch_size`` cut to its first
    ``new_batch_size`` rows (views of the real data); other values as they are, and the whole batch
    as it is when ``new_batch_size`` is ``None``.

    Example::

        >>> small = sliced_batch({"x": torch.zeros(8, 3), "y": torch.zeros(8), "w": torch.zeros(3)}, 8, 2)
        >>> {key: tuple(value.shape) for key, value in small.items()}
        {'x': (2, 3), 'y': (2,), 'w': (3,)}
    """

    def cut(value: Any) -> Any:
        is_batched = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size
        return value[:new_batch_size] if new_batch_size is not None and is_batched else value

    return tree_map(cut, batch)


# ----------------------------------------------------------------------------- tracing


def _on_host(*objects: Any) -> bool:
    """Whether every tensor of ``objects`` (modules: parameters and buffers) is a host tensor."""
    for obj in objects:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, torch.nn.Module) else tree_leaves(obj)
        if any(isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" for tensor in tensors):
            return False
    return True


def host_step_context(precision: str) -> Callable[[], ContextManager[Any]]:
    """The step context for tracing on the host a step that will run in ``precision`` on a card:
    a CPU autocast of the same dtype (a CUDA autocast does nothing to host tensors, and the trace
    would then count float32 activations the run will not have).

    Example::

        >>> with host_step_context("16-mixed")():
        ...     torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype
        torch.float16
    """
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        return lambda: torch.autocast("cpu", dtype=dtype)
    return contextlib.nullcontext


def learn_workspaces(
    module: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    batch_size: int | None = None,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    probe_batch_size: int = PROBE_BATCH_SIZE,
    device: torch.device | str | None = None,
    manual_step: ManualStep | None = None,
    optimizer: Optimizers = None,
) -> WorkspaceProfile | None:
    """What each op call of a training step allocates inside its kernel, from one real forward and
    backward pass on the host at ``min(batch_size, probe_batch_size)`` samples.

    The pass runs on copies of the parameters and buffers (the model's own, their gradients and
    hooks -- DDP's among them --, BatchNorm's running statistics and the optimizer are not touched;
    attributes and the RNG state are restored) and on the first rows of ``batch``; the optimizer
    does not step (its kernels allocate nothing beyond their outputs). It allocates on the host a
    copy of the parameters and buffers and what a real step at that batch size does, without
    optimizer state, and frees it all on return.

    Returns ``None`` where the probe does not apply: tensors off the host or a step that will
    run on another ``device`` than the host (on CUDA, cuDNN and
    cuBLAS choose their own workspaces; this is the one place that decides), and a
    :class:`~lightning_gpuopt.core.workspace.WorkspaceProfile` with ``failure`` set when it could
    not run (another profiler running, the step raised).

    Example::

        >>> conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> stats = conv[1].running_mean.clone()
        >>> profile = learn_workspaces(conv, lambda x: conv(x).sum(), torch.randn(64, 3, 16, 16), batch_size=64)
        >>> profile.batch_size, profile.workspace_calls > 0, torch.equal(conv[1].running_mean, stats)
        (16, True, True)
    """
    if not _on_host(module, batch) or (device is not None and torch.device(device).type != "cpu"):
        return None  # the step will run on a card whose kernels are not the host's
    probe_size = None if batch_size is None else max(1, min(batch_size, probe_batch_size))
    if not learning_possible():
        return WorkspaceProfile(batch_size=probe_size, failure="another profiler is running")
    start = time.perf_counter()
    small_batch = sliced_batch(batch, batch_size, probe_size)
    try:
        with host_only(), _twinned_module(module, _host_copy) as twin_of, WorkspaceRecorder() as recorder:
            if manual_step is not None:  # the step's own backward passes and optimizer steps, on the copies
                with step_context():
                    manual_step(small_batch, [_twin_optimizer(o, twin_of) for o in optimizer_list(optimizer)])
            else:
                with step_context():
                    loss = loss_fn(small_batch)
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
                loss.backward()
                del loss
    except Exception as error:  # noqa: BLE001 - without a probe the trace counts no workspaces
        return WorkspaceProfile(batch_size=probe_size, seconds=time.perf_counter() - start, failure=_first_line(error))
    return WorkspaceProfile(tuple(recorder.calls), probe_size, time.perf_counter() - start)


def trace_training_step(
    module: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    optimizer: Optimizers = None,
    batch_size: int | None = None,
    trace_batch_size: int | None = None,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    steps: int = 2,
    workspaces: WorkspaceProfile | None = None,
    device: torch.device | str | None = None,
    accumulate_grad_batches: int = 1,
    manual_step: ManualStep | None = None,
) -> TracedStep:
    """Trace ``steps`` training steps of ``module`` on fake tensors and return their peak live bytes.

    Args:
        module: the model; ``loss_fn`` must reach its parameters through it.
        loss_fn: ``batch -> loss`` (the forward pass and the loss).
        batch: a real batch (tensors, or lists/tuples/dicts of them).
        optimizer: the real optimizer (or, under manual optimization, optimizers); a twin of each
            steps the fake parameters. ``None``: no step.
        batch_size: the batch size of ``batch`` (tensors with that first dimension are resized).
        trace_batch_size: the batch size to trace at (default: ``batch_size``).
        step_context: a context manager factory the forward pass runs in (e.g. autocast).
        steps: how many steps to trace; from the second one on gradients and optimizer state of
            the previous step are alive, as in a real training loop.
        workspaces: kernel memory learned by :func:`learn_workspaces`: each traced op call holds
            its workspace while it runs, its outputs count what the real kernel allocates for them
            (``None``: none counted).
        device: the device the step will run on (default: the module's): on a CUDA card (real or
            simulated) storages count in the caching allocator's 512-byte blocks. The trace itself
            runs where the module is; for a module still on the host, pass a ``step_context`` that
            acts on host tensors (e.g. a CPU autocast of the run's dtype, see
            :func:`host_step_context`).
        accumulate_grad_batches: the run's gradient accumulation. Above 1, the gradients are set to
            ``None`` only before the first traced backward: later steps accumulate onto the earlier
            step's gradients, as micro-batches after the first of a group do (and as the first does
            in its forward pass: Lightning zeroes the gradients after it), and the optimizer still
            steps after each, so the trace's last step is the worst micro-batch of any group of any
            length: gradients and optimizer state alive from its start, then the optimizer's step.
        manual_step: for manual optimization, the whole step (``(batch, optimizers)``: it runs its own
            backward passes and steps the twin optimizers it is given) in place of ``loss_fn``'s
            forward, ``zero_grad``, backward and step.

    Raises:
        Whatever the traced step raises; e.g. ``DataDependentOutputException`` for ``.item()``.

    Example::

        >>> model = torch.nn.Linear(100, 10)
        >>> step = trace_training_step(model, lambda x: model(x).sum(), torch.ones(8, 100),
        ...                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            batch_size=8, trace_batch_size=1000)
        >>> step.params_bytes == step.grads_bytes == 4040, step.optimizer_bytes, step.batch_bytes
        (True, 0, 400000)
    """
    start = time.perf_counter()
    target = _module_device(module) if device is None else torch.device(device)
    granularity = CUDA_ALLOCATION_GRANULARITY if device_for(target).is_cuda else 1
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _fake_module(module, mode) as twin_of:
        fake_batch = _batch_twin(batch, mode, batch_size, trace_batch_size)
        params = list(module.parameters())
        learned = workspaces if workspaces is not None and workspaces.learned else None
        with mode, WorkspaceTracker(learned, existing=(module, fake_batch), granularity=granularity) as tracker:
            twin_optimizers = [_twin_optimizer(o, twin_of) for o in optimizer_list(optimizer)]
            for step in range(steps):
                if step:
                    tracker.next_step()
                if manual_step is not None:
                    with step_context():
                        manual_step(fake_batch, twin_optimizers)
                    continue
                with step_context():
                    loss = loss_fn(fake_batch)
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
                if step == 0 or accumulate_grad_batches <= 1:
                    for param in params:
                        param.grad = None
                loss.backward()
                for twin_optimizer in twin_optimizers:
                    twin_optimizer.step()
                del loss
            figures = TracedStep(
                batch_size=trace_batch_size or batch_size,
                peak_bytes=tracker.peak_bytes,
                params_bytes=storage_bytes(params, granularity=granularity),
                buffers_bytes=storage_bytes(list(module.buffers()), granularity=granularity),
                grads_bytes=storage_bytes([p.grad for p in params if p.grad is not None], granularity=granularity),
                optimizer_bytes=storage_bytes(*twin_optimizers, granularity=granularity),
                batch_bytes=storage_bytes(fake_batch, granularity=granularity),
                seconds=0.0,
                workspace_bytes=tracker.workspace_bytes_at_peak,
            )
    figures.seconds = time.perf_counter() - start
    return figures


# ----------------------------------------------------------------------------- torchinfo


def _figures_from(statistics: torchinfo.ModelStatistics, on_fake: bool, seconds: float) -> TorchinfoFigures:
    return TorchinfoFigures(
        total_params=int(statistics.total_params),
        trainable_params=int(statistics.trainable_params),
        mult_adds=int(statistics.total_mult_adds),
        input_bytes=int(statistics.total_input),
        forward_backward_bytes=int(statistics.total_output_bytes),
        params_bytes=int(statistics.total_param_bytes),
        total_bytes=int(statistics.total_input + statistics.total_output_bytes + statistics.total_param_bytes),
        on_fake_tensors=on_fake,
        seconds=seconds,
    )


def torchinfo_summary(
    module: torch.nn.Module,
    forward_input: Any,
    *,
    batch_size: int | None = None,
    trace_batch_size: int | None = None,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> TorchinfoFigures:
    """torchinfo's figures for ``module(forward_input)``, with the input resized to ``trace_batch_size``.

    The forward pass runs in ``step_context`` (e.g. autocast), as the training step does.

    Runs on fake tensors first (no memory, no side effects); a model that cannot run on them is
    summarised with real tensors under ``torch.no_grad()`` in eval mode (torchinfo's default,
    which leaves BatchNorm statistics alone), with ``device=`` the module's own device. Either
    way torchinfo never moves the model.

    Example::

        >>> figures = torchinfo_summary(torch.nn.Linear(10, 5), torch.ones(4, 10))
        >>> figures.total_params, figures.on_fake_tensors
        (55, True)
    """
    device = _module_device(module)
    start = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with _fake_module(module, mode):
            fake_input = _batch_twin(forward_input, mode, batch_size, trace_batch_size)
            with mode, step_context():
                # device=None: with input_data given, torchinfo then moves neither model nor input
                # (``.to()`` would try to swap the fake parameters)
                statistics = torchinfo.summary(module, input_data=fake_input, device=None, verbose=0)
        return _figures_from(statistics, True, time.perf_counter() - start)
    except Exception:  # noqa: BLE001 - any failure on fake tensors: use real ones
        pass
    start = time.perf_counter()
    real_input = _rebatched(forward_input, batch_size, trace_batch_size, keep=lambda value: value)
    with restored_attributes(module), step_context():
        statistics = torchinfo.summary(module, input_data=real_input, device=device, verbose=0)
    return _figures_from(statistics, False, time.perf_counter() - start)


# ----------------------------------------------------------------------------- the estimate


def optimizer_state_rule_bytes(optimizer: Optimizers) -> int | None:
    """Optimizer state by rule: Adam/AdamW 2x trainable parameters (3x with amsgrad), SGD 1x with
    momentum, 0 without; summed over several optimizers; ``None`` when one has no rule (measure
    them after a real step).

    Example::

        >>> model = torch.nn.Linear(10, 10)
        >>> optimizer_state_rule_bytes(torch.optim.Adam(model.parameters()))
        880
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        rules = [optimizer_state_rule_bytes(one) for one in optimizer_list(optimizer)]
        return None if None in rules else sum(rules)  # type: ignore[arg-type]
    total = 0
    for group in optimizer.param_groups:
        trainable = storage_bytes([p for p in group["params"] if p.requires_grad])
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            total += trainable * (3 if group.get("amsgrad") else 2)
        elif isinstance(optimizer, torch.optim.SGD):
            total += trainable if group.get("momentum", 0) else 0
        else:
            return None
    return total


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``(predicted - measured) / measured``; ``None`` when either is missing or measured is 0."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def max_batch_size_for(
    capacity_bytes: int | None, fixed_bytes: float | None, bytes_per_sample: float | None
) -> int | None:
    """The largest ``b`` with ``fixed_bytes + bytes_per_sample * b <= capacity_bytes`` (``None`` if unknown)."""
    if capacity_bytes is None or fixed_bytes is None or not bytes_per_sample or bytes_per_sample <= 0:
        return None
    return max(0, math.floor((capacity_bytes - fixed_bytes) / bytes_per_sample))


@dataclass
class RefinedLine:
    """The line re-traced near the largest batch, and the largest batch it gives."""

    max_batch_size: int
    fixed_bytes: float | None
    bytes_per_sample: float | None
    seconds: float


def refine_near_capacity(
    trace_at: Callable[[int], TracedStep],
    predicted: int,
    capacity_bytes: int | None,
    extra_bytes: int = 0,
    passes: int = 2,
) -> RefinedLine:
    """Re-trace the line near the largest batch: the peak is convex piecewise-linear in the batch
    (at small batches the optimizer step can set it), so the line through ``B`` and ``2B`` can be
    too flat and overshoot. Each pass traces ``predicted // 2`` and ``predicted`` with ``trace_at``
    (batch size -> :class:`TracedStep`) and solves the new line for ``capacity_bytes``;
    ``extra_bytes`` is memory the trace does not see. Stops when the answer no longer moves or
    falls below 4. ``fixed_bytes``/``bytes_per_sample`` are ``None`` when nothing was traced.

    Example::

        >>> steps = lambda b: TracedStep(b, 1000 + 10 * b + (5 * b if b > 50 else 0), 0, 0, 0, 0, 0, 0.0)
        >>> refine_near_capacity(steps, predicted=100, capacity_bytes=2000).max_batch_size  # steeper above 50: 66 fits
        68
    """
    fixed = per_sample = None
    seconds = 0.0
    for _ in range(passes):
        if predicted < 4:
            break
        half, full = trace_at(predicted // 2), trace_at(predicted)
        seconds += half.seconds + full.seconds
        per_sample = (full.peak_bytes - half.peak_bytes) / (predicted - predicted // 2)
        fixed = full.peak_bytes + extra_bytes - per_sample * predicted
        refined = max_batch_size_for(capacity_bytes, fixed, per_sample)
        if refined is None or refined == predicted:
            break
        predicted = refined
    return RefinedLine(predicted, fixed, per_sample, seconds)


def with_measured_peak(estimate: MemoryEstimate, measured_peak_bytes: int | None) -> MemoryEstimate:
    """``estimate`` with the measured peak and both relative errors filled in."""
    return replace(
        estimate,
        measured_peak_bytes=measured_peak_bytes,
        estimate_error=relative_error(estimate.predicted_peak_bytes, measured_peak_bytes),
        torchinfo_error=relative_error(estimate.torchinfo_total_bytes, measured_peak_bytes),
    )


def _with_fixed_bytes_added(estimate: MemoryEstimate, added: int, note: str, **changes: Any) -> MemoryEstimate:
    fixed = None if estimate.fixed_bytes is None else estimate.fixed_bytes + added
    return replace(
        estimate,
        predicted_peak_bytes=estimate.predicted_peak_bytes + added,
        fixed_bytes=fixed,
        max_batch_size=max_batch_size_for(estimate.capacity_bytes, fixed, estimate.bytes_per_sample),
        notes=[*estimate.notes, note],
        **changes,
    )


def with_measured_optimizer_state(estimate: MemoryEstimate, optimizer_bytes: int) -> MemoryEstimate:
    """For an optimizer without a rule: add its state as measured after a real step to the prediction."""
    return _with_fixed_bytes_added(
        estimate,
        optimizer_bytes - estimate.optimizer_bytes,
        f"optimizer state measured after the first real step: {optimizer_bytes} bytes",
        optimizer_bytes=optimizer_bytes,
    )


def with_untraced_bytes(estimate: MemoryEstimate, untraced_bytes: int, reason: str) -> MemoryEstimate:
    """Add memory the real step holds outside the traced one (e.g. DDP's gradient buckets).

    Example::

        >>> before = MemoryEstimate(10, 10, 20, 5, None, 45, fixed_bytes=40.0, bytes_per_sample=1.0, capacity_bytes=100)
        >>> after = with_untraced_bytes(before, 10, "DDP gradient buckets")
        >>> after.predicted_peak_bytes, after.untraced_bytes, after.max_batch_size
        (55, 10, 50)
    """
    return _with_fixed_bytes_added(
        estimate,
        untraced_bytes,
        f"{reason}: {untraced_bytes} bytes",
        untraced_bytes=estimate.untraced_bytes + untraced_bytes,
    )


def _first_line(error: BaseException) -> str:
    """``"Type: first line"`` of the innermost cause of ``error`` (torchinfo wraps the real one)."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, NotTraceable):
        return str(error)[:300]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _traced_estimate(
    module: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    optimizer: Optimizers,
    batch_size: int | None,
    step_context: Callable[[], ContextManager[Any]],
    workspaces: WorkspaceProfile | None,
    device: torch.device | str | None = None,
    accumulate_grad_batches: int = 1,
    manual_step: ManualStep | None = None,
) -> tuple[MemoryEstimate, float]:
    trace: dict[str, Any] = dict(
        optimizer=optimizer,
        batch_size=batch_size,
        step_context=step_context,
        workspaces=workspaces,
        device=device,
        accumulate_grad_batches=accumulate_grad_batches,
        manual_step=manual_step,
    )
    at_batch = trace_training_step(module, loss_fn, batch, **trace)
    seconds = at_batch.seconds
    fixed = per_sample = None
    if batch_size:
        at_double = trace_training_step(module, loss_fn, batch, trace_batch_size=2 * batch_size, **trace)
        seconds += at_double.seconds
        per_sample = (at_double.peak_bytes - at_batch.peak_bytes) / batch_size
        fixed = at_batch.peak_bytes - per_sample * batch_size
    known = at_batch.params_bytes + at_batch.buffers_bytes + at_batch.grads_bytes + at_batch.optimizer_bytes
    estimate = MemoryEstimate(
        params_bytes=at_batch.params_bytes,
        grads_bytes=at_batch.grads_bytes,
        optimizer_bytes=at_batch.optimizer_bytes,
        activation_bytes=at_batch.peak_bytes - known - at_batch.batch_bytes,
        torchinfo_total_bytes=None,
        predicted_peak_bytes=at_batch.peak_bytes,
        method="traced",
        batch_size=batch_size,
        buffers_bytes=at_batch.buffers_bytes,
        batch_bytes=at_batch.batch_bytes,
        workspace_bytes=at_batch.workspace_bytes,
        fixed_bytes=fixed,
        bytes_per_sample=per_sample,
        accumulate_grad_batches=accumulate_grad_batches,
        notes=[
            *workspace_notes(workspaces, at_batch),
            *accumulation_notes(accumulate_grad_batches),
            *(
                [
                    "manual optimization: traced the whole training_step, its backward passes and the steps of "
                    f"its {len(optimizer_list(optimizer))} optimizer(s)"
                ]
                if manual_step is not None
                else []
            ),
        ],
    )
    return estimate, seconds


def accumulation_notes(accumulate_grad_batches: int) -> list[str]:
    """What :attr:`MemoryEstimate.notes` says about gradient accumulation (nothing without it).

    Example::

        >>> accumulation_notes(1), accumulation_notes(4)[0][:52]
        ([], 'traced accumulating 4 micro-batches per optimizer st')
    """
    if accumulate_grad_batches <= 1:
        return []
    return [
        f"traced accumulating {accumulate_grad_batches} micro-batches per optimizer step: the gradients of "
        "earlier micro-batches are alive through the next forward and backward pass"
    ]


def workspace_notes(workspaces: WorkspaceProfile | None, traced: TracedStep) -> list[str]:
    """What :attr:`MemoryEstimate.notes` says about kernel workspaces in ``traced`` (none where the
    probe does not apply).

    Example::

        >>> traced = TracedStep(32, 5000, 0, 0, 0, 0, 0, 0.0, workspace_bytes=1200)
        >>> workspace_notes(WorkspaceProfile((), batch_size=16), traced)[0][:60]
        'kernel workspaces learned from a real forward and backward p'
    """
    if workspaces is None:
        return []
    if not workspaces.learned:
        return [
            f"kernel workspaces not counted ({workspaces.failure}): the predicted peak leaves out what "
            "kernels allocate inside themselves (e.g. oneDNN reorders)"
        ]
    at = "" if workspaces.batch_size is None else f" at batch size {workspaces.batch_size}"
    return [
        f"kernel workspaces learned from a real forward and backward pass on the host{at} "
        f"({workspaces.workspace_calls} of {len(workspaces.calls)} op calls allocate more than the fake trace "
        f"sees, {workspaces.seconds:.2f} s): {traced.workspace_bytes} bytes of the predicted peak"
    ]


def _fallback_estimate(
    module: torch.nn.Module,
    batch: Any,
    optimizer: Optimizers,
    batch_size: int | None,
    torchinfo_figures: TorchinfoFigures | None,
) -> MemoryEstimate:
    params = list(module.parameters())
    params_bytes = storage_bytes(params)
    grads_bytes = storage_bytes([p for p in params if p.requires_grad])
    optimizer_bytes = optimizer_state_rule_bytes(optimizer)
    notes = []
    if optimizer_bytes is None:
        names = ", ".join(type(one).__name__ for one in optimizer_list(optimizer))
        notes.append(f"no rule for {names}: its state is measured after the first real step")
        optimizer_bytes = 0
    buffers_bytes = storage_bytes(list(module.buffers()))
    batch_bytes = storage_bytes(batch)
    fixed = params_bytes + buffers_bytes + grads_bytes + optimizer_bytes
    if torchinfo_figures is None:
        return MemoryEstimate(
            params_bytes=params_bytes,
            grads_bytes=grads_bytes,
            optimizer_bytes=optimizer_bytes,
            activation_bytes=None,
            torchinfo_total_bytes=None,
            predicted_peak_bytes=fixed + batch_bytes,
            method="parameters-only",
            batch_size=batch_size,
            buffers_bytes=buffers_bytes,
            batch_bytes=batch_bytes,
            notes=notes,
        )
    activation_bytes = torchinfo_figures.forward_backward_bytes
    per_batch = torchinfo_figures.input_bytes + activation_bytes
    return MemoryEstimate(
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes,
        torchinfo_total_bytes=torchinfo_figures.total_bytes,
        predicted_peak_bytes=fixed + per_batch,
        method="torchinfo-fallback",
        batch_size=batch_size,
        buffers_bytes=buffers_bytes,
        batch_bytes=torchinfo_figures.input_bytes,
        fixed_bytes=fixed,
        bytes_per_sample=per_batch / batch_size if batch_size else None,
        notes=notes,
    )


def estimate_memory(
    module: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    optimizer: Optimizers = None,
    batch_size: int | None = None,
    forward_input: Any = None,
    capacity_bytes: int | None = None,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    workspaces: WorkspaceProfile | bool | None = True,
    device: torch.device | str | None = None,
    accumulate_grad_batches: int = 1,
    manual_step: ManualStep | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of a training step of ``module`` on ``batch``, and the largest batch.

    Traces the step at ``batch_size`` and ``2 * batch_size`` (see :func:`trace_training_step`),
    with the kernel workspaces of a module on the host learned first (:func:`learn_workspaces`);
    when it cannot be traced, falls back to torchinfo's figures and says why in ``notes``.

    Args:
        module: the model.
        loss_fn: ``batch -> loss``.
        batch: a real batch.
        optimizer: the real optimizer (its class and param-group options are reused); under manual
            optimization a list of them.
        batch_size: the batch size of ``batch``; without it there is no line and no max batch size.
        forward_input: what ``module.forward`` takes, for torchinfo (``None``: no torchinfo figures);
            resized to ``batch_size`` along the first dimension of its tensors.
        capacity_bytes: the memory to plan with, for :attr:`MemoryEstimate.max_batch_size`.
        step_context: a context manager factory the forward pass runs in (e.g. autocast).
        workspaces: ``True``: learn the kernel workspaces with :func:`learn_workspaces` where it
            applies (a module on the host); a profile it returned (to trace more batch sizes with
            the same one, e.g. :func:`refine_near_capacity`); ``False``/``None``: count none.
        device: the device the step will run on (default: the module's; see
            :func:`trace_training_step`). On a CUDA card the cuBLAS workspace its matmuls keep is
            added (32 MiB from Hopper on, 8.1 MiB before).
        accumulate_grad_batches: the run's gradient accumulation (``Trainer.accumulate_grad_batches``):
            the trace keeps the gradients of the previous micro-batch (see :func:`trace_training_step`).
        manual_step: for manual optimization: the whole step, ``(batch, optimizers) -> None``, run
            on fake tensors with twins of ``optimizer`` in place of ``loss_fn`` (see
            :func:`trace_training_step`).

    Example::

        >>> model = torch.nn.Linear(64, 64)
        >>> estimate = estimate_memory(model, lambda x: model(x).sum(), torch.ones(32, 64), batch_size=32)
        >>> estimate.params_bytes, estimate.grads_bytes, estimate.method
        (16640, 16640, 'traced')
    """
    notes: list[str] = []
    torchinfo_figures = None
    if forward_input is not None:
        try:
            torchinfo_figures = torchinfo_summary(
                module,
                forward_input,
                batch_size=leading_dimension(forward_input),
                trace_batch_size=batch_size,
                step_context=step_context,
            )
        except Exception as error:  # noqa: BLE001 - a summary is optional
            notes.append(f"torchinfo could not summarise the model: {_first_line(error)}")
    if workspaces is True:
        workspaces = learn_workspaces(
            module,
            loss_fn,
            batch,
            batch_size=batch_size,
            step_context=step_context,
            device=device,
            manual_step=manual_step,
            optimizer=optimizer,
        )
    profile = workspaces if isinstance(workspaces, WorkspaceProfile) else None
    try:
        estimate, trace_seconds = _traced_estimate(
            module,
            loss_fn,
            batch,
            optimizer,
            batch_size,
            step_context,
            profile,
            device,
            accumulate_grad_batches,
            manual_step,
        )
        card = device_for(device if device is not None else _module_device(module))
        if card.is_cuda and card.capabilities.cublas_workspace_bytes:
            estimate = with_untraced_bytes(
                estimate,
                card.capabilities.cublas_workspace_bytes,
                "the cuBLAS workspace (kept by the caching allocator)",
            )
        trace_seconds += 0.0 if profile is None else profile.seconds
    except Exception as error:  # noqa: BLE001 - any failure of the trace means: fall back
        reason = _first_line(error)
        uses = (
            "torchinfo's figures"
            if torchinfo_figures is not None
            else "parameters, gradients, optimizer state and the batch only (no torchinfo figures)"
        )
        notes.append(
            f"the training step could not be traced on fake tensors ({reason}); the estimate uses "
            f"{uses} and is less accurate"
        )
        estimate, trace_seconds = _fallback_estimate(module, batch, optimizer, batch_size, torchinfo_figures), None
        estimate = replace(estimate, not_traced_reason=reason)
    if torchinfo_figures is not None:
        estimate = replace(
            estimate,
            torchinfo_total_bytes=torchinfo_figures.total_bytes,
            torchinfo_params=torchinfo_figures.total_params,
            torchinfo_trainable_params=torchinfo_figures.trainable_params,
            torchinfo_mult_adds=torchinfo_figures.mult_adds,
            torchinfo_seconds=torchinfo_figures.seconds,
        )
    params = list(module.parameters())
    return replace(
        estimate,
        capacity_bytes=capacity_bytes,
        max_batch_size=max_batch_size_for(capacity_bytes, estimate.fixed_bytes, estimate.bytes_per_sample),
        accumulate_grad_batches=accumulate_grad_batches,
        param_dtype=str(params[0].dtype) if params else None,
        trace_seconds=trace_seconds,
        notes=[*notes, *estimate.notes],
    )
