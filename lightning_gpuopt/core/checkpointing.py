"""Activation checkpointing on a model's repeated blocks, without changing its structure: each block's ``forward``
is wrapped *on the instance* (:func:`enable_checkpointing`), or a HuggingFace model's own switch is used
(:func:`enable_native_checkpointing`); :func:`check_recomputation` compares a recomputed step with the plain one."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

BlockSpec = Union[type, str]  #: what :func:`select_blocks` accepts: module classes, class or qualified module names
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")  #: HuggingFace layers' key/value caches
_MISSING = object()


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost same-class siblings in ``nn.ModuleList``/``nn.Sequential`` with parameters and submodules."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, container in model.named_modules():
        inside = any(name == block or name.startswith(block + ".") for block, _ in chosen)
        if inside or not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = collections.defaultdict(list)
        for child_name, child in container.named_children():
            if next(child.parameters(), None) is not None and next(child.children(), None) is not None:
                by_class[type(child)].append((f"{name}.{child_name}" if name else child_name, child))
        chosen.extend(member for members in by_class.values() if len(members) >= 2 for member in members)
    return chosen


def select_blocks(model: nn.Module, spec: Sequence[BlockSpec]) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``spec`` names, outermost first; ``ValueError`` for an entry matching none."""
    if isinstance(spec, (str, type)):
        spec = [spec]
    modules = list(model.named_modules())
    names = {name for name, _ in modules}
    chosen: list[tuple[str, nn.Module]] = []
    for entry in spec:
        if isinstance(entry, type):
            matches = [pair for pair in modules if isinstance(pair[1], entry) and pair[1] is not model]
        elif isinstance(entry, str) and entry and entry in names:
            matches = [(n, m) for n, m in modules if n == entry]
        elif isinstance(entry, str):
            matches = [(n, m) for n, m in modules if type(m).__name__ == entry and m is not model]
        else:
            raise ValueError(f"`checkpointing` entry {entry!r} is not a module class, class name or module name.")
        if not matches:
            found = sorted({type(m).__name__ for _, m in find_repeated_blocks(model)})
            named = entry.__name__ if isinstance(entry, type) else entry
            instead = f"or give qualified module names such as {[n for n, _ in modules[1:3]]}"
            blocks = f"its repeated blocks are of class {found or 'none'} ({instead})"
            raise ValueError(f"`checkpointing` entry {named!r} matches no module of {type(model).__name__}; {blocks}.")
        chosen.extend(match for match in matches if match not in chosen)
    return _outermost(chosen)


