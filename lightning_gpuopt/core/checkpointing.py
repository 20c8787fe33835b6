"""Activation checkpointing on a model's repeated blocks, without changing its structure.

A checkpointed block keeps only its inputs during the forward pass and runs its forward again
in the backward pass to get the activations back: the activations of all but one block no
longer live at once, for about one extra forward pass of compute.

:func:`find_repeated_blocks` picks the blocks the way practitioners do by hand: the children of
an ``nn.ModuleList`` / ``nn.Sequential`` that share a class, hold parameters and have submodules
of their own (transformer layers, residual blocks -- not single ``nn.Linear`` layers, whose
output is the next layer's saved input anyway). Blocks nested inside a chosen block are not
chosen again. :func:`select_blocks` takes a user's choice instead: module classes, class names,
or qualified module names.

:func:`enable_checkpointing` replaces each block's ``forward`` *on the instance* with a
checkpointed call (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, the
implementation PyTorch recommends, which also works under DDP). The module tree, parameter
names and ``state_dict`` keys stay as they were, so checkpoints load with or without it and
:meth:`CheckpointedBlocks.remove` undoes it exactly. Two details that naive wrapping gets wrong:

* the recomputation in backward would update BatchNorm running statistics a second time; they
  are saved before and put back after each recomputation, so running stats equal those of an
  uncheckpointed run;
* outside autograd (``torch.no_grad()``, validation) blocks run plainly.

Example::

    >>> import torch
    >>> from torch import nn
    >>> blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    >>> model = nn.Sequential(nn.Linear(4, 8), blocks, nn.Linear(8, 1))
    >>> [name for name, _ in find_repeated_blocks(model)]
    ['1.0', '1.1', '1.2']
    >>> handle = enable_checkpointing(find_repeated_blocks(model))
    >>> model(torch.randn(2, 4)).sum().backward()
    >>> handle.remove(); len(handle.names)
    3
"""

from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

#: what ``select_blocks`` accepts: module classes, class names or qualified module names
BlockSpec = Union[type, str]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as ``(qualified name, module)``, outermost first.

    A block is a child of an ``nn.ModuleList`` or ``nn.Sequential`` whose class at least one
    sibling shares, that holds parameters and has submodules of its own.
    """
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[str] = set()
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name == block or name.startswith(block + ".") for block in inside):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = collections.defaultdict(list)
        for child_name, child in container.named_children():
            if _holds_parameters(child) and _is_composite(child):
                by_class[type(child)].append((f"{name}.{child_name}" if name else child_name, child))
        for members in by_class.values():
            if len(members) >= 2:
                chosen.extend(members)
                inside.update(member_name for member_name, _ in members)
    return chosen


def select_blocks(model: nn.Module, spec: Sequence[BlockSpec]) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``spec`` names, outermost first (nested matches are skipped).

    Each entry of ``spec`` is a module class, a class name (``"TransformerEncoderLayer"``) or a
    qualified module name (``"encoder.layers.0"``).

    Raises:
        ValueError: an entry matches no module (the message lists the model's repeated blocks).
    """
    if isinstance(spec, (str, type)):
        spec = [spec]
    modules = list(model.named_modules())
    names = {name for name, _ in modules}
    chosen: list[tuple[str, nn.Module]] = []
    for entry in spec:
        if isinstance(entry, type):
            matches = [(n, m) for n, m in modules if isinstance(m, entry) and m is not model]
        elif isinstance(entry, str) and entry in names and entry:
            matches = [(n, m) for n, m in modules if n == entry]
        elif isinstance(entry, str):
            matches = [(n, m) for n, m in modules if type(m).__name__ == entry and m is not model]
        else:
            raise ValueError(f"`checkpointing` entry {entry!r} is not a module class, class name or module name.")
        if not matches:
            found = sorted({type(m).__name__ for _, m in find_repeated_blocks(model)})
            raise ValueError(
                f"`checkpointing` entry {_spec_name(entry)!r} matches no module of {type(model).__name__}; its "
                f"repeated blocks are of class {found or 'none'} (or give qualified module names such as "
                f"{[n for n, _ in modules[1:3]]})."
            )
        chosen.extend(match for match in matches if match not in chosen)
    return _outermost(chosen)


def _spec_name(entry: Any) -> str:
    return entry.__name__ if isinstance(entry, type) else str(entry)


def _outermost(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [name for name, _ in blocks]
    return [(name, module) for name, module in blocks
            if not any(other and name.startswith(other + ".") for other in names)]  # fmt: skip


@contextlib.contextmanager
def _batchnorm_stats_kept(module: nn.Module) -> Iterator[None]:
    """Running statistics of every training-mode BatchNorm in ``module`` put back on exit."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [[None if b is None else b.detach().clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)]
             for m in norms]  # fmt: skip
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, saved):
                for current, kept in zip((norm.running_mean, norm.running_var, norm.num_batches_tracked), buffers):
                    if current is not None and kept is not None:
                        current.copy_(kept)


def _checkpointed_forward(module: nn.Module, forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = 0

        def body(*inner_args: Any, **inner_kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*inner_args, **inner_kwargs)
            with _batchnorm_stats_kept(module):  # the recomputation in backward
                return forward(*inner_args, **inner_kwargs)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


@dataclass
class CheckpointedBlocks:
    """Handle on the blocks :func:`enable_checkpointing` changed; :meth:`remove` undoes it."""

    names: list[str]
    classes: list[str]
    _modules: list[nn.Module] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for module in self._modules:
            vars(module).pop("forward", None)
        self._modules = []


def enable_checkpointing(blocks: Iterable[tuple[str, nn.Module]]) -> CheckpointedBlocks:
    """Checkpoint each ``(name, module)`` of ``blocks`` (see the module docstring)."""
    handle = CheckpointedBlocks(names=[], classes=[])
    for name, module in blocks:
        if "forward" in vars(module):  # checkpointed already, or a forward the user patched: leave it
            continue
        module.forward = _checkpointed_forward(module, module.forward)  # type: ignore[method-assign]
        handle.names.append(name)
        handle._modules.append(module)
        if type(module).__name__ not in handle.classes:
            handle.classes.append(type(module).__name__)
    return handle
