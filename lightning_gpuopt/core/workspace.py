"""Kernel memory a fake trace misses, learned per op call from a small real step on the host.

:class:`WorkspaceRecorder` keeps, per op call of a real step, what its kernel allocates inside itself (oneDNN's
reorders) and returns beyond its meta twin (oneDNN's LSTM workspace); :class:`WorkspaceTracker` adds it, scaled to the
inputs, to the k-th call of each signature in a fake step, and records a card's kernels' allocations too.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lightning_gpuopt.core._torch_compat import TorchDispatchMode, in_backward, storage_key, tree_map
from lightning_gpuopt.core.op_memory import (
    LiveTensorTracker,
    call_learning_allocations,
    is_real_host_call,
    leaves,
    storage_of,
)

#: the largest batch a probe runs at (PyTorch and oneDNN pick kernels by batch size below it)
PROBE_BATCH_SIZE = 16
#: ops that use cuBLAS on a card (a thread's workspace is allocated on its first of them)
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm", "addmv", "mv", "dot"})


def _signature(func: Any, tensors: list[torch.Tensor]) -> tuple:
    """The op and its tensor arguments' ranks and dtypes (not sizes: those follow the batch)."""
    return (func, *((tensor.dim(), tensor.dtype) for tensor in tensors))


def _input_bytes(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(tensor.numel() * tensor.element_size() for tensor in tensors)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in leaves(tree) if isinstance(leaf, torch.Tensor)]


@dataclass(frozen=True)
class ProbedCall:
    """One op call of a real step, as the allocator served it."""

    signature: tuple
    extra_bytes: int  #: the allocator's peak inside the call above what was live before it, less the new outputs
    surplus_bytes: tuple[int, ...]  #: per tensor output: how much larger its new storage is than the meta kernel's
    input_bytes: tuple[int, ...]  #: bytes of each tensor argument: what the probed bytes are scaled by


def _scaled_bytes(probed_bytes: int, probed_inputs: tuple[int, ...], traced_inputs: tuple[int, ...]) -> int:
    """``probed_bytes`` scaled by the growth of the inputs whose size changed (the activations).

    >>> _scaled_bytes(1000, probed_inputs=(400, 9000), traced_inputs=(1600, 9000))  # 4x the batch
    4000
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
    batch_size: Optional[int] = None  #: the batch size the probe ran at (``None``: the batch as given)
    seconds: float = 0.0
    failure: Optional[str] = None

    @property
    def learned(self) -> bool:
        return self.failure is None

    @property
    def workspace_calls(self) -> int:
        """How many calls allocated more than a fake trace sees (a workspace, larger outputs)."""
        return sum(1 for call in self.calls if call.extra_bytes > 0 or any(call.surplus_bytes))


class WorkspaceRecorder(TorchDispatchMode):
    """Records a :class:`ProbedCall` for every op call on real host tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[ProbedCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat = leaves((args, kwargs))
        if not is_real_host_call(flat):
            return func(*args, **kwargs)
        out, peak = call_learning_allocations(func, args, kwargs, flat)
        inputs = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        outputs = _new_storage_bytes(_tensors(out), inputs)
        extra = max(0, (peak or 0) - sum(outputs))
        fakes = _meta_output_bytes(func, args, kwargs, outputs)
        surplus = tuple(max(0, real - fake) for real, fake in zip(outputs, fakes))
        self.calls.append(ProbedCall(_signature(func, inputs), extra, surplus, _input_bytes(inputs)))
        return out


def _new_storage_bytes(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[int]:
    """Per output: its storage's bytes if new (shared with no input and no earlier output), else 0."""
    seen = {storage_key(storage) for storage in map(storage_of, inputs) if storage is not None}
    sizes = []
    for storage in map(storage_of, outputs):
        if storage is None or storage_key(storage) in seen:
            sizes.append(0)
            continue
        seen.add(storage_key(storage))
        sizes.append(storage.nbytes())
    return sizes


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return torch.device("meta") if isinstance(value, torch.device) else value


def card_kernel_workspaces(name: str, tensors: list[torch.Tensor]) -> tuple[Optional[bool], Optional[int]]:
    """What a card's kernels allocate around op ``name`` on ``tensors`` (the simulated card's rule, and the replay's):
    the thread (``in_backward()``) whose cuBLAS workspace a matrix product needs, kept from its first (``None``: no
    matrix product), and a convolution's transient cuDNN workspace, its largest input's bytes (``None``: none)."""
    thread = in_backward() if name in MATMUL_OPS else None
    transient = max(_input_bytes(tensors), default=0) if name in ("convolution", "convolution_backward") else None
    return thread, transient


def _meta_output_bytes(func: Any, args: tuple, kwargs: dict, real_bytes: list[int]) -> list[int]:
    """Per output, its bytes from the op's meta kernel (the real ones where there is no meta kernel)."""
    if not any(real_bytes):
        return real_bytes
    try:
        meta_args, meta_kwargs = tree_map(_on_meta, (args, kwargs))
        return _new_storage_bytes(_tensors(func(*meta_args, **meta_kwargs)), _tensors((meta_args, meta_kwargs)))
    except Exception:  # noqa: BLE001 - no meta kernel, or one that needs values: assume it agrees
        return real_bytes


class WorkspaceTracker(LiveTensorTracker):
    """A fake trace's tracker with ``profile``'s kernel memory added; ``cublas_bytes`` (a card's step): records the
    events, the card's kernels' included. Call :meth:`next_step` where each later step begins."""

    def __init__(
        self, profile: Optional[WorkspaceProfile] = None, *args: Any, cublas_bytes: Optional[int] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, workspaces=False, record=cublas_bytes is not None, **kwargs)
        self.cublas_bytes, self._cublas, self.step = cublas_bytes or 0, set[bool](), 0
        self.probed: dict[tuple, list[ProbedCall]] = collections.defaultdict(list)
        for call in () if profile is None else profile.calls:
            self.probed[call.signature].append(call)
        self._seen: collections.Counter = collections.Counter()

    def _begin(self) -> None:
        self._seen.clear()
        self._cublas.clear()
        super()._begin()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.sizes is None:  # not recording
            return out
        thread, transient = card_kernel_workspaces(func.overloadpacket.__name__, _tensors((args, kwargs or {})))
        if thread is not None and thread not in self._cublas and self.cublas_bytes:  # kept
            self._cublas.add(thread)
            self.sizes.append(self.cublas_bytes)
            self.events.append(-1)
        if transient is not None:  # freed at once, where it fits
            self.sizes.append(transient)
            self.events.append(-2)
        return out

    def next_step(self) -> None:
        """Calls from now on belong to the next step (the recorded events' :attr:`step` begins here)."""
        self._seen.clear()
        self.step = len(self.events)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, int, int, Sequence[int]]:
        out, inputs = func(*args, **kwargs), _tensors((args, kwargs))
        signature = _signature(func, inputs)
        index, partners = self._seen[signature], self.probed.get(signature, [])
        self._seen[signature] += 1
        if index >= len(partners):
            return out, 0, 0, ()
        partner, traced = partners[index], _input_bytes(inputs)
        scaled = [_scaled_bytes(b, partner.input_bytes, traced) for b in (partner.extra_bytes, *partner.surplus_bytes)]
        return out, 0, scaled[0], scaled[1:]