def _outermost(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [name for name, _ in blocks]
    return [(name, m) for name, m in blocks if not any(other and name.startswith(other + ".") for other in names)]


@contextlib.contextmanager
def _running_stats_kept(module: nn.Module) -> Iterator[None]:
    """The running statistics of ``module``'s norm layers that track them in training, put back after the block."""
    norms = [m for m in module.modules() if m.training and getattr(m, "track_running_stats", False)]
    stats = [(m, n, getattr(m, n, None)) for m in norms for n in ("running_mean", "running_var", "num_batches_tracked")]
    saved = [(m, name, t.detach().clone()) for m, name, t in stats if isinstance(t, torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, name, kept in saved:
                getattr(norm, name).copy_(kept)


def _without_caches(signature: Optional[inspect.Signature], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with any key/value cache (by name or a ``Cache`` object) cleared and ``use_cache=False``."""
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    var_keyword = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    stores = [bound.arguments, *(bound.arguments[name] for name in var_keyword if name in bound.arguments)]
    changed = False
    for store in stores:
        for name, value in list(store.items()):
            cache = callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))
            if value is not None and (name in _CACHE_ARGUMENTS or cache):
                store[name], changed = None, True
        if store.get("use_cache"):
            store["use_cache"], changed = False, True
    return (bound.args, bound.kwargs) if changed else (args, kwargs)


def _checkpointed_forward(module: nn.Module, forward: Any) -> Any:
    try:
        signature: Optional[inspect.Signature] = inspect.signature(forward)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs = _without_caches(signature, args, kwargs)
        calls: list[None] = []

        def body(*inner_args: Any, **inner_kwargs: Any) -> Any:
            calls.append(None)  # a second call is the recomputation in backward
            with _running_stats_kept(module) if len(calls) > 1 else contextlib.nullcontext():
                return forward(*inner_args, **inner_kwargs)

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


@dataclass
class _NativeSwitch:
    """A model's own checkpointing, switched on by :func:`enable_native_checkpointing`."""

    owner: Any  # a transformers model: its checkpointing methods are not on nn.Module's type
    layers: list[Any]
    config_use_cache: Any
    had_input_grad_hooks: bool

    def remove(self) -> None:
        owner = self.owner
        (getattr(owner, "activation_checkpointing_disable", None) or owner.gradient_checkpointing_disable)()
        if not self.had_input_grad_hooks and callable(getattr(owner, "disable_input_require_grads", None)):
            owner.disable_input_require_grads()  # the hook gradient_checkpointing_enable() added
        if getattr(owner, "config", None) is not None and self.config_use_cache is not _MISSING:
            owner.config.use_cache = self.config_use_cache


@dataclass
class CheckpointedBlocks:
    """The blocks checkpointed; :meth:`remove` undoes it, :meth:`paused` suspends it for a block of code."""

    names: list[str]
    classes: list[str]
    method: str = "torch.utils.checkpoint"  #: how, for a report: this or the model's own method
    _modules: list[nn.Module] = field(default_factory=list, repr=False)
    _native: list[_NativeSwitch] = field(default_factory=list, repr=False)

    @property
    def native(self) -> bool:
        """Whether some blocks are checkpointed by the model's own switch."""
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
        layers = [layer for s in self._native for layer in s.layers if getattr(layer, "gradient_checkpointing", False)]
        for layer in layers:
            layer.gradient_checkpointing = False
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
        return cls(
            names=[n for h in handles for n in h.names],
            classes=list(dict.fromkeys(name for h in handles for name in h.classes)),
            method=" + ".join(dict.fromkeys(h.method for h in handles)),
            _modules=[m for h in handles for m in h._modules],
            _native=[s for h in handles for s in h._native],
        )

    def _add(self, name: str, module: nn.Module) -> None:
        self.names.append(name)
        if type(module).__name__ not in self.classes:
            self.classes.append(type(module).__name__)


def enable_checkpointing(blocks: Iterable[tuple[str, nn.Module]]) -> CheckpointedBlocks:
    """Checkpoint each ``(name, module)`` of ``blocks`` (one whose ``forward`` is set on the instance is left)."""
    handle = CheckpointedBlocks(names=[], classes=[])
    for name, module in blocks:
        if "forward" not in vars(module):  # else checkpointed already, or a forward the user patched
            module.forward = _checkpointed_forward(module, module.forward)
            handle._add(name, module)
            handle._modules.append(module)
    return handle


def _checkpoints_itself(module: nn.Module) -> bool:
    """A HuggingFace-style model: ``supports_gradient_checkpointing`` and the methods to switch it."""
    supports = getattr(type(module), "supports_gradient_checkpointing", False) is True
    return supports and callable(getattr(module, "gradient_checkpointing_enable", None))


def native_checkpointing_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` (itself included) that checkpoint themselves."""
    if _checkpoints_itself(model):
        return [("", model)]
    return _outermost([(name, module) for name, module in model.named_modules() if _checkpoints_itself(module)])


def enable_native_checkpointing(owners: Iterable[tuple[str, Any]]) -> CheckpointedBlocks:
    """Switch on each owner's own activation checkpointing; the handle names the layers it checkpoints."""
    handle = CheckpointedBlocks(names=[], classes=[], method="")
    methods = []
    for owner_name, owner in owners:
        had_hooks = bool(getattr(owner, "_require_grads_hooks", None) or getattr(owner, "_require_grads_hook", None))
        switch = getattr(owner, "activation_checkpointing_enable", None)  # transformers >= 5
        if switch is not None:
            switch(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            try:
                owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            except TypeError:  # transformers < 4.35 takes no arguments
                owner.gradient_checkpointing_enable()
        methods.append(f"{type(owner).__name__}.{'activation' if switch else 'gradient'}_checkpointing_enable()")
        use_cache = getattr(getattr(owner, "config", None), "use_cache", _MISSING)
        if use_cache is not _MISSING:
            owner.config.use_cache = False  # what HuggingFace's own training scripts do under checkpointing
        inner = [(name, m) for name, m in owner.named_modules() if m is not owner and not _checkpoints_itself(m)]
        flagged = [(name, m) for name, m in inner if getattr(m, "gradient_checkpointing", False) is True]
        handle._native.append(_NativeSwitch(owner, [m for _, m in flagged], use_cache, had_hooks))
        # the layers it checkpoints: its GradientCheckpointingLayers (an encoder may carry the flag too)
        layers = [(n, m) for n, m in flagged if "GradientCheckpointingLayer" in {c.__name__ for c in type(m).__mro__}]
        for name, module in layers or flagged:
            handle._add(".".join(part for part in (owner_name, name) if part), module)
    handle.method = ", ".join(methods)
    return handle


def _relative_gap(plain: Optional[torch.Tensor], recomputed: Optional[torch.Tensor]) -> float:
    """``|recomputed - plain| / |plain|`` (norms); exact for integer tensors; inf where one is missing."""
    if plain is None or recomputed is None or plain.shape != recomputed.shape:
        return 0.0 if plain is recomputed else float("inf")
    if not plain.is_floating_point():
        return 0.0 if torch.equal(plain, recomputed) else float("inf")
    plain, recomputed = plain.double(), recomputed.double()
    if torch.equal(plain, recomputed):
        return 0.0
    scale = float(plain.norm())
    return float((recomputed - plain).norm()) / scale if scale > 0 else float("inf")


def check_recomputation(
    model: nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    batch: Any,
    handle: CheckpointedBlocks,
    *,
    step_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    rtol: float = 1e-3,
) -> Optional[str]:
    """``None`` when a step with ``handle``'s blocks checkpointed gives the plain step's loss, gradients and buffers
    (within ``rtol``, from one RNG state), else the first difference; the state is put back. Pass a small batch."""
    named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    named_buffers = list(model.named_buffers())
    saved_grads = [p.grad for _, p in named_params]
    saved_buffers = [b.detach().clone() for _, b in named_buffers]
    devices = sorted({t.device.index or 0 for _, t in (*named_params, *named_buffers) if t.device.type == "cuda"})

    def put_buffers_back() -> None:
        with torch.no_grad():
            for (_, buffer), saved in zip(named_buffers, saved_buffers):
                buffer.copy_(saved)

    def run() -> list[tuple[str, Any]]:  # one step: (what, tensor) for the loss, each gradient and each buffer
        for _, param in named_params:
            param.grad = None
        with step_context():
            loss = loss_fn(batch)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
        loss.backward()
        return [
            ("the loss", loss.detach().clone()),
            *((f"the gradient of {n}", None if p.grad is None else p.grad.detach().clone()) for n, p in named_params),
            *((f"the buffer {n}", b.detach().clone()) for n, b in named_buffers),
        ]

    try:
        with torch.random.fork_rng(devices=devices):
            with torch.random.fork_rng(devices=devices), handle.paused():
                plain = run()  # the RNG state put back after it
            put_buffers_back()
            try:
                recomputed = run()
            except Exception as error:  # noqa: BLE001 - the reason to refuse
                return f"{type(error).__name__}: {next(iter(str(error).strip().splitlines()), '')}"[:300]
        for (what, a), (_, b) in zip(plain, recomputed):
            gap = _relative_gap(a, b)
            if gap <= rtol:
                continue
            if what == "the loss":
                return f"the loss is {float(b):.6g} recomputed, {float(a):.6g} plain"
            if what.startswith("the buffer"):
                return f"{what} differs by {gap:.2g} after the step (updated again by the recomputation?)"
            return f"{what} differs by {gap:.2g} (relative)"
        return None
    finally:
        put_buffers_back()
        for (_, param), grad in zip(named_params, saved_grads):
            param.grad = grad
