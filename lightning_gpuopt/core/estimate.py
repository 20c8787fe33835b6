"""Peak memory of a training step, predicted before it runs, and the largest batch that fits.

:class:`StepEstimator` traces a :class:`TrainingStep` on fake tensors at ``B`` and ``2B``
(no memory used, nothing changed): the line ``fixed_bytes + bytes_per_sample * b``, with host kernels'
workspaces learned from one small real step (:mod:`.workspace`). An untraceable step gets torchinfo's
figures plus parameters, gradients and optimizer state by rule.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torchinfo
from torch.utils.data import IterableDataset

from lightning_gpuopt.core._torch_compat import FAKE_KERNEL_LOGGERS, FakeTensorMode, eager, profiler_running, tree_map
from lightning_gpuopt.core.allocator import AllocationTrace
from lightning_gpuopt.core.device import CUDA_ALLOCATION_GRANULARITY, device_for
from lightning_gpuopt.core.loader import batch_samples, largest_samples_first
from lightning_gpuopt.core.oom import sample_elements
from lightning_gpuopt.core.op_memory import collect_tensors, storage_bytes
from lightning_gpuopt.core.workspace import PROBE_BATCH_SIZE, WorkspaceProfile, WorkspaceRecorder, WorkspaceTracker

ManualStep = Callable[[Any, list], None]  #: a whole manual-optimization step: its own backward passes and steps
StepContext = Callable[[], ContextManager[Any]]
_CONTAINERS = (list, dict, set, tuple, collections.OrderedDict, collections.defaultdict)  #: restored_attributes copies


class NotTraceable(Exception):
    """A step known not to be traceable; the message is the reason (:attr:`MemoryEstimate.not_traced_reason`)."""


@dataclass
class TrainingStep:
    """One training step: ``module`` on ``batch``, by ``loss_fn`` or (manual optimization) ``manual_step``."""

    module: torch.nn.Module
    batch: Any
    loss_fn: Callable[[Any], torch.Tensor] | None = None  #: ``batch -> loss`` (unused with ``manual_step``)
    manual_step: ManualStep | None = None  #: the whole step under manual optimization, with twins of ``optimizers``
    optimizers: Sequence[torch.optim.Optimizer] = ()  #: twins of the same class and param-group options step
    batch_size: int | None = None  #: its tensors with that first dimension are resized (``None``: no line)
    step_context: StepContext = contextlib.nullcontext  #: what the forward runs in (see :func:`host_step_context`)
    device: torch.device | str | None = None  #: where the step will run (default: the module's device)
    accumulate_grad_batches: int = 1  #: above 1 earlier micro-batches' gradients live through the next pass
    forward_input: Any = None  #: what ``module.forward`` takes, for torchinfo's figures
    untraced: Sequence[tuple[str, int]] = ()  #: ``(reason, bytes)`` held outside the traced step (DDP's buckets)

    def __post_init__(self) -> None:
        if self.loss_fn is None and self.manual_step is None:
            raise ValueError("a TrainingStep needs `loss_fn` (automatic optimization) or `manual_step` (manual).")


@dataclass
class MemoryEstimate:
    """Predicted (and measured) peak memory of a training step, the ``"memory"`` report: the sum of the ``*_bytes``
    figures but ``workspace_bytes`` (part of ``activation_bytes``); errors: ``(predicted - measured) / measured``."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None
    torchinfo_total_bytes: int | None
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    #: the largest ``b`` with ``fixed_bytes + bytes_per_sample * b <= capacity_bytes``
    max_batch_size: int | None = None
    method: str = "traced"  #: "traced" (fake-tensor trace), "torchinfo-fallback" or "parameters-only"
    batch_size: int | None = None
    buffers_bytes: int = 0
    batch_bytes: int = 0
    untraced_bytes: int = 0  #: held outside the traced step (cuBLAS's workspace, DDP's gradient buckets)
    workspace_bytes: int = 0  #: kernel workspaces in the prediction (0 where not learned)
    fixed_bytes: float | None = None
    bytes_per_sample: float | None = None
    capacity_bytes: int | None = None
    accumulate_grad_batches: int = 1  #: the gradient accumulation traced
    param_dtype: str | None = None
    estimate_error: float | None = None
    torchinfo_error: float | None = None
    torchinfo_params: int | None = None
    torchinfo_trainable_params: int | None = None
    torchinfo_mult_adds: int | None = None
    trace_seconds: float | None = None
    torchinfo_seconds: float | None = None
    not_traced_reason: str | None = None  #: why the step was not traced (``method`` is then a fallback)
    traced_batch: str | None = None  #: which batch was traced, with its per-sample shapes (:func:`batch_to_trace`)
    notes: list[str] = field(default_factory=list)

    def with_measured_peak(self, measured_peak_bytes: int | None) -> MemoryEstimate:
        """The estimate with the measured peak and both relative errors filled in."""
        return replace(
            self,
            measured_peak_bytes=measured_peak_bytes,
            estimate_error=_relative_error(self.predicted_peak_bytes, measured_peak_bytes),
            torchinfo_error=_relative_error(self.torchinfo_total_bytes, measured_peak_bytes),
        )

    def with_measured_optimizer_state(self, optimizer_bytes: int) -> MemoryEstimate:
        """For an optimizer without a rule: its state as measured after a real step, added to the prediction."""
        added = optimizer_bytes - self.optimizer_bytes
        note = f"optimizer state measured after the first real step: {optimizer_bytes} bytes"
        return self._with_fixed_bytes_added(added, note, optimizer_bytes=optimizer_bytes)

    def traced_on(self, batch: Any, what: str, unseen: str | None) -> MemoryEstimate:
        """The estimate naming the batch it traced; where the samples were not looked at, a note of longer ones."""
        note = f"traced {what}: {unseen}; batches of longer samples need more memory than this estimate"
        length = next((int(t.shape[1]) for t in collect_tensors(batch) if t.dim() > 1), 0)
        if length and self.bytes_per_sample:  # linear in the length; attention's scores grow with its square
            note += f", about {self.bytes_per_sample / length:,.0f} bytes a sample per step of the length (dimension 1 of its first tensor with two or more, {length} here) or more"
        return replace(self, traced_batch=what, notes=[*self.notes, *([note] if unseen else [])])

    def with_untraced_bytes(self, untraced_bytes: int, reason: str) -> MemoryEstimate:
        """Memory the real step holds outside the traced one, added."""
        total = self.untraced_bytes + untraced_bytes
        return self._with_fixed_bytes_added(untraced_bytes, f"{reason}: {untraced_bytes} bytes", untraced_bytes=total)

    def _with_fixed_bytes_added(self, added: int, note: str, **changes: Any) -> MemoryEstimate:
        fixed = None if self.fixed_bytes is None else self.fixed_bytes + added
        return replace(
            self,
            predicted_peak_bytes=self.predicted_peak_bytes + added,
            fixed_bytes=fixed,
            max_batch_size=_max_batch_size_for(self.capacity_bytes, fixed, self.bytes_per_sample),
            notes=[*self.notes, note],
            **changes,
        )


