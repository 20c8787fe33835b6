"""The card :class:`lightning_gpuopt.testing.SimulatedGpu` simulates: a :class:`~lightning_gpuopt.core.device.Device`
and, while entered, a dispatch mode serving each storage on the card from the caching-allocator model until it dies.
It holds what a card's kernels hold (docs/simulated-gpu.md), an RNN's weights cast once a call, CUDA's ``foreach``
optimizer path, and for SDPA on 4-D tensors with 16-byte-aligned heads the memory-efficient kernel's (``attention.cu``:
output, float32 logsumexp of queries rounded up to 32; in backward the gradients and a float32 ``delta``). A loader
without workers fetches on the host, outside the mode (a batch is counted when it moves to the card).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from lightning_gpuopt.core._torch_compat import (
    FakeTensor,
    TorchDispatchMode,
    current_dispatch_mode,
    outside_dispatch_modes,
    single_process_loader_iterator,
    storage_key,
)
from lightning_gpuopt.core.allocator import Block, CachingAllocatorModel, PeakWindow
from lightning_gpuopt.core.device import Capabilities, Device, HostEvent
from lightning_gpuopt.core.op_memory import SpanMeter, collect_tensors, is_real_host_call, leaves, storage_of
from lightning_gpuopt.core.workspace import card_kernel_workspaces


@dataclass(frozen=True)
class GpuProfile:
    """A CUDA card's identity and memory, as torch and NVML report them."""

    name: str
    capability: tuple[int, int]
    total_bytes: int  #: torch's total (``cudaMemGetInfo``), below NVML's by the driver's reserved memory
    uuid: str  #: NVML's spelling (``GPU-...``); torch's is the bare hex
    context_bytes: int  #: memory the CUDA context holds outside PyTorch's allocator (NVML counts it as used)
    mig: bool = False
    nvml_total_bytes: int = 0  #: NVML's total (0: torch's)


