"""Every torch internal lightning-gpuopt uses, in one place (as ``callbacks/_lightning_compat.py`` is for Lightning).

The rest of the package reaches torch's private modules and attributes only through the names
below; ``tests/unit/test_torch_compat.py`` checks each against the installed torch and names the
internal and the torch version when a release moves one. Written against torch 2.13.

* ``torch.utils._pytree`` (:func:`tree_leaves`, :func:`tree_map`, :func:`tree_flatten`): no public
  pytree module; Lightning's ``apply_to_collection`` does not flatten arbitrary nests.
* ``torch._subclasses.fake_tensor`` (:class:`FakeTensor`, :class:`FakeTensorMode`): the fake tensors a
  step is traced on without allocating; no public API.
* ``torch.utils._python_dispatch`` (:class:`TorchDispatchMode`, :func:`current_dispatch_mode`): the
  mode that sees every op at the dispatcher (storage counting, the simulated card, host reads).
* ``UntypedStorage._cdata`` (:func:`storage_key`): the identity of a storage shared by its views;
  ``data_ptr()`` is 0 for fake and meta storages, so it cannot tell them apart.
* ``torch.autograd._enable_profiler_legacy`` / ``_disable_profiler_legacy`` / ``_profiler_enabled``
  and ``torch._C._profiler._ExperimentalConfig`` (:func:`start_allocation_events`,
  :func:`stop_allocation_events`, :func:`profiler_running`): the allocator's events op by op,
  cheaper than ``torch.profiler.profile`` (no trace object); no public API.
* ``GradScaler._scale`` (:func:`grad_scale`): the scale as a tensor, read without a host sync
  (``get_scale()`` calls ``.item()``).
* :data:`FAKE_KERNEL_LOGGERS`: the loggers fake-tensor kernels report their failures to.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = [
    "FAKE_KERNEL_LOGGERS",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "current_dispatch_mode",
    "grad_scale",
    "profiler_running",
    "start_allocation_events",
    "stop_allocation_events",
    "storage_key",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
]

#: the loggers fake-tensor kernels report to (quieted while a trace falls back)
FAKE_KERNEL_LOGGERS = ("torch._subclasses",)


def current_dispatch_mode() -> Optional[TorchDispatchMode]:
    """The innermost active ``TorchDispatchMode`` (``torch.utils._python_dispatch._get_current_dispatch_mode``)."""
    return _get_current_dispatch_mode()


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity, the same for every view of it (``UntypedStorage._cdata``).

    >>> base = torch.zeros(4)
    >>> storage_key(base[2:].untyped_storage()) == storage_key(base.untyped_storage())
    True
    """
    return storage._cdata


def profiler_running() -> bool:
    """Whether a torch profiler runs in this process (``torch.autograd._profiler_enabled``)."""
    return torch.autograd._profiler_enabled()


def start_allocation_events() -> None:
    """Start the legacy profiler recording the allocator's events (CPU state, ``profile_memory`` on)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.autograd.profiler import ProfilerConfig, ProfilerState

    config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
    torch.autograd._enable_profiler_legacy(config)


def stop_allocation_events() -> list:
    """Stop the legacy profiler; its records, one list per thread (``memory_alloc`` events among them)."""
    return torch.autograd._disable_profiler_legacy()


def grad_scale(scaler: Any) -> Any:
    """A ``GradScaler``'s current scale as its tensor (``_scale``; ``None`` before the first ``scale()``)."""
    return scaler._scale
