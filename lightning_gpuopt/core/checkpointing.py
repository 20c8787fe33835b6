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
* outside autograd (``torch.no_grad()``, validation) blocks run plainly;
* a key/value cache handed to a block (``past_key_values``, ``layer_past``, ``cache`` -- the name
  transformers 5.24 gives it -- or any argument holding a cache object, ``use_cache=True``, as
  HuggingFace layers take them) would be grown by the first pass and seen grown by the
  recomputation: checkpointed calls get ``use_cache=False`` and no cache, as HuggingFace's own
  ``GradientCheckpointingLayer`` does.

A model that checkpoints itself -- a HuggingFace ``PreTrainedModel`` with
``supports_gradient_checkpointing`` -- is better served by its own switch:
:func:`enable_native_checkpointing` calls its ``activation_checkpointing_enable()`` (or
``gradient_checkpointing_enable()`` on older transformers) with ``use_reentrant=False``, turns its
``config.use_cache`` off while it is on, and :meth:`CheckpointedBlocks.remove` puts both back.

Whichever way a block is checkpointed, :func:`check_recomputation` runs one step with it and one
without, from the same RNG state, and says where they differ (loss, a gradient, a buffer) or what
the checkpointed step raised: a block is only kept when its recomputation gives the plain step's
numbers.

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
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

#: what ``select_blocks`` accepts: module classes, class names or qualified module names
BlockSpec = Union[type, str]
#: arguments through which HuggingFace layers take a key/value cache (the names its checkpointing clears)
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def is_key_value_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache object (HuggingFace's ``Cache`` and its subclasses:
    ``update`` and ``get_seq_length``), whatever the argument holding it is called -- transformers
    5.24 renamed GPT-2's ``past_key_values`` to ``cache``.

    >>> is_key_value_cache(None), is_key_value_cache(torch.zeros(2))
    (False, False)
    """
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


#: how a recomputed step may differ from the plain one: relative to each tensor's norm
RECOMPUTATION_RTOL = 1e-3


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
            matches = [pair for pair in modules if isinstance(pair[1], entry) and pair[1] is not model]
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
    return [
        (name, module) for name, module in blocks if not any(other and name.startswith(other + ".") for other in names)
    ]


@contextlib.contextmanager
def _batchnorm_stats_kept(module: nn.Module) -> Iterator[None]:
    """Running statistics of every training-mode BatchNorm in ``module`` put back on exit."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [
        [None if b is None else b.detach().clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)]
        for m in norms
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, saved):
                for current, kept in zip((norm.running_mean, norm.running_var, norm.num_batches_tracked), buffers):
                    if current is not None and kept is not None:
                        current.copy_(kept)