class SimulatedCudaDevice(Device, TorchDispatchMode):
    """A CUDA card of ``profile`` simulated on the host (``cublas_workspace_bytes`` default: torch's)."""

    type = "cuda"

    def __init__(self, profile: GpuProfile, cublas_workspace_bytes: Optional[int] = None) -> None:
        Device.__init__(self, torch.device("cpu"))
        TorchDispatchMode.__init__(self)
        self.profile = p = profile
        grows = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()  # as torch reads it
        limit, total, context = p.total_bytes - p.context_bytes, p.total_bytes, p.context_bytes
        self.allocator = CachingAllocatorModel(limit, total_bytes=total, outside_bytes=context, expandable=grows)
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self.busy_s = 0.0  #: seconds spent inside ops (what NVML's utilisation counts as busy)
        self._blocks: dict[int, tuple[weakref.ref, Optional[Block]]] = {}  # storage key -> its block (None: shared)
        self._cublas: dict[bool, Optional[Block]] = {}  # in backward -> that thread's cuBLAS workspace
        self._casts: Optional[dict[tuple, weakref.ref]] = None  # inside an RNN: (source, dtype) -> its first cast
        self._foreach: list[dict] = []  # param groups switched to the multi-tensor path for one step
        self._adopted: weakref.WeakSet[Any] = weakref.WeakSet()  # modules and optimizers on the card
        self._hooks: list[Any] = []
        self._forward_depth = 0
        self._uncounted = False  # inside a fused kernel's host stand-in

    @property
    def uuid(self) -> str:
        return self.profile.uuid.split("-", 1)[1]  # torch's spelling

    @property
    def capabilities(self) -> Capabilities:
        p = self.profile  # cuBLAS's workspace: as given, else torch's for the capability and the environment
        return Capabilities.of_cuda(p.name, p.capability, mig=p.mig, cublas=self.cublas_workspace_bytes)

    def total_memory(self) -> int:
        return self.profile.total_bytes

    def free_memory(self) -> int:
        return max(0, self.profile.total_bytes - self.used_memory())

    def used_memory(self) -> int:
        """What NVML reports as used: the context and everything reserved."""
        return self.profile.context_bytes + self.allocator.reserved_bytes

    def allocated_memory(self) -> int:
        return self.allocator.allocated_bytes

    def reserved_memory(self) -> int:
        return self.allocator.reserved_bytes

    def memory_cap(self, max_bytes: Optional[int], existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _SimulatedMeter(self, existing, max_bytes)

    def empty_cache(self, workspaces: bool = False) -> None:
        for block in filter(None, self._cublas.values() if workspaces else ()):
            self.allocator.free(block)
        self._cublas = {} if workspaces else self._cublas
        self.allocator.empty_cache()

    def holds(self, tensor: torch.Tensor) -> bool:
        return (storage := storage_of(tensor)) is not None and storage_key(storage) in self._blocks

    def new_event(self) -> HostEvent:
        return HostEvent()

    def __enter__(self) -> SimulatedCudaDevice:
        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook),
            torch.nn.modules.module.register_module_forward_hook(self._forward_hook, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre_hook),
            register_optimizer_step_post_hook(self._optimizer_post_hook),
        ]
        self._sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attention  # type: ignore[assignment]  # where MHA and users find it
        iterator = single_process_loader_iterator()
        self._fetch = fetch = iterator._next_data

        def host_fetch(loader_iterator: Any) -> Any:  # the dataset's ops: 12 us each under the mode, 1 us outside
            if current_dispatch_mode() is not self:
                return fetch(loader_iterator)
            with outside_dispatch_modes():
                return fetch(loader_iterator)

        iterator._next_data = host_fetch
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            F.scaled_dot_product_attention = self._sdpa
            single_process_loader_iterator()._next_data = self._fetch
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._optimizer_post_hook(None, (), {})

    def adopt(self, *objects: Any) -> None:
        """Count the tensors of ``objects`` (modules, optimizers, tensors) from now on, as if moved to the card."""
        new = {storage_key(s): s for s in map(self._countable_storage, collect_tensors(*objects)) if s is not None}
        self._take([storage for key, storage in new.items() if key not in self._blocks])

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._forward_depth += 1
        self._casts = {} if isinstance(module, torch.nn.RNNBase) else self._casts  # an RNN's casts, by source
        if module not in self._adopted:
            self.adopt(module)
            self._adopted.update(module.modules())
        self.adopt([leaf for leaf in leaves(args) if isinstance(leaf, torch.Tensor)])

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        self._casts = None if isinstance(module, torch.nn.RNNBase) else self._casts

    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_post_hook(optimizer, args, kwargs)  # a step that raised left its groups switched
        if optimizer not in self._adopted:
            self.adopt(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
            self._adopted.add(optimizer)
        groups = optimizer.param_groups if "foreach" in optimizer.defaults else []  # CUDA's default: multi-tensor
        self._foreach = [
            g for g in groups if g.get("foreach") is None and not any(map(g.get, ("fused", "differentiable")))
        ]
        for group in self._foreach:
            group["foreach"] = True

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in self._foreach:
            group["foreach"] = None
        self._foreach = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat = leaves((args, kwargs))
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        on_card = not self._uncounted and is_real_host_call(flat) and self._on_card(func, tensors, kwargs)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        self.busy_s += time.perf_counter() - started
        if not on_card:
            return out
        name = func.overloadpacket.__name__
        inputs = {storage_key(s) for s in map(storage_of, tensors) if s is not None}
        outputs = {storage_key(s): s for s in map(self._countable_storage, collect_tensors(out)) if s is not None}
        new = [s for key, s in outputs.items() if key not in self._blocks and key not in inputs]
        if self._casts is not None and name == "_to_copy" and len(new) == 1 and (source := storage_of(tensors[0])):
            cast = (storage_key(source), kwargs.get("dtype"))  # an RNN's weight: cast once on a card
            first = self._casts.get(cast, lambda: None)()
            self._casts[cast] = weakref.ref(new[0] if first is None else first)
            if first is not None:
                self._track(new[0], None)  # held while the first cast is
                return out
        self._take(new)
        thread, transient = card_kernel_workspaces(name, tensors)
        if thread is not None and thread not in self._cublas:
            size = self.capabilities.cublas_workspace_bytes
            self._cublas[thread] = self.allocator.malloc(size) if size else None
        if transient is not None:
            with contextlib.suppress(torch.OutOfMemoryError):
                self.allocator.free(self.allocator.malloc(transient))
        return out

    def _on_card(self, func: Any, inputs: list, kwargs: dict) -> bool:
        """Whether the op runs on the card: an input is there (the others but 0-dim scalars move there), or a factory
        op inside ``forward``; ``.to("cpu")`` copies to the host, ``card.copy_(host)`` from it (allocating nothing)."""
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return False
        if not inputs:
            return self._forward_depth > 0
        if func is torch.ops.aten.copy_.default or not any(self.holds(tensor) for tensor in inputs):
            return func is torch.ops.aten.copy_.default and self.holds(inputs[0])
        self.adopt([tensor for tensor in inputs if tensor.dim() > 0])
        return True

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        if self.holds(q) and q.dim() == 4 and not any(t.size(-1) % (16 // t.element_size()) for t in (q, k, v)):
            return _MemoryEfficientAttention.apply(self, rest, kwargs, q, k, v)
        return self._sdpa(q, k, v, *rest, **kwargs)

    @contextlib.contextmanager
    def uncounted(self) -> Any:
        self._uncounted, before = True, self._uncounted
        try:
            yield
        finally:
            self._uncounted = before

    def _take(self, storages: list[torch.UntypedStorage]) -> None:
        """Blocks for ``storages``; a failed request forgets what was taken and raises CUDA's error."""
        taken: list[Block] = []
        try:
            for storage in storages:
                taken.append(self.allocator.malloc(storage.nbytes()))
                self._track(storage, taken[-1])
        except torch.OutOfMemoryError:
            for storage, block in zip(storages, taken):
                self._blocks.pop(storage_key(storage), None)
                self.allocator.free(block)
            raise

    def _track(self, storage: torch.UntypedStorage, block: Optional[Block]) -> None:
        key = storage_key(storage)

        def release(_ref: weakref.ref) -> None:
            if (entry := self._blocks.pop(key, None)) is not None and entry[1] is not None:
                self.allocator.free(entry[1])

        self._blocks[key] = (weakref.ref(storage, release), block)

    @staticmethod
    def _countable_storage(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
        if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
            return None
        return storage if (storage := storage_of(tensor)) is not None and storage.nbytes() > 0 else None


class _MemoryEfficientAttention(torch.autograd.Function):
    """The host's math path, uncounted; the card holds what the fused kernel allocates (module docstring)."""

    @staticmethod
    def forward(ctx: Any, device: SimulatedCudaDevice, rest: tuple, kwargs: dict, *qkv: torch.Tensor) -> Any:
        with torch.enable_grad(), device.uncounted():
            ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in qkv]
            ctx.out, ctx.device = device._sdpa(*ctx.inputs, *rest, **kwargs), device
            lse = torch.empty(*qkv[0].shape[:2], -(-qkv[0].size(2) // 32) * 32 if ctx.out.requires_grad else 0)
        device._take([s for s in map(device._countable_storage, (ctx.out, lse)) if s is not None])
        ctx.save_for_backward(lse)  # released once backward has run, as the kernel's saved logsumexp
        return ctx.out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        with ctx.device.uncounted():
            found = iter(torch.autograd.grad(ctx.out, [t for t in ctx.inputs if t.requires_grad], grad))
        grads = [next(found) if t.requires_grad else None for t in ctx.inputs]
        ctx.device._take([s for g in grads if g is not None and (s := ctx.device._countable_storage(g)) is not None])
        ctx.device.allocator.free(ctx.device.allocator.malloc(grad[..., 0].numel() * 4))  # delta: float32 per query
        ctx.inputs = ctx.out = None  # the saved tensors go once backward has run
        return (None, None, None, *grads)


class _SimulatedMeter(SpanMeter):
    """A window over the card's allocator (``max_bytes``: its reserve limit); ``existing`` moves to the card."""

    def __init__(self, device: SimulatedCudaDevice, existing: Iterable[Any] = (), max_bytes: Optional[int] = None):
        self.device, self.existing, self.max_bytes = device, tuple(existing), max_bytes
        self._window: Optional[PeakWindow] = None
        self._limit: Optional[int] = None

    def _begin(self) -> None:
        allocator = self.device.allocator
        if self.max_bytes is not None:
            self._limit = allocator.limit_bytes
            allocator.limit_bytes = min(allocator.limit_bytes, int(self.max_bytes))
        self._window = allocator.open_window()
        try:
            self.device.adopt(*self.existing)
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        if self._window is not None:
            window, self._window = self.device.allocator.close_window(self._window), None
            self.peak_bytes, self.peak_reserved_bytes = window.peak_allocated_bytes, window.peak_reserved_bytes
        if self._limit is not None:
            self.device.allocator.limit_bytes, self._limit = self._limit, None
