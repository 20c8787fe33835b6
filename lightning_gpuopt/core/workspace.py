"""Kernel memory in a step traced on fake tensors, learned per op call from a small real step.

A trace on fake tensors (:mod:`.estimate`) counts every op's outputs as the op's fake (meta)
implementation shapes them, and nothing a kernel allocates and frees inside itself: on CPU,
oneDNN's reorders around a convolution (as large as its output), the temporaries of BatchNorm's
backward, scratch buffers. Some kernels also return more than their fake twin says: oneDNN's LSTM
layer returns a workspace, saved for the backward pass, that its meta implementation gives zero
elements. The allocator sees both, and :mod:`.op_memory` learns them for each distinct op call
from the profiler's allocator events. This module carries what a small real step learned over to
a fake trace of a larger one:

1. :class:`WorkspaceRecorder` runs with a real step on the host (a small batch) and keeps, per op
   call, what the allocator needed inside the call beyond its new outputs (from
   :attr:`.op_memory.OpAllocations.peak_bytes`) and by how much each new output's storage exceeds
   the one the op's meta implementation gives it (:class:`ProbedCall`);
2. :class:`WorkspaceTracker`, the :class:`~lightning_gpuopt.core.op_memory.LiveTensorTracker` of a
   fake trace, pairs each call with a probed one -- in each step the k-th call of an op with the
   same signature (:func:`call_signature`) with the k-th in the probe -- and scales the probed
   bytes by how much the call's inputs that grew with the batch grew (:func:`scaled_bytes`: a
   workspace grows with the activations a kernel works on, one on the weights alone does not; a
   constant part, such as a weight reorder next to an activation's, is scaled too, a small
   overestimate). While the call runs it holds its workspace on top of its outputs; an output the
   real kernel makes larger than the fake one counts that much more for as long as it lives.

The peak is then ``max over calls of (live before + outputs + workspace)``, as the allocator sees
it. Pure torch + standard library. Only host kernels are probed: on CUDA, cuDNN and cuBLAS choose
their own workspaces and the host's tell nothing about them.

Example::

    >>> import torch
    >>> conv, small, large = torch.nn.Conv2d(3, 8, 3, padding=1), torch.randn(4, 3, 16, 16), torch.randn(16, 3, 16, 16)
    >>> with WorkspaceRecorder() as recorder:              # a real call at batch 4
    ...     out = conv(small)
    >>> profile = WorkspaceProfile(tuple(recorder.calls), batch_size=4)
    >>> [call.signature[0].__name__ for call in profile.calls]
    ['convolution.default']
    >>> with WorkspaceTracker(profile) as tracker:        # the same op at 4 times the batch
    ...     out = conv(large)
    >>> tracker.workspace_bytes_at_peak > 0                 # oneDNN's reorders on top of the output
    True
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from lightning_gpuopt.core._torch_compat import TorchDispatchMode, storage_key, tree_leaves, tree_map
from lightning_gpuopt.core.op_memory import LiveTensorTracker, call_learning_allocations, is_real_host_call, storage_of
from lightning_gpuopt.core.search import round_up

#: the largest batch a probe step runs at. PyTorch and oneDNN pick kernels by batch size below it
#: (a 1x1 convolution on one thread goes to oneDNN from 16 samples on), so at 16 the probe's
#: kernels are those of any larger batch; smaller batches are probed at their own size
PROBE_BATCH_SIZE = 16

#: an op and the rank and dtype of each tensor argument: what pairs a traced call with a probed one
Signature = tuple


def call_signature(func: Any, args: tuple, kwargs: Optional[dict]) -> Signature:
    """The op and its tensor arguments' ranks and dtypes (not their sizes: those follow the batch).

    Example::

        >>> relu, a, b = torch.ops.aten.relu.default, torch.ones(2, 3), torch.ones(64, 3)
        >>> call_signature(relu, (a,), {}) == call_signature(relu, (b,), {}) != call_signature(relu, (a[0],), {})
        True
    """
    return _signature(func, list(_tensors((args, kwargs or {}))))


def _signature(func: Any, tensors: list[torch.Tensor]) -> Signature:
    return (func, *((tensor.dim(), tensor.dtype) for tensor in tensors))


def _input_bytes(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(tensor.numel() * tensor.element_size() for tensor in tensors)


def _tensors(tree: Any) -> Iterable[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


@dataclass(frozen=True)
class ProbedCall:
    """One op call of a real step, as the allocator served it."""

    signature: Signature
    #: the allocator's peak inside the call above what was live before it, less the new outputs
    extra_bytes: int
    #: per tensor output, in order: how much larger its new storage is than the meta kernel's
    surplus_bytes: tuple[int, ...]
    #: bytes of each tensor argument, in order: what the probed bytes are scaled by
    input_bytes: tuple[int, ...]


def scaled_bytes(probed_bytes: int, probed_inputs: tuple[int, ...], traced_inputs: tuple[int, ...]) -> int:
    """``probed_bytes`` of a call on inputs of ``probed_inputs`` bytes each, scaled to a call on
    ``traced_inputs``: by the total growth of the inputs whose size changed (the activations; the
    weights keep theirs). Unscaled when no input changed, or none was there to grow from.

    Example::

        >>> scaled_bytes(1000, probed_inputs=(400, 9000), traced_inputs=(1600, 9000))  # 4x the batch
        4000
        >>> scaled_bytes(1000, probed_inputs=(9000,), traced_inputs=(9000,))            # weights alone
        1000
    """
    grown = [(probed, traced) for probed, traced in zip(probed_inputs, traced_inputs) if probed != traced]
    before = sum(probed for probed, _ in grown)
    if not grown or before <= 0:
        return probed_bytes
    return round(probed_bytes * sum(traced for _, traced in grown) / before)


@dataclass(frozen=True)
class WorkspaceProfile:
    """The op calls of one real probe step, in order; ``failure`` says why nothing was learned."""

    calls: tuple[ProbedCall, ...] = ()
    #: the batch size the probe ran at (``None``: the batch as given, its size unknown)
    batch_size: Optional[int] = None
    seconds: float = 0.0
    failure: Optional[str] = None

    @property
    def learned(self) -> bool:
        return self.failure is None

    @property
    def workspace_calls(self) -> int:
        """How many probed calls allocated more than a fake trace sees (a workspace, larger outputs)."""
        return sum(1 for call in self.calls if call.extra_bytes > 0 or any(call.surplus_bytes))

    def by_signature(self) -> dict[Signature, list[ProbedCall]]:
        """The probed calls of each signature, in order."""
        calls: dict[Signature, list[ProbedCall]] = collections.defaultdict(list)
        for call in self.calls:
            calls[call.signature].append(call)
        return calls


class WorkspaceRecorder(TorchDispatchMode):
    """Records a :class:`ProbedCall` for every op call on real host tensors while active.

    Each call's allocations come from :func:`.op_memory.call_learning_allocations` (profiled the
    first time its exact key is seen). A call whose allocations are unknown (another profiler is
    running) records no extra.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[ProbedCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not is_real_host_call((args, kwargs)):
            return func(*args, **kwargs)
        out, allocations = call_learning_allocations(func, args, kwargs)
        inputs = list(_tensors((args, kwargs)))
        outputs = _new_storage_bytes(list(_tensors(out)), inputs)
        extra = 0 if allocations is None else max(0, allocations.peak_bytes - sum(outputs))
        meta = _meta_output_bytes(func, args, kwargs, outputs)
        surplus = tuple(max(0, real - fake) for real, fake in zip(outputs, meta))
        self.calls.append(ProbedCall(_signature(func, inputs), extra, surplus, _input_bytes(inputs)))
        return out


def _new_storage_bytes(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[int]:
    """Per output: the bytes of its storage if new (shared with no input and no earlier output), else 0."""
    seen = {storage_key(storage) for storage in map(storage_of, inputs) if storage is not None}
    sizes = []
    for output in outputs:
        storage = storage_of(output)
        if storage is None or storage_key(storage) in seen:
            sizes.append(0)
            continue
        seen.add(storage_key(storage))
        sizes.append(storage.nbytes())
    return sizes


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _meta_output_bytes(func: Any, args: tuple, kwargs: dict, real_bytes: list[int]) -> list[int]:
    """Per output, the storage bytes the op's meta implementation gives it (what a fake trace counts),
    on meta twins of the arguments; the real bytes where there is nothing new or no meta kernel."""
    if not any(real_bytes):
        return real_bytes
    try:
        meta_args, meta_kwargs = tree_map(_on_meta, (args, kwargs))
        meta_out = func(*meta_args, **meta_kwargs)
        return _new_storage_bytes(list(_tensors(meta_out)), list(_tensors((meta_args, meta_kwargs))))
    except Exception:  # noqa: BLE001 - no meta kernel, or one that needs values: assume it agrees
        return real_bytes


class WorkspaceTracker(LiveTensorTracker):
    """The :class:`~lightning_gpuopt.core.op_memory.LiveTensorTracker` of a fake trace with the kernel
    memory of ``profile`` added: each call paired with a probed one holds its scaled workspace while
    it runs, and each of its outputs counts the probed output's scaled surplus on top of its size.

    Takes the tracker's other arguments (``workspaces`` stays off: the calls are fake). Without a
    profile it is a plain tracker. Call :meth:`next_step` where each traced step after the first
    begins: calls are paired step by step, so the optimizer's (absent from the probe) pair with
    nothing. :attr:`workspace_bytes_at_peak` is the learned kernel memory in :attr:`peak_bytes`.
    """

    def __init__(self, profile: Optional[WorkspaceProfile] = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, workspaces=False, **kwargs)
        self.probed = {} if profile is None else profile.by_signature()
        self.workspace_bytes_at_peak = 0
        self._seen: collections.Counter = collections.Counter()
        self._surplus: dict[int, int] = {}  # storages counted above their fake size: key -> bytes

    def __enter__(self) -> WorkspaceTracker:
        self._seen.clear()
        self._surplus.clear()
        self.workspace_bytes_at_peak = 0
        super().__enter__()
        return self

    def next_step(self) -> None:
        """Calls from now on belong to the next step."""
        self._seen.clear()

    def _partner(self, signature: Signature) -> Optional[ProbedCall]:
        index = self._seen[signature]
        self._seen[signature] += 1
        partners = self.probed.get(signature, ())
        return partners[index] if index < len(partners) else None

    def _surplus_live(self) -> int:
        for key in [key for key in self._surplus if key not in self._live]:
            del self._surplus[key]
        return sum(self._surplus.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not self.probed:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, outputs = list(_tensors((args, kwargs))), list(_tensors(out))
        partner = self._partner(_signature(func, inputs))
        traced_inputs = _input_bytes(inputs)

        def scaled(num_bytes: int) -> int:
            return 0 if partner is None else scaled_bytes(num_bytes, partner.input_bytes, traced_inputs)

        exclude = {storage_key(storage) for storage in map(storage_of, inputs) if storage is not None}
        new: list[tuple[int, torch.UntypedStorage, int, int]] = []  # key, storage, bytes, of which surplus
        for index, output in enumerate(outputs):
            storage = storage_of(output)
            if (
                storage is None
                or not self._counts(output)
                or storage_key(storage) in exclude
                or storage_key(storage) in self._live
            ):
                continue
            exclude.add(storage_key(storage))
            fake_bytes = round_up(storage.nbytes(), self.granularity)
            surplus = scaled(partner.surplus_bytes[index]) if partner and index < len(partner.surplus_bytes) else 0
            if fake_bytes + surplus > 0:
                new.append((storage_key(storage), storage, fake_bytes + surplus, surplus))
        added = sum(num_bytes for _, _, num_bytes, _ in new)
        workspace = 0 if partner is None else scaled(partner.extra_bytes)
        needed = added + workspace
        if self.max_bytes is not None and needed and self.live_bytes + needed > self.max_bytes:
            raise torch.OutOfMemoryError(self._oom_message(func, needed))
        if self.live_bytes + needed > self.peak_bytes:
            self.peak_bytes = self.live_bytes + needed
            self.workspace_bytes_at_peak = self._surplus_live() + sum(surplus for *_, surplus in new) + workspace
        for key, storage, num_bytes, surplus in new:
            self._add(key, storage, num_bytes)
            if surplus:
                self._surplus[key] = surplus
        return out