def _without_caches(signature: Optional[inspect.Signature], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the key/value cache cleared and ``use_cache=False``, wherever the
    block's signature puts them (HuggingFace models pass the cache positionally too)."""
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    stores = [bound.arguments]
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and parameter.name in bound.arguments:
            stores.append(bound.arguments[parameter.name])
    changed = False
    for store in stores:
        for name, value in list(store.items()):
            if value is not None and (name in CACHE_ARGUMENTS or is_key_value_cache(value)):
                store[name], changed = None, True
        if store.get("use_cache"):
            store["use_cache"], changed = False, True
    return (bound.args, bound.kwargs) if changed else (args, kwargs)


def _signature(forward: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _checkpointed_forward(module: nn.Module, forward: Any) -> Any:
    signature = _signature(forward)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_caches(signature, args, kwargs)
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
class _NativeSwitch:
    """A model's own checkpointing, switched on by :func:`enable_native_checkpointing`."""

    #: a transformers model: its checkpointing methods and flags are not on ``nn.Module``'s type
    owner: Any
    layers: list[Any]
    config_use_cache: Any
    had_input_grad_hooks: bool

    def pause(self) -> list[Any]:
        paused = [layer for layer in self.layers if getattr(layer, "gradient_checkpointing", False)]
        for layer in paused:
            layer.gradient_checkpointing = False
        return paused

    def remove(self) -> None:
        disable = (
            getattr(self.owner, "activation_checkpointing_disable", None) or self.owner.gradient_checkpointing_disable
        )
        disable()
        if not self.had_input_grad_hooks and callable(getattr(self.owner, "disable_input_require_grads", None)):
            self.owner.disable_input_require_grads()  # the hook gradient_checkpointing_enable() added
        config = getattr(self.owner, "config", None)
        if config is not None and self.config_use_cache is not _MISSING:
            config.use_cache = self.config_use_cache


_MISSING = object()


@dataclass
class CheckpointedBlocks:
    """Handle on the blocks :func:`enable_checkpointing` (or :func:`enable_native_checkpointing`)
    changed; :meth:`remove` undoes it, :meth:`paused` suspends it for a block of code."""

    names: list[str]
    classes: list[str]
    #: how the blocks are checkpointed, for a report: ``"torch.utils.checkpoint"`` or the model's own method
    method: str = "torch.utils.checkpoint"
    _modules: list[nn.Module] = field(default_factory=list, repr=False)
    _native: list[_NativeSwitch] = field(default_factory=list, repr=False)

    @property
    def native(self) -> bool:
        """Whether some of the blocks are checkpointed by the model's own switch
        (:func:`enable_native_checkpointing`), not by ``torch.utils.checkpoint``."""
        return bool(self._native)

    def remove(self) -> None:
        for module in self._modules:
            vars(module).pop("forward", None)
        for switch in reversed(self._native):  # last switched on, first put back
            switch.remove()
        self._modules, self._native = [], []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block the blocks run plainly (checkpointing stays set up)."""
        forwards = [(module, vars(module).pop("forward")) for module in self._modules if "forward" in vars(module)]
        layers = [layer for switch in self._native for layer in switch.pause()]
        try:
            yield
        finally:
            for module, forward in forwards:
                module.forward = forward
            for layer in layers:
                layer.gradient_checkpointing = True

    @classmethod
    def joined(cls, handles: Sequence[CheckpointedBlocks]) -> CheckpointedBlocks:
        """One handle for all of ``handles`` (their methods joined, classes once)."""
        methods = list(dict.fromkeys(handle.method for handle in handles))
        classes = list(dict.fromkeys(name for handle in handles for name in handle.classes))
        return cls(
            names=[n for h in handles for n in h.names],
            classes=classes,
            method=" + ".join(methods),
            _modules=[m for h in handles for m in h._modules],
            _native=[s for h in handles for s in h._native],
        )


def enable_checkpointing(blocks: Iterable[tuple[str, nn.Module]]) -> CheckpointedBlocks:
    """Checkpoint each ``(name, module)`` of ``blocks`` (see the module docstring)."""
    handle = CheckpointedBlocks(names=[], classes=[])
    for name, module in blocks:
        if "forward" in vars(module):  # checkpointed already, or a forward the user patched: leave it
            continue
        module.forward = _checkpointed_forward(module, module.forward)
        handle.names.append(name)
        handle._modules.append(module)
        if type(module).__name__ not in handle.classes:
            handle.classes.append(type(module).__name__)
    return handle


# ----------------------------------------------------------------------------- a model's own checkpointing


def _checkpoints_itself(module: nn.Module) -> bool:
    """A HuggingFace-style model: ``supports_gradient_checkpointing`` and the methods to switch it."""
    return getattr(type(module), "supports_gradient_checkpointing", False) is True and callable(
        getattr(module, "gradient_checkpointing_enable", None)
    )


def native_checkpointing_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` (itself included) that checkpoint themselves.

    Example::

        >>> native_checkpointing_owners(torch.nn.Linear(2, 2))
        []
    """
    if _checkpoints_itself(model):
        return [("", model)]
    return _outermost([(name, module) for name, module in model.named_modules() if _checkpoints_itself(module)])


def _switch_on(owner: Any) -> None:  # a transformers model (see _NativeSwitch.owner)
    enable = getattr(owner, "activation_checkpointing_enable", None)  # transformers >= 5: the deprecation-free name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    try:
        owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:  # transformers < 4.35 takes no arguments
        owner.gradient_checkpointing_enable()


def enable_native_checkpointing(owners: Iterable[tuple[str, nn.Module]]) -> CheckpointedBlocks:
    """Switch on each model's own activation checkpointing (see the module docstring).

    ``owners`` as :func:`native_checkpointing_owners` gives them; the handle names the layers the
    model checkpoints (those whose ``gradient_checkpointing`` flag it set).
    """
    handle = CheckpointedBlocks(names=[], classes=[], method="")
    methods = []
    for owner_name, owner in owners:
        had_hooks = bool(getattr(owner, "_require_grads_hooks", None) or getattr(owner, "_require_grads_hook", None))
        _switch_on(owner)
        config = getattr(owner, "config", None)
        use_cache = getattr(config, "use_cache", _MISSING) if config is not None else _MISSING
        if config is not None and use_cache is not _MISSING:
            config.use_cache = False  # what HF's own training scripts do under checkpointing
        flagged = [
            (name, module)
            for name, module in owner.named_modules()
            if module is not owner
            and not _checkpoints_itself(module)
            and getattr(module, "gradient_checkpointing", False) is True
        ]
        handle._native.append(_NativeSwitch(owner, [m for _, m in flagged], use_cache, had_hooks))
        # the layers it checkpoints: its GradientCheckpointingLayers (an encoder may carry the flag too)
        layers = [
            (n, m) for n, m in flagged if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
        ]
        for name, module in layers or flagged:
            handle.names.append(".".join(part for part in (owner_name, name) if part))
            if type(module).__name__ not in handle.classes:
                handle.classes.append(type(module).__name__)
        switch = (
            "activation_checkpointing_enable"
            if hasattr(owner, "activation_checkpointing_enable")
            else "gradient_checkpointing_enable"
        )
        methods.append(f"{type(owner).__name__}.{switch}()")
    handle.method = ", ".join(methods)
    return handle


# ----------------------------------------------------------------------------- checking a recomputation


@dataclass
class _StepResult:
    loss: torch.Tensor
    grads: list[Optional[torch.Tensor]]
    buffers: list[torch.Tensor]


def _run_step(
    loss_fn: Callable[[Any], torch.Tensor],
    batch: Any,
    params: list[nn.Parameter],
    buffers: list[torch.Tensor],
    step_context: Callable[[], ContextManager[Any]],
) -> _StepResult:
    for param in params:
        param.grad = None
    with step_context():
        loss = loss_fn(batch)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
    loss.backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    return _StepResult(loss.detach().clone(), grads, [b.detach().clone() for b in buffers])


def _relative_gap(plain: Optional[torch.Tensor], recomputed: Optional[torch.Tensor]) -> float:
    """``|recomputed - plain| / |plain|`` (norms); exact for integer tensors; inf where one is missing."""
    if plain is None or recomputed is None:
        return 0.0 if plain is recomputed else float("inf")
    if plain.shape != recomputed.shape:
        return float("inf")
    if not plain.is_floating_point():
        return 0.0 if torch.equal(plain, recomputed) else float("inf")
    plain, recomputed = plain.double(), recomputed.double()
    if torch.equal(plain, recomputed):
        return 0.0
    gap = float((recomputed - plain).norm())
    scale = float(plain.norm())
    return gap / scale if scale > 0 else float("inf")


def _first_difference(
    plain: _StepResult, recomputed: _StepResult, param_names: list[str], buffer_names: list[str], rtol: float
) -> Optional[str]:
    gap = _relative_gap(plain.loss, recomputed.loss)
    if gap > rtol:
        return f"the loss is {float(recomputed.loss):.6g} recomputed, {float(plain.loss):.6g} plain"
    for name, a, b in zip(param_names, plain.grads, recomputed.grads):
        gap = _relative_gap(a, b)
        if gap > rtol:
            return f"the gradient of {name} differs by {gap:.2g} (relative)"
    for name, a, b in zip(buffer_names, plain.buffers, recomputed.buffers):
        gap = _relative_gap(a, b)
        if gap > rtol:
            return f"the buffer {name} differs by {gap:.2g} after the step (updated again by the recomputation?)"
    return None


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def check_recomputation(
    model: nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    batch: Any,
    handle: CheckpointedBlocks,
    *,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    rtol: float = RECOMPUTATION_RTOL,
) -> Optional[str]:
    """``None`` when a training step with ``handle``'s blocks checkpointed gives the plain step's
    loss, gradients and buffers (within ``rtol`` of each tensor's norm); else why not (the first
    difference, or what the checkpointed step raised).

    Both steps start from the same RNG state (dropout and drop-path draw the same masks; the
    non-reentrant checkpoint replays them in the recomputation). Gradients, buffers and the RNG
    state are as before on return; the optimizer does not step. It costs two forward and backward
    passes on ``batch`` and a copy of the gradients, so pass a small batch.

    Example::

        >>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        ...                                for _ in range(2)])
        >>> handle = enable_checkpointing(find_repeated_blocks(blocks))
        >>> check_recomputation(blocks, lambda x: blocks(x).sum(), torch.randn(3, 4), handle) is None
        True
    """
    named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    named_buffers = list(model.named_buffers())
    params = [p for _, p in named_params]
    buffers = [b for _, b in named_buffers]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in buffers]
    devices = sorted({t.device.index or 0 for t in [*params, *buffers] if t.device.type == "cuda"})

    def put_buffers_back() -> None:
        with torch.no_grad():
            for buffer, saved in zip(buffers, saved_buffers):
                buffer.copy_(saved)

    try:
        with torch.random.fork_rng(devices=devices):
            # the plain step, RNG state put back; what it raises is the user's step failing, not the
            # checkpointing: it propagates as it is
            with torch.random.fork_rng(devices=devices), handle.paused():
                plain = _run_step(loss_fn, batch, params, buffers, step_context)
            put_buffers_back()
            try:
                recomputed = _run_step(loss_fn, batch, params, buffers, step_context)
            except Exception as error:  # noqa: BLE001 - the reason to refuse
                return _reason(error)
        return _first_difference(plain, recomputed, [n for n, _ in named_params], [n for n, _ in named_buffers], rtol)
    finally:
        put_buffers_back()
        for param, grad in zip(params, saved_grads):
            param.grad = grad
