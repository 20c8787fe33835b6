"""The card :class:`lightning_gpuopt.testing.SimulatedGpu` simulates: a :class:`~lightning_gpuopt.core.device.Device`
and, while entered, the dispatch mode that serves each storage on the card, and each of its ops'
in-kernel workspaces, from the caching-allocator model until it dies.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_gpuopt.core._torch_compat import FakeTensor, TorchDispatchMode, storage_key
from lightning_gpuopt.core.device import Capabilities, Device, HostEvent
from lightning_gpuopt.core.op_memory import (
    OpAllocations,
    SpanMeter,
    call_learning_allocations,
    collect_tensors,
    is_real_host_call,
    leaves,
    storage_of,
)
from lightning_gpuopt.testing._allocator import AllocatorOutOfMemory, Block, CachingAllocatorModel, PeakWindow

# ops that use cuBLAS on a real card (its workspace is allocated on the first of them)
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm", "addmv", "mv", "dot"})


@dataclass(frozen=True)
class GpuProfile:
    """A CUDA card's identity and memory, as torch and NVML report them."""

    name: str
    capability: tuple[int, int]
    total_bytes: int
    uuid: str
    context_bytes: int  #: memory the CUDA context holds outside PyTorch's allocator (NVML counts it as used)
    mig: bool = False

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of_cuda(self.name, self.capability, mig=self.mig)


class SimulatedCudaDevice(Device, TorchDispatchMode):
    """A CUDA card of ``profile`` simulated on the host (``cublas_workspace_bytes`` default: torch's)."""

    type = "cuda"

    def __init__(self, profile: GpuProfile, cublas_workspace_bytes: Optional[int] = None) -> None:
        Device.__init__(self, torch.device("cpu"))
        TorchDispatchMode.__init__(self)
        self.profile = p = profile
        self.allocator = CachingAllocatorModel(
            p.total_bytes - p.context_bytes, total_bytes=p.total_bytes, outside_bytes=p.context_bytes
        )
        default = p.capabilities.cublas_workspace_bytes
        self.cublas_workspace_bytes = default if cublas_workspace_bytes is None else cublas_workspace_bytes
        self.busy_s = 0.0  #: seconds spent inside ops (what NVML's utilisation counts as busy)
        self._blocks: dict[int, tuple[weakref.ref, Block]] = {}  # storage key -> its block
        self._cublas: Optional[Block] = None
        self._adopted: weakref.WeakSet[Any] = weakref.WeakSet()  # modules and optimizers on the card
        self._hooks: list[Any] = []
        self._forward_depth = self._paused = 0  # while _paused is positive, nothing reaches the card

    @property
    def uuid(self) -> str:
        return self.profile.uuid

    @property
    def capabilities(self) -> Capabilities:
        return self.profile.capabilities

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

    def peak_meter(self, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _SimulatedMeter(self, existing)

    def memory_cap(self, max_bytes: int, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SpanMeter:
        return _SimulatedMeter(self, existing, max_bytes)

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def holds(self, tensor: torch.Tensor) -> bool:
        storage = storage_of(tensor)
        return storage is not None and storage_key(storage) in self._blocks

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def new_event(self) -> HostEvent:
        return HostEvent()

    def __enter__(self) -> SimulatedCudaDevice:
        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook),
            torch.nn.modules.module.register_module_forward_hook(self._forward_hook, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre_hook),
        ]
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    def adopt(self, *objects: Any) -> None:
        """Count the tensors of ``objects`` (modules, optimizers, tensors) from now on, as if moved to the card."""
        new = {storage_key(s): s for s in map(self._countable_storage, collect_tensors(*objects)) if s is not None}
        self._take([storage for key, storage in new.items() if key not in self._blocks])

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._paused:
            return
        if module not in self._adopted:
            self.adopt(module)
            self._adopted.update(module.modules())
        self.adopt([leaf for leaf in leaves(args) if isinstance(leaf, torch.Tensor)])

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)

    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._paused and optimizer not in self._adopted:
            self.adopt(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
            self._adopted.add(optimizer)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat = [] if self._paused else leaves((args, kwargs))
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        on_card = not self._paused and is_real_host_call(flat) and self._on_card(func, tensors, kwargs)
        started = time.perf_counter()
        out, allocations = (
            call_learning_allocations(func, args, kwargs, flat) if on_card else (func(*args, **kwargs), None)
        )
        self.busy_s += time.perf_counter() - started
        if not on_card:
            return out
        if self._cublas is None and self.cublas_workspace_bytes and func.overloadpacket.__name__ in _MATMUL_OPS:
            try:
                self._cublas = self.allocator.malloc(self.cublas_workspace_bytes)
            except AllocatorOutOfMemory as error:
                raise torch.OutOfMemoryError(str(error)) from None
        inputs = {storage_key(s) for s in map(storage_of, tensors) if s is not None}
        outputs = {storage_key(s): s for s in map(self._countable_storage, collect_tensors(out)) if s is not None}
        self._take([s for key, s in outputs.items() if key not in self._blocks and key not in inputs], allocations)
        return out

    def _on_card(self, func: Any, inputs: list, kwargs: dict) -> bool:
        """Whether the op runs on the card: an input is there (the others but 0-dim scalars move there
        first), or it is a factory op inside a ``forward``; ``.to("cpu", copy=True)`` is a copy to the host."""
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return False
        if not inputs:
            return self._forward_depth > 0
        if not any(self.holds(tensor) for tensor in inputs):
            return False
        self.adopt([tensor for tensor in inputs if tensor.dim() > 0])
        return True

    def _take(self, storages: list[torch.UntypedStorage], allocations: Optional[OpAllocations] = None) -> None:
        """Blocks for ``storages``, after an op's ``allocations`` replayed in the profiler's order. A failed
        request forgets what was taken (the op's outputs never reach the caller) and raises CUDA's error."""
        taken: list[Block] = []
        try:
            rest = storages
            if allocations is not None:
                blocks: list[Optional[Block]] = []
                for event in allocations.events:
                    if event > 0:
                        taken.append(self.allocator.malloc(event))
                        blocks.append(taken[-1])
                    else:
                        block, blocks[-event - 1] = blocks[-event - 1], None
                        if block is not None:
                            self.allocator.free(block)
                # the kept allocations become the outputs of their size; one no output takes is a kernel's cache
                kept = [(allocations.sizes[i], b) for i in sorted(allocations.kept) if (b := blocks[i]) is not None]
                rest = []
                for storage in storages:
                    match = next((i for i, (size, _) in enumerate(kept) if size == storage.nbytes()), None)
                    if match is None:
                        rest.append(storage)
                    else:
                        self._track(storage, kept.pop(match)[1])
                for _, block in kept:
                    self.allocator.free(block)
            for storage in rest:
                taken.append(self.allocator.malloc(storage.nbytes()))
                self._track(storage, taken[-1])
        except AllocatorOutOfMemory as error:
            for storage in storages:
                self._blocks.pop(storage_key(storage), None)
            for block in taken:
                self.allocator.free(block)
            raise torch.OutOfMemoryError(str(error)) from None

    def _track(self, storage: torch.UntypedStorage, block: Block) -> None:
        key = storage_key(storage)

        def release(_ref: weakref.ref) -> None:
            entry = self._blocks.pop(key, None)
            if entry is not None:
                self.allocator.free(entry[1])

        self._blocks[key] = (weakref.ref(storage, release), block)

    @staticmethod
    def _countable_storage(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
        if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
            return None
        storage = storage_of(tensor)
        return storage if storage is not None and storage.nbytes() > 0 else None


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