class StepEstimator:
    """Predicts the peak memory of ``step`` (``workspaces=False``: no kernel workspaces counted)."""

    def __init__(self, step: TrainingStep, *, workspaces: bool = True) -> None:
        self.step, self._learns_workspaces = step, workspaces
        self.card = device_for(_module_device(step.module) if step.device is None else torch.device(step.device))
        self.allocations: dict[int, AllocationTrace] = {}  #: on a card, each traced batch size's allocations

    def estimate(self, capacity_bytes: int | None = None) -> MemoryEstimate:
        """The peak at the step's batch size and the line to the largest batch for ``capacity_bytes``."""
        step, notes, summary = self.step, [], None
        if step.forward_input is not None:
            try:
                summary = _torchinfo_summary(step)
            except Exception as error:  # noqa: BLE001 - a summary is optional: why not, and the parameters by child
                why = _first_line(error)
                why = "it has no `forward`" if why.startswith("NotImplementedError") else why
                children = [f"{n} {sum(p.numel() for p in c.parameters()):,}" for n, c in step.module.named_children()]
                notes.append(f"no torchinfo summary ({why}); parameters by child: {', '.join(children) or 'none'}")
        untraced = list(step.untraced)
        try:
            estimate = self._traced()
            if self.card.is_cuda and (cublas := self.card.capabilities.cublas_workspace_bytes):  # forward's, autograd's
                untraced.insert(0, ("the cuBLAS workspaces of two threads (kept by the caching allocator)", 2 * cublas))
        except Exception as error:  # noqa: BLE001 - any failure of the trace means: fall back
            reason = _first_line(error)
            uses = "torchinfo's figures" if summary else "parameters, gradients, optimizer state and the batch only"
            failed = f"the training step could not be traced on fake tensors ({reason})"
            notes.append(f"{failed}; the estimate uses {uses} and is less accurate")
            estimate = replace(self._fallback(summary), not_traced_reason=reason)
        if summary is not None:
            info, seconds = summary  # "Estimated Total Size": input, forward/backward pass and parameters
            estimate = replace(
                estimate,
                torchinfo_total_bytes=int(info.total_input + info.total_output_bytes + info.total_param_bytes),
                torchinfo_params=int(info.total_params),
                torchinfo_trainable_params=int(info.trainable_params),
                torchinfo_mult_adds=int(info.total_mult_adds),
                torchinfo_seconds=seconds,
            )
        estimate = replace(
            estimate,
            capacity_bytes=capacity_bytes,
            max_batch_size=_max_batch_size_for(capacity_bytes, estimate.fixed_bytes, estimate.bytes_per_sample),
            accumulate_grad_batches=step.accumulate_grad_batches,
            param_dtype=next((str(p.dtype) for p in step.module.parameters()), None),
            notes=[*notes, *estimate.notes],
        )
        for reason, num_bytes in untraced:
            estimate = estimate.with_untraced_bytes(num_bytes, reason)
        return estimate

    def refined(self, estimate: MemoryEstimate, passes: int = 2) -> MemoryEstimate:
        """``estimate`` with its line checked by a trace at its largest batch and, where that disagrees, re-drawn
        through a trace at half of it, up to ``passes`` times (the line through ``B`` and ``2B`` can be too flat).

        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        >>> estimator = StepEstimator(TrainingStep(model, torch.ones(4, 256), lambda x: model(x).sum(), batch_size=4,
        ...                                        optimizers=[torch.optim.Adam(model.parameters())]))
        >>> refined = estimator.refined(estimator.estimate(capacity_bytes=4 * 10**6))
        >>> refined.max_batch_size, refined.notes[-1]
        (526, 'the line was re-traced near the limit (the line through batch sizes 4 and 8 gave 1,337)')
        """
        first = predicted = estimate.max_batch_size
        if estimate.method != "traced" or not self.step.batch_size or not predicted:
            return estimate
        capacity, untraced, seconds = estimate.capacity_bytes, estimate.untraced_bytes, estimate.trace_seconds or 0.0
        fixed, per_sample = estimate.fixed_bytes, estimate.bytes_per_sample
        for _ in range(passes):
            if predicted < 4 or per_sample is None:
                break
            full = self.trace(predicted)
            seconds += full.trace_seconds or 0.0
            at_limit = full.predicted_peak_bytes + untraced
            if _max_batch_size_for(capacity, at_limit - per_sample * predicted, per_sample) == predicted:
                break  # the line holds at the limit
            half = self.trace(predicted // 2)
            seconds += half.trace_seconds or 0.0
            per_sample = (full.predicted_peak_bytes - half.predicted_peak_bytes) / (predicted - predicted // 2)
            fixed = at_limit - per_sample * predicted
            refined = _max_batch_size_for(capacity, fixed, per_sample)
            if refined is None or refined == predicted:
                break
            predicted = refined
        b = self.step.batch_size
        note = f"the line was re-traced near the limit (the line through batch sizes {b} and {2 * b} gave {first:,})"
        return replace(
            estimate,
            fixed_bytes=fixed,
            bytes_per_sample=per_sample,
            max_batch_size=predicted,
            trace_seconds=seconds,
            notes=[*estimate.notes, note] if predicted != first else estimate.notes,
        )

    def trace(self, batch_size: int | None = None) -> MemoryEstimate:
        """The step at ``batch_size`` (default: the step's) on fake tensors after a first one's gradients and
        optimizer state, with the learned workspaces; on a card its allocations go to :attr:`allocations`."""
        step, start, profile = self.step, time.perf_counter(), self.workspaces
        size = batch_size or step.batch_size
        granularity = CUDA_ALLOCATION_GRANULARITY if self.card.is_cuda else 1
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cublas = self.card.capabilities.cublas_workspace_bytes if self.card.is_cuda else None  # recorded on a card
        with _twinned(step.module, mode.from_tensor, FAKE_KERNEL_LOGGERS) as twin_of:
            fake_batch = _resized(step.batch, step.batch_size, batch_size, mode)
            learned = profile if profile is not None and profile.learned else None
            existing, params = (step.module, fake_batch), list(step.module.parameters())
            tracker = WorkspaceTracker(learned, existing=existing, granularity=granularity, cublas_bytes=cublas)
            with mode, tracker:
                optimizers = [_twin_optimizer(optimizer, twin_of) for optimizer in step.optimizers]
                if step.manual_step is None:  # a first step's gradients and optimizer state (zeros), not its passes
                    for param in params:
                        param.grad = torch.zeros_like(param) if param.requires_grad else None
                    for optimizer in optimizers:
                        optimizer.step()
                else:
                    _run_step(step, fake_batch, optimizers, zero_grads=params)
                tracker.next_step()
                _run_step(step, fake_batch, optimizers, zero_grads=params if step.accumulate_grad_batches <= 1 else [])
                sized = functools.partial(storage_bytes, granularity=granularity)
                grads, buffers = [p.grad for p in params if p.grad is not None], list(step.module.buffers())
                held = sized(params), sized(buffers), sized(grads), sized(optimizers), sized(fake_batch)
                if tracker.sizes is not None and size:
                    self.allocations[size] = AllocationTrace(tuple(tracker.sizes), tuple(tracker.events), tracker.step)
        seconds, workspaces = time.perf_counter() - start, tracker.workspace_bytes_at_peak
        return _estimate_of(size, tracker.peak_bytes, held, workspace_bytes=workspaces, trace_seconds=seconds)

    @functools.cached_property
    def workspaces(self) -> WorkspaceProfile | None:
        """What the step's kernels allocate, from one real host step on copies of the parameters (at most
        ``PROBE_BATCH_SIZE`` samples); ``None`` off the host."""
        step = self.step
        tensors = collect_tensors(step.module, step.batch)
        if not self._learns_workspaces or self.card.is_cuda or any(t.device.type != "cpu" for t in tensors):
            return None
        size = None if step.batch_size is None else max(1, min(step.batch_size, PROBE_BATCH_SIZE))
        if profiler_running():
            return WorkspaceProfile(batch_size=size, failure="another profiler is running")
        start, small_batch = time.perf_counter(), sliced_batch(step.batch, step.batch_size, size)
        try:
            with _twinned(step.module, _host_copy) as twin_of, WorkspaceRecorder() as recorder:
                # the optimizers only step inside a manual step (their kernels allocate nothing beyond their outputs)
                optimizers = [_twin_optimizer(o, twin_of) for o in step.optimizers] if step.manual_step else []
                _run_step(step, small_batch, optimizers, zero_grads=[])
        except Exception as error:  # noqa: BLE001 - without a probe the trace counts no workspaces
            return WorkspaceProfile(batch_size=size, seconds=time.perf_counter() - start, failure=_first_line(error))
        return WorkspaceProfile(tuple(recorder.calls), size, time.perf_counter() - start)

    def _traced(self) -> MemoryEstimate:
        step, profile, at_batch = self.step, self.workspaces, self.trace()
        seconds = (at_batch.trace_seconds or 0.0) + (0.0 if profile is None else profile.seconds)
        fixed = per_sample = None  # without a batch size: no line
        if step.batch_size:
            at_double = self.trace(2 * step.batch_size)
            seconds += at_double.trace_seconds or 0.0
            per_sample = (at_double.predicted_peak_bytes - at_batch.predicted_peak_bytes) / step.batch_size
            fixed = at_batch.predicted_peak_bytes - per_sample * step.batch_size
        notes, n = [], step.accumulate_grad_batches
        if profile is not None and not profile.learned:
            left_out = "what kernels allocate inside themselves (e.g. oneDNN reorders)"
            notes.append(f"kernel workspaces not counted ({profile.failure}): the predicted peak leaves out {left_out}")
        elif profile is not None:
            at = "" if profile.batch_size is None else f" at batch size {profile.batch_size}"
            calls = f"{profile.workspace_calls} of {len(profile.calls)} op calls allocate more than the fake trace sees"
            probe = f"a real forward and backward pass on the host{at} ({calls}, {profile.seconds:.2f} s)"
            share = f"{at_batch.workspace_bytes} bytes of the predicted peak"
            notes.append(f"kernel workspaces learned from {probe}: {share}")
        if n > 1:
            alive = "the gradients of earlier micro-batches are alive through the next forward and backward pass"
            notes.append(f"traced accumulating {n} micro-batches per optimizer step: {alive}")
        if step.manual_step is not None:
            whole = "the whole training_step (from batch_idx 0 until every optimizer stepped), its backward passes"
            notes.append(
                f"manual optimization: traced {whole} and the steps of its {len(step.optimizers)} optimizer(s)"
            )
        return replace(at_batch, fixed_bytes=fixed, bytes_per_sample=per_sample, trace_seconds=seconds, notes=notes)

    def _fallback(self, summary: tuple[torchinfo.ModelStatistics, float] | None) -> MemoryEstimate:
        step, params = self.step, list(self.step.module.parameters())
        rule = optimizer_state_rule_bytes(step.optimizers)
        names = ", ".join(type(optimizer).__name__ for optimizer in step.optimizers)
        notes = [f"no rule for {names}: its state is measured after the first real step"] if rule is None else []
        trainable = [p for p in params if p.requires_grad]
        fixed = storage_bytes(params), storage_bytes(list(step.module.buffers())), storage_bytes(trainable), rule or 0
        held = (*fixed, storage_bytes(step.batch) if summary is None else int(summary[0].total_input))
        if summary is None:
            return _estimate_of(step.batch_size, sum(held), held, "parameters-only", notes=notes)
        per_batch = held[-1] + int(summary[0].total_output_bytes)
        per_sample = per_batch / step.batch_size if step.batch_size else None
        figures = dict(fixed_bytes=sum(fixed), bytes_per_sample=per_sample, notes=notes)
        return _estimate_of(step.batch_size, sum(fixed) + per_batch, held, "torchinfo-fallback", **figures)


def _estimate_of(
    batch_size: int | None, peak: int, held: Sequence[int], method: str = "traced", **changes: Any
) -> MemoryEstimate:
    """The estimate of a step peaking at ``peak``, ``held``: params, buffers, grads, optimizer, batch at its end."""
    params, buffers, grads, optimizer, batch = held
    activations = None if method == "parameters-only" else peak - sum(held)
    figures: dict[str, Any] = dict(buffers_bytes=buffers, batch_bytes=batch, batch_size=batch_size, method=method)
    return MemoryEstimate(params, grads, optimizer, activations, None, peak, **figures, **changes)


def _run_step(step: TrainingStep, batch: Any, optimizers: list, zero_grads: Sequence[torch.Tensor]) -> None:
    """``step.manual_step``; or forward, ``zero_grads`` set to ``None``, backward and ``optimizers``' steps."""
    with step.step_context():
        if step.manual_step is not None:
            return step.manual_step(batch, optimizers)
        loss = step.loss_fn(batch)  # type: ignore[misc]  # a TrainingStep has one of them
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
    for param in zero_grads:
        param.grad = None
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()


def _module_device(module: torch.nn.Module) -> torch.device:
    return next((tensor.device for tensor in (*module.parameters(), *module.buffers())), torch.device("cpu"))


def _container_contents(value: Any, seen: set[int]) -> Iterator[tuple[Any, Any]]:
    """``(container, shallow copy)`` for ``value`` and every list, dict or set nested in it (through tuples too)."""
    if id(value) in seen or type(value) not in _CONTAINERS:
        return
    seen.add(id(value))
    if type(value) is not tuple:
        yield value, copy.copy(value)
    for item in value.values() if isinstance(value, dict) else value:
        yield from _container_contents(item, seen)


@contextlib.contextmanager
def restored_attributes(*objects: Any) -> Iterator[None]:
    """Undo what the block does to the attributes of ``objects`` and their submodules: bindings, the contents of
    nested lists, dicts and sets, and a module's plain tensor attributes (a torchmetrics metric's states)."""
    owners = [sub for obj in objects for sub in (obj.modules() if isinstance(obj, torch.nn.Module) else [obj])]
    saved = [(owner, dict(vars(owner))) for owner in owners if hasattr(owner, "__dict__")]
    seen: set[int] = set()
    contents = [kept for _, names in saved for value in names.values() for kept in _container_contents(value, seen)]
    modules = [names for owner, names in saved if isinstance(owner, torch.nn.Module)]
    tensors = [t for names in modules for t in names.values() if isinstance(t, torch.Tensor) and not t.is_inference()]
    values = [(t, t.detach().to("cpu", copy=True)) for t in tensors if not t.requires_grad]  # on the host
    try:
        yield
    finally:
        for value, content in contents:
            value.clear()
            (value.extend if isinstance(value, list) else value.update)(content)
        for owner, attributes in saved:
            vars(owner).clear()
            vars(owner).update(attributes)
        with torch.no_grad():
            for tensor, kept in values:
                tensor.copy_(kept)


@contextlib.contextmanager
def _twinned(module: torch.nn.Module, make: Callable[[torch.Tensor], Any], quiet: Sequence[str] = ()) -> Iterator[dict]:
    """Inside the block ``module``'s tensors are ``make(tensor)`` (tied stay tied), compiled code runs eager and
    ``quiet`` loggers are silent; after it all (attributes, RNG states) is as before. Yields real id -> twin."""
    stores: list[dict[str, Any]] = [store for sub in module.modules() for store in (sub._parameters, sub._buffers)]
    slots = [(store, name, tensor) for store in stores for name, tensor in store.items() if tensor is not None]
    device = _module_device(module)
    numpy = sys.modules.get("numpy")  # only when the user's code could have drawn from it
    host_rngs = random.getstate(), None if numpy is None else numpy.random.get_state()
    levels = [(logger, logger.level) for logger in map(logging.getLogger, quiet)]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), restored_attributes(module), eager():
        try:
            for logger, _ in levels:
                logger.setLevel(logging.CRITICAL + 1)
            twin_of = {key: make(tensor) for key, tensor in {id(t): t for _, _, t in slots}.items()}  # tied: one twin
            for store, name, tensor in slots:
                store[name] = twin_of[id(tensor)]
            yield twin_of
        finally:
            for store, name, tensor in slots:
                store[name] = tensor
            random.setstate(host_rngs[0])
            if numpy is not None:
                numpy.random.set_state(host_rngs[1])
            for logger, level in levels:
                logger.setLevel(level)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy (same values, strides and ``requires_grad``; a parameter stays a parameter)."""
    copied = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
    return copied.requires_grad_(tensor.requires_grad)


def _twin_optimizer(optimizer: torch.optim.Optimizer, twin_of: dict[int, Any]) -> torch.optim.Optimizer:
    """An optimizer of the same class and param-group options over the twins of its parameters."""
    groups = [{**group, "params": [twin_of[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    # a subclass of Optimizer: its __init__ takes the groups alone (Optimizer's own also wants defaults)
    optimizer_class: Callable[..., torch.optim.Optimizer] = type(optimizer)
    return optimizer_class(groups)


def _is_batched(value: Any, batch_size: int | None) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size


def _resized(batch: Any, batch_size: int | None, new_batch_size: int | None, fake: FakeTensorMode | None) -> Any:
    """``batch`` with its tensors of ``batch_size`` rows as zeros of ``new_batch_size`` rows (fake under ``fake``)."""

    def resized(value: Any) -> Any:
        if new_batch_size is not None and _is_batched(value, batch_size):
            return torch.zeros((new_batch_size, *value.shape[1:]), dtype=value.dtype, device=value.device)
        return fake.from_tensor(value) if fake is not None and isinstance(value, torch.Tensor) else value

    with fake or contextlib.nullcontext():
        return tree_map(resized, batch)


def batch_to_trace(loader: Any, first: Any) -> tuple[Any, str, str | None]:
    """``(batch, what, unseen)``: the batch to trace (copies of a map-style dataset's largest sample where sizes vary,
    else ``first``), it in words, and why the samples were not looked at (``None``: they were)."""
    size, dataset = batch_samples(first), getattr(loader, "dataset", None)
    if size is None:  # no batch size: no line to extrapolate
        return first, "the first batch", None
    said = f"the first batch (per-sample shapes {_shapes(first, size)})"
    batches = getattr(loader, "batch_sampler", None) is not None  # a DataLoader without batch_size=None
    if dataset is None or not batches or isinstance(dataset, IterableDataset):
        return first, said, "the loader is a stream or batches no dataset, so its samples were not looked at"
    try:
        sizes = largest_samples_first(dataset, max_probe=64) and largest_samples_first(dataset, max_seconds=2.0)
        longest = None if sizes is None else loader.collate_fn([dataset[sizes.order[0]] for _ in range(size)])
    except Exception as error:  # noqa: BLE001 - the user's dataset or collate_fn: trace the first batch
        return first, said, f"its samples could not be looked at ({_first_line(error)})"
    if sizes is None or sample_elements(longest, size) <= sample_elements(first, size):
        return first, said + (", as long as the longest sample" if sizes else "; the samples looked at are alike"), None
    seen = "all" if sizes.complete else f"the {sizes.probed:,} looked at in 2 s; a larger one may exist"
    shapes = f"per-sample shapes {_shapes(longest, size)}, the first batch's {_shapes(first, size)}"
    return longest, f"{size} copies of the longest sample ({shapes}; of {sizes.total:,} samples, {seen})", None


def _shapes(batch: Any, size: int | None) -> str:
    return ", ".join("x".join(map(str, t.shape[1:])) or "1" for t in collect_tensors(batch) if _is_batched(t, size))


def sliced_batch(batch: Any, batch_size: int | None, new_batch_size: int | None) -> Any:
    """``batch`` with each tensor of ``batch_size`` rows cut (or its rows repeated) to ``new_batch_size``."""

    def sliced(value: Any) -> Any:
        if new_batch_size is None or not _is_batched(value, batch_size):
            return value
        rows = torch.arange(new_batch_size, device=value.device) % value.shape[0]
        return value[:new_batch_size] if new_batch_size <= value.shape[0] else value[rows]

    return tree_map(sliced, batch)


def host_step_context(precision: str) -> StepContext:
    """A CPU autocast of ``precision``'s dtype: the step context to trace on the host a step for a card."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    return contextlib.nullcontext if dtype is None else lambda: torch.autocast("cpu", dtype=dtype)


def _torchinfo_summary(step: TrainingStep) -> tuple[torchinfo.ModelStatistics, float]:
    """torchinfo's summary and seconds at the step's batch size, on fake tensors, else on real ones."""
    module, forward_input, context = step.module, step.forward_input, step.step_context
    size = next((int(t.shape[0]) for t in collect_tensors(forward_input) if t.dim()), None)
    start, mode = time.perf_counter(), FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with _twinned(module, mode.from_tensor, FAKE_KERNEL_LOGGERS):
            fake_input = _resized(forward_input, size, step.batch_size, mode)
            with mode, context():  # device=None: torchinfo moves neither model nor input
                statistics = torchinfo.summary(module, input_data=fake_input, device=None, verbose=0)
    except Exception:  # noqa: BLE001 - any failure on fake tensors: use real ones
        start, real_input = time.perf_counter(), _resized(forward_input, size, step.batch_size, None)
        with restored_attributes(module), eager(), context():
            statistics = torchinfo.summary(module, input_data=real_input, device=_module_device(module), verbose=0)
    return statistics, time.perf_counter() - start


def optimizer_state_rule_bytes(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> int | None:
    """Optimizer state by rule: Adam/AdamW 2x the trainable parameters (3x amsgrad), SGD 1x with momentum, else 0;
    ``None`` when one has no rule."""
    if not isinstance(optimizers, torch.optim.Optimizer):
        rules = [optimizer_state_rule_bytes(one) for one in optimizers or ()]
        return None if None in rules else sum(rules)  # type: ignore[arg-type]
    adam = isinstance(optimizers, (torch.optim.Adam, torch.optim.AdamW))
    if not adam and not isinstance(optimizers, torch.optim.SGD):
        return None
    return sum(
        storage_bytes([p for p in group["params"] if p.requires_grad])
        * ((3 if group.get("amsgrad") else 2) if adam else (1 if group.get("momentum", 0) else 0))
        for group in optimizers.param_groups
    )


def _relative_error(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def _max_batch_size_for(capacity: int | None, fixed: float | None, per_sample: float | None) -> int | None:
    """The largest ``b`` with ``fixed + per_sample * b <= capacity`` (``None`` if unknown)."""
    if capacity is None or fixed is None or not per_sample or per_sample <= 0:
        return None
    return max(0, math.floor((capacity - fixed) / per_sample))


def _first_line(error: BaseException) -> str:
    """``"Type: first line"`` of the innermost cause of ``error`` (torchinfo wraps the real one)."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, NotTraceable):
        return str(error)[:300]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
