"""Testing helpers: a CUDA card simulated on the CPU (:class:`SimulatedGpu`), for CI without a GPU: in the block, every
decision of lightning-gpuopt sees that card (identity, caching-allocator memory and its real OOM, NVML readings);
``pin_memory=True`` pins nothing, silently. See docs/simulated-gpu.md for what is and is not simulated.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Optional, Union

from lightning_gpuopt.callbacks._lightning_compat import fp16_kept_on_cpu
from lightning_gpuopt.core.allocator import CachingAllocatorModel
from lightning_gpuopt.core.device import simulating
from lightning_gpuopt.core.memory import parse_memory
from lightning_gpuopt.core.nvml import using_nvml_library
from lightning_gpuopt.testing._card import GpuProfile, SimulatedCudaDevice
from lightning_gpuopt.testing._nvml import FakeNvml, FakeNvmlDevice

__all__ = ["GPU_PROFILES", "GpuProfile", "SimulatedGpu"]

GPU_PROFILES: dict[str, GpuProfile] = {  # the cards SimulatedGpu knows, by short name; totals: torch's, NVML's
    short: GpuProfile(name, capability, mib << 20, uuid, context_mib << 20, "MIG" in name, nvml_mib << 20)
    for short, name, capability, mib, nvml_mib, uuid, context_mib in [
        ("H100", "NVIDIA H100 80GB HBM3", (9, 0), 81008, 81559, "GPU-5d3c8f2e-7a41-4c0b-9e57-1f0a2b3c4d01", 512),
        ("A100", "NVIDIA A100-SXM4-40GB", (8, 0), 40335, 40960, "GPU-8a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c02", 430),
        ("V100", "Tesla V100-SXM2-16GB", (7, 0), 16148, 16160, "GPU-1f2e3d4c-5b6a-4978-8695-a4b3c2d1e003", 310),
        ("T4", "Tesla T4", (7, 5), 15104, 15360, "GPU-0a9b8c7d-6e5f-4d3c-ab2a-1b0c9d8e7f04", 290),
        ("A100-MIG-1g.10gb", "NVIDIA A100-SXM4-80GB MIG 1g.10gb", (8, 0), 9728, 9728, "MIG-3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e05", 250),
    ]
}  # fmt: skip


class SimulatedGpu:
    """A CUDA card simulated on the CPU while the block runs (see the module docstring); a Trainer made in the
    block with ``precision="16-mixed"`` runs float16 autocast and a ``GradScaler`` as on a card, not bf16-mixed.

    Args:
        profile: a name of :data:`GPU_PROFILES` or a :class:`GpuProfile`.
        memory: the card's memory instead: bytes, ``"64MiB"``, or a fraction of the profile's (the context scales).
        context_memory: memory the CUDA context holds outside PyTorch (default: the profile's, scaled).
        cublas_workspace: bytes of the cuBLAS workspace (default: torch's for the capability).
        nvml_error: ``"no-permission"`` or ``"not-supported"``: every NVML query about the card raises it.

    >>> import torch
    >>> with SimulatedGpu("T4", memory="64MiB") as gpu:
    ...     x = torch.ones(1000)                        # host memory: not on the card
    ...     gpu.place(x)                                # the simulated x.cuda(): 4000 bytes take
    ...     gpu.allocated_bytes, gpu.reserved_bytes     # a 4096-byte block of a 2 MiB segment
    (4096, 2097152)
    """

    def __init__(
        self,
        profile: Union[str, GpuProfile] = "H100",
        memory: Union[int, float, str, None] = None,
        *,
        context_memory: Union[int, str, None] = None,
        cublas_workspace: Optional[int] = None,
        nvml_error: Optional[str] = None,
    ) -> None:
        base = profile if isinstance(profile, GpuProfile) else GPU_PROFILES.get(profile)
        if base is None:
            known = ", ".join(map(repr, GPU_PROFILES))
            raise ValueError(f"`profile`={profile!r} is not a known card; expected one of {known} or a GpuProfile.")
        if isinstance(memory, float) and 0 < memory <= 1:
            total = int(memory * base.total_bytes)
        else:
            total = base.total_bytes if memory is None else parse_memory(memory, name="memory")
        context = int(base.context_bytes * total / base.total_bytes)
        if context_memory is not None:
            context = 0 if context_memory == 0 else parse_memory(context_memory, name="context_memory")
        if context >= total:
            nothing = f"leaves nothing of the card's {total} bytes; expected a context smaller than `memory`"
            raise ValueError(f"`context_memory`={context} bytes {nothing}.")
        if nvml_error not in (None, "no-permission", "not-supported"):
            raise ValueError(f"`nvml_error`={nvml_error!r} is not one of None, 'no-permission', 'not-supported'.")
        driver = int(max(0, base.nvml_total_bytes - base.total_bytes) * total / base.total_bytes)  # NVML's reserved
        self.profile = p = GpuProfile(base.name, base.capability, total, base.uuid, context, base.mig, total + driver)
        self.device = SimulatedCudaDevice(p, cublas_workspace)
        utilization = None if p.mig else self.utilization
        card = FakeNvmlDevice(p.name, p.uuid, total + driver, self.device.used_memory, utilization, nvml_error, p.mig)
        card.memory_reserved = driver
        self.nvml = FakeNvml([card])
        self._entered, self._last_reading = contextlib.ExitStack(), (time.perf_counter(), 0.0)

    @property
    def allocator(self) -> CachingAllocatorModel:
        return self.device.allocator

    @property
    def allocated_bytes(self) -> int:
        return self.allocator.allocated_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.allocator.reserved_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Peak since the card was made (the process-wide counter; a real card's meters reset it)."""
        return self.allocator.stats.peak_allocated_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        return self.allocator.stats.peak_reserved_bytes

    def place(self, *objects: Any) -> None:
        """Put the tensors of ``objects`` on the card: the simulated ``tensor.cuda()``."""
        self.device.adopt(*objects)

    def utilization(self) -> int:
        """Percent of wall time spent inside ops since the last call (what NVML's utilisation counts)."""
        now, busy = time.perf_counter(), self.device.busy_s
        then, busy_then = self._last_reading
        self._last_reading = (now, busy)
        return 0 if now <= then else round(100 * min(1.0, (busy - busy_then) / (now - then)))

    def __enter__(self) -> SimulatedGpu:
        with contextlib.ExitStack() as stack:
            contexts = (simulating(self.device), self.device, using_nvml_library(self.nvml), fp16_kept_on_cpu())
            for context in (*contexts, warnings.catch_warnings()):
                stack.enter_context(context)
            warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")  # a no-op here
            self._entered = stack.pop_all()
        self._last_reading = (time.perf_counter(), self.device.busy_s)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._entered.close()
