"""A CUDA card simulated on the host: the device behind :class:`lightning_gpuopt.testing.SimulatedGpu`.

Tensors stay on the CPU; what the card *holds* is counted at the host allocator and passed
through :class:`~lightning_gpuopt.core.allocator.CachingAllocatorModel`:

* a tensor is *on the card* as it would be in a real run: a module's parameters, buffers and
  gradients from its first ``forward`` (a global forward pre-hook, which also brings the
  forward's tensor arguments: the batch), an optimizer's state from its first step (a global
  step pre-hook), what :meth:`SimulatedMemory.adopt` is given (the simulated ``tensor.cuda()``),
  the outputs of every op with an input on the card (but an explicit ``.to("cpu", copy=True)``),
  and the outputs of factory ops (no tensor input) called inside a ``forward``. An op mixing card and host tensors moves the host ones to
  the card first (a real card would refuse the mix), except 0-dim CPU scalars, which CUDA
  accepts. Everything else -- a dataset built in host memory, the loader's collation -- stays on
  the host and is not counted;
* every storage on the card is a request to the model, from the op that made it until the
  storage dies (a weak reference calls back), and so is each such op's in-kernel workspace,
  replayed in the order the profiler saw its allocations and frees (:mod:`.op_memory`);
* the first matrix multiplication allocates the cuBLAS workspace, kept for the card's life;
* a request that would take reserved memory past the limit first frees cached segments, then
  raises the real ``torch.OutOfMemoryError`` with CUDA's wording.

Fake and meta tensors (the estimate's traces) are not counted: they allocate nothing.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_gpuopt.core._torch_compat import FakeTensor, TorchDispatchMode, storage_key, tree_leaves
from lightning_gpuopt.core.allocator import AllocatorOutOfMemory, Block, CachingAllocatorModel, PeakWindow
from lightning_gpuopt.core.device import Capabilities, Device, HostEvent, SpanMeter
from lightning_gpuopt.core.memory import collect_tensors, is_real_host_call, storage_of
from lightning_gpuopt.core.op_memory import OpAllocations, call_learning_allocations

#: ops that use cuBLAS on a real card (its workspace is allocated on the first of them)
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm", "addmv", "mv", "dot"})


@dataclass(frozen=True)
class GpuProfile:
    """A CUDA card's identity and memory, as torch and NVML report them."""

    name: str
    capability: tuple[int, int]
    total_bytes: int
    uuid: str
    #: memory the CUDA context holds outside PyTorch's allocator (NVML counts it as used)
    context_bytes: int
    mig: bool = False

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of_cuda(self.name, self.capability, mig=self.mig)


