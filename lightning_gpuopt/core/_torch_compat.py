"""Every torch internal lightning-gpuopt uses, in one place (as ``callbacks/_lightning_compat.py`` is for Lightning),
each checked against the installed torch (written against 2.13) by ``tests/unit/test_torch_compat.py``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor as FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode as FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as outside_dispatch_modes  # noqa: F401 - re-exported
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode  # noqa: F401 - re-exported
from torch.utils._pytree import tree_flatten as tree_flatten  # torch has no public pytree
from torch.utils._pytree import tree_leaves as tree_leaves
from torch.utils._pytree import tree_map as tree_map

#: the loggers fake-tensor kernels report to (quieted while a trace falls back)
FAKE_KERNEL_LOGGERS = ("torch._subclasses",)
#: a storage's identity, the same for every view of it (``data_ptr()`` is 0 when fake)
storage_key = operator.attrgetter("_cdata")
#: a ``GradScaler``'s scale as its tensor, no host sync unlike ``get_scale()`` (``None`` before the first ``scale()``)
grad_scale = operator.attrgetter("_scale")
#: whether a torch profiler runs in this process
profiler_running = torch.autograd._profiler_enabled
#: stop the legacy profiler (:func:`start_allocation_events`): its records, a list per thread (``memory_alloc`` events)
stop_allocation_events = torch.autograd._disable_profiler_legacy


def start_allocation_events() -> None:
    """Start the legacy profiler (cheaper than ``torch.profiler``) recording the allocator's events (CPU)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.autograd.profiler import ProfilerConfig, ProfilerState

    config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
    torch.autograd._enable_profiler_legacy(config)


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's workspaces (held in the caching allocator until then; the next matmul allocates anew)."""
    torch._C._cuda_clearCublasWorkspaces()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def eager() -> Any:
    """A context in which ``torch.compile``d code runs eager and dynamo sees no frame: its caches stay as
    they are (a compiled frame first called under a dispatch mode would be marked to run eager for good)."""
    return torch.compiler.set_stance("force_eager")


def single_process_loader_iterator() -> Any:
    """The iterator of a ``DataLoader`` without workers: its ``_next_data()`` fetches and collates a batch here."""
    return torch.utils.data.dataloader._SingleProcessDataLoaderIter
