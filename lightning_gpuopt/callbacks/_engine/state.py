"""What a trial or a measurement may change, kept in host memory and put back.

:class:`TrainingState`: parameters and buffers, gradients, optimizer and scheduler state, loop progress, the logged
step, ``should_stop``, the RNG states, the module's and datamodule's attributes (nested containers and train/eval
modes included) and the gradient scaler. :func:`rng_kept`: the RNG states and loaders' own generators only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.core.device import cuda_rng_in_use
from lightning_gpuopt.core.estimate import restored_attributes


def rng_states() -> dict[str, Any]:
    """The global RNG states: torch, CUDA when in use, numpy, Python's ``random``."""
    return compat.collect_rng_states(include_cuda=cuda_rng_in_use())


def same_rng_states(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two :func:`rng_states` are equal (nothing drew between them)."""
    return first.keys() == second.keys() and all(_equal(first[key], second[key]) for key in first)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)


@contextlib.contextmanager
def rng_kept(*loaders: Any) -> Iterator[None]:
    """The global RNG states and ``loaders``' own generators are as they were once the block ends.

    >>> before = torch.get_rng_state()
    >>> with rng_kept():
    ...     _ = torch.rand(3)
    >>> torch.equal(torch.get_rng_state(), before)
    True
    """
    # each loader's own generators, which iterating it draws from: its ``generator`` and its samplers'
    samplers = [getattr(loader, "sampler", None) for loader in loaders]
    samplers += [getattr(getattr(loader, "batch_sampler", None), "sampler", None) for loader in loaders]
    owned = (getattr(owner, "generator", None) for owner in (*loaders, *samplers))
    generators = [generator for generator in owned if isinstance(generator, torch.Generator)]
    states, generator_states = rng_states(), [generator.get_state() for generator in generators]
    try:
        yield
    finally:
        compat.set_rng_states(states)
        for generator, state in zip(generators, generator_states):
            generator.set_state(state)


def _host_copy(collection: Any) -> Any:
    return apply_to_collection(collection, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))


def cloned(collection: Any) -> Any:
    return apply_to_collection(collection, torch.Tensor, lambda t: t.clone())


class TrainingState:
    """What the training state is now, to be put back by :meth:`restore` (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        module = trainer.lightning_module
        tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
        self.tensors = [(t, _host_copy(t)) for t in tensors]
        self.grads = [(p, _host_copy(p.grad)) for p in module.parameters()]  # None stays None
        self.optimizers = [_host_copy(optimizer.state_dict()) for optimizer in trainer.optimizers]
        self.schedulers = [_host_copy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        self.progress = [(p, _host_copy(p.state_dict())) for p in compat.progress_counters(trainer.fit_loop)]
        self.batches_that_stepped = compat.batches_that_stepped(trainer)
        self.should_stop, self.rng = trainer.should_stop, rng_states()
        # 16-mixed: trials step with scalers of their own, so the run's scale and growth tracker stay as they are
        self.scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        self.scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        self._attributes = contextlib.ExitStack()
        datamodule = getattr(trainer, "datamodule", None)  # its attributes, like the module's, are the user's state
        owners = [trainer.lightning_module, *([datamodule] if datamodule is not None else [])]
        self._attributes.enter_context(restored_attributes(*owners))

    def reset_for_trial(self) -> None:
        """The state training starts from, with counters at zero (so a trial's steps all run)."""
        self._restore_weights_and_optimizers()
        for progress, _ in self.progress:
            progress.reset()
        compat.set_batches_that_stepped(self.trainer, 0)
        self.trainer.should_stop = False
        compat.reset_logged_results(self.trainer)  # and the batch a failed trial left there: a fresh card holds none
        plugin = self.trainer.strategy.precision_plugin
        if self.scaler is not None:  # scale 1: memory does not depend on it, and float16 does not overflow
            plugin.scaler = torch.amp.GradScaler(plugin.device, init_scale=1.0, growth_interval=2**30)

    def restore(self) -> None:
        """Put everything back (the module's attributes once: a later call restores the rest only)."""
        self._attributes.close()
        if self.scaler is not None:
            self.trainer.strategy.precision_plugin.scaler = self.scaler
            self.scaler.load_state_dict(self.scaler_state)
        self._restore_weights_and_optimizers()
        for progress, state in self.progress:
            progress.load_state_dict(cloned(state))
        compat.set_batches_that_stepped(self.trainer, self.batches_that_stepped)
        self.trainer.should_stop = self.should_stop
        compat.set_rng_states(self.rng)
        compat.reset_logged_results(self.trainer)

    def _restore_weights_and_optimizers(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        for param, grad in self.grads:
            param.grad = None if grad is None else grad.to(param.device, copy=True)
        for optimizer, state in zip(self.trainer.optimizers, self.optimizers):
            optimizer.load_state_dict(cloned(state))
        for config, state in zip(self.trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(cloned(state))