class SimulatedMemory(TorchDispatchMode):
    """Counts what the simulated card holds (see the module docstring); a dispatch mode active
    while the card is entered."""

    def __init__(self, allocator: CachingAllocatorModel, cublas_workspace_bytes: int) -> None:
        super().__init__()
        self.allocator = allocator
        self.cublas_workspace_bytes = cublas_workspace_bytes
        self._blocks: dict[int, tuple[weakref.ref, list[Block]]] = {}
        self._cublas: Optional[Block] = None
        self._adopted_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._adopted_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hooks: list[Any] = []
        self._forward_depth = 0
        #: while positive, nothing reaches the card (host-only work, see ``core.device.host_only``)
        self.paused = 0
        #: seconds spent inside ops (what NVML's utilisation counts as busy)
        self.busy_s = 0.0

    # -- lifecycle
    def __enter__(self) -> SimulatedMemory:
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

    # -- tensors that reach the card
    def holds(self, tensor: torch.Tensor) -> bool:
        storage = storage_of(tensor)
        return storage is not None and storage_key(storage) in self._blocks

    def adopt(self, *objects: Any) -> None:
        """Count the tensors of ``objects`` (modules, optimizers, tensors) from now on, as if moved to the card."""
        new: dict[int, torch.UntypedStorage] = {}
        for tensor in collect_tensors(*objects):
            storage = self._countable_storage(tensor)
            if storage is not None and storage_key(storage) not in self._blocks:
                new[storage_key(storage)] = storage
        pending: list[Block] = []
        try:
            self._allocate_storages(list(new.values()), pending)
        except AllocatorOutOfMemory as error:
            self._undo(new.values(), pending, error)

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self.paused:
            return
        if module not in self._adopted_modules:
            self.adopt(module)
            self._adopted_modules.update(module.modules())
        self.adopt(list(_tensors(args)))

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)

    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.paused and optimizer not in self._adopted_optimizers:
            self.adopt(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
            self._adopted_optimizers.add(optimizer)

    # -- ops
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        on_card = not self.paused and is_real_host_call((args, kwargs)) and self._on_card(func, args, kwargs)
        started = time.perf_counter()
        allocations = None
        if on_card:
            out, allocations = call_learning_allocations(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self.busy_s += time.perf_counter() - started
        if not on_card:
            return out
        if self._cublas is None and self.cublas_workspace_bytes and func.overloadpacket.__name__ in _MATMUL_OPS:
            try:
                self._cublas = self._malloc(self.cublas_workspace_bytes, [])
            except AllocatorOutOfMemory as error:
                raise torch.OutOfMemoryError(error.message) from None
        inputs = {storage_key(s) for s in map(storage_of, _tensors((args, kwargs))) if s is not None}
        outputs: dict[int, torch.UntypedStorage] = {}
        for tensor in _tensors(out):
            storage = self._countable_storage(tensor)
            if storage is not None and storage_key(storage) not in self._blocks and storage_key(storage) not in inputs:
                outputs[storage_key(storage)] = storage
        self._replay(allocations, list(outputs.values()))
        return out

    def _on_card(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether the op runs on the card: an input is there (the others are moved there first),
        or it is a factory op inside a ``forward``. An explicit copy to ``"cpu"``
        (``tensor.to("cpu", copy=True)``) is a copy to the host."""
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return False
        inputs = list(_tensors((args, kwargs)))
        if not inputs:
            return self._forward_depth > 0
        if not any(self.holds(tensor) for tensor in inputs):
            return False
        self.adopt([tensor for tensor in inputs if tensor.dim() > 0])
        return True

    def _replay(self, allocations: Optional[OpAllocations], outputs: list[torch.UntypedStorage]) -> None:
        """The op's requests in the profiler's order: workspaces come and go, kept allocations
        become the outputs' blocks (matched by size); outputs the profiler did not see come last."""
        taken: list[Block] = []
        kept: list[Block] = []
        try:
            if allocations is not None:
                sizes = allocations.sizes
                blocks: list[Optional[Block]] = []
                for event in allocations.events:
                    if event > 0:
                        blocks.append(self._malloc(event, taken))
                    else:
                        block = blocks[-event - 1]
                        if block is not None:
                            self.allocator.free(block)
                            blocks[-event - 1] = None
                kept = [blocks[i] for i in sorted(allocations.kept) if blocks[i] is not None]  # type: ignore[misc]
                kept_sizes = [sizes[i] for i in sorted(allocations.kept)]
            else:
                kept_sizes = []
            unmatched = self._bind(outputs, kept, kept_sizes)
            self._allocate_storages(unmatched, pending=taken)
        except AllocatorOutOfMemory as error:
            self._undo(outputs, taken, error)  # the op's outputs never reach the caller

    def _bind(self, outputs: list[torch.UntypedStorage], kept: list[Block], kept_sizes: list[int]) -> list:
        """Give the kept allocations to the outputs of the same size; a kept allocation no output
        takes is a cache of the kernel, freed here. Returns the outputs left without a block."""
        free = list(zip(kept_sizes, kept))
        unmatched = []
        for storage in outputs:
            match = next((i for i, (size, _) in enumerate(free) if size == storage.nbytes()), None)
            if match is None:
                unmatched.append(storage)
                continue
            _, block = free.pop(match)
            self._track(storage, [block])
        for _, block in free:
            self.allocator.free(block)
        return unmatched

    def _allocate_storages(self, storages: list[torch.UntypedStorage], pending: list[Block]) -> None:
        for storage in storages:
            self._track(storage, [self._malloc(storage.nbytes(), pending)])

    def _undo(
        self, storages: Iterable[torch.UntypedStorage], pending: list[Block], error: AllocatorOutOfMemory
    ) -> None:
        """Forget what a failed request's op or move had taken, and raise CUDA's error."""
        for storage in storages:
            self._blocks.pop(storage_key(storage), None)
        for block in pending:
            self.allocator.free(block)
        raise torch.OutOfMemoryError(error.message) from None

    def _malloc(self, num_bytes: int, pending: list[Block]) -> Block:
        block = self.allocator.malloc(num_bytes)
        pending.append(block)
        return block

    def _track(self, storage: torch.UntypedStorage, blocks: list[Block]) -> None:
        key = storage_key(storage)

        def release(_ref: weakref.ref, key: int = key) -> None:
            entry = self._blocks.pop(key, None)
            if entry is not None:
                for block in entry[1]:
                    self.allocator.free(block)

        self._blocks[key] = (weakref.ref(storage, release), blocks)

    @staticmethod
    def _countable_storage(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
        if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
            return None
        storage = storage_of(tensor)
        if storage is None or storage.nbytes() == 0:
            return None
        return storage


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class SimulatedCudaDevice(Device):
    """A CUDA card of ``profile`` simulated on the host (see the module docstring).

    Args:
        profile: the card's identity and memory.
        cublas_workspace_bytes: the cuBLAS workspace (default: torch's for the card's capability).
    """

    type = "cuda"

    def __init__(self, profile: GpuProfile, cublas_workspace_bytes: Optional[int] = None) -> None:
        super().__init__(torch.device("cpu"))
        self.profile = profile
        self.allocator = CachingAllocatorModel(
            profile.total_bytes - profile.context_bytes,
            total_bytes=profile.total_bytes,
            outside_bytes=profile.context_bytes,
        )
        workspace = (
            profile.capabilities.cublas_workspace_bytes if cublas_workspace_bytes is None else cublas_workspace_bytes
        )
        self.memory = SimulatedMemory(self.allocator, workspace)

    @property
    def index(self) -> int:
        return 0

    @property
    def uuid(self) -> str:
        return self.profile.uuid

    @property
    def capabilities(self) -> Capabilities:
        return self.profile.capabilities

    @property
    def autocast_device_type(self) -> str:
        return "cpu"  # the tensors are on the host

    @property
    def name(self) -> str:
        return self.profile.name

    def total_memory(self) -> int:
        return self.profile.total_bytes

    def free_memory(self) -> int:
        return max(0, self.profile.total_bytes - self.profile.context_bytes - self.allocator.reserved_bytes)

    def used_memory(self) -> int:
        """What NVML reports as used: the context and everything reserved."""
        return self.profile.context_bytes + self.allocator.reserved_bytes

    def allocated_memory(self) -> int:
        return self.allocator.allocated_bytes

    def reserved_memory(self) -> int:
        return self.allocator.reserved_bytes

    def usable_memory(self, existing: Iterable[Any] = ()) -> int:
        return self.free_memory() + self.reserved_memory()

    def peak_meter(self, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SimulatedPeakMeter:
        return SimulatedPeakMeter(self, existing)

    def memory_cap(self, max_bytes: int, existing: Iterable[Any] = (), baseline_bytes: int = 0) -> SimulatedPeakMeter:
        return SimulatedPeakMeter(self, existing, cap_bytes=max_bytes)

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.memory.holds(tensor)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Host-only work inside the block: nothing it makes reaches the card."""
        self.memory.paused += 1
        try:
            yield
        finally:
            self.memory.paused -= 1

    def new_event(self) -> HostEvent:
        return HostEvent()


class SimulatedPeakMeter(SpanMeter):
    """A window over the simulated allocator; with ``cap_bytes`` the allocator may reserve at most
    that much inside it (as ``set_per_process_memory_fraction``). ``existing`` tensors not on the
    card yet are moved to it (counted) at start."""

    def __init__(self, device: SimulatedCudaDevice, existing: Iterable[Any] = (), cap_bytes: Optional[int] = None):
        super().__init__()
        self.device = device
        self.existing = tuple(existing)
        self.cap_bytes = cap_bytes
        self._window: Optional[PeakWindow] = None
        self._limit: Optional[int] = None

    def _begin(self) -> None:
        allocator = self.device.allocator
        if self.cap_bytes is not None:
            self._limit = allocator.limit_bytes
            allocator.limit_bytes = min(allocator.limit_bytes, int(self.cap_bytes))
        self._window = allocator.open_window()
        try:
            self.device.memory.adopt(*self.existing)
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        if self._window is not None:
            window, self._window = self.device.allocator.close_window(self._window), None
            self.peak_bytes, self.peak_reserved_bytes = window.peak_allocated_bytes, window.peak_reserved_bytes
        if self._limit is not None:
            self.device.allocator.limit_bytes, self._limit = self._limit, None
