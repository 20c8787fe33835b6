"""One fit's shared services: the user's train loader built once, and our changes applied as a run by hand has them.

A :class:`FitSession` (one per Trainer and fit, shared by our callbacks) makes a run with our callbacks equal
the chosen settings written by hand: :meth:`~FitSession.probe_loader` builds the user's loader once (trials and
timings use copies, :func:`rebuild_loader`); :meth:`~FitSession.apply` sets the batch size, accumulation and
loader settings and, on a change, runs ``configure_optimizers()`` again from the RNG states it first ran with.
So ``train_dataloader()`` runs at most twice per fit. See docs/architecture.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks import _profiler_tap
from lightning_gpuopt.callbacks._engine.state import rng_kept, rng_states, same_rng_states
from lightning_gpuopt.callbacks._engine.undo import Undo
from lightning_gpuopt.core.estimate import restored_attributes
from lightning_gpuopt.core.loader import ProbedSizes, largest_samples_first


def rebuild_loader(loader: DataLoader, sampler: Any = None, **arguments: Any) -> DataLoader:
    """A copy of ``loader`` with other arguments (and ``sampler``), re-created as Lightning re-creates a loader."""
    args, kwargs = compat.dataloader_init_args_and_kwargs(loader, loader.sampler if sampler is None else sampler)
    positional = compat.saved_arg_names(loader)
    values = list(args)
    for name, value in arguments.items():
        if name in positional and positional.index(name) < len(values):
            values[positional.index(name)] = value
        else:
            kwargs[name] = value
    return compat.reinstantiate_wrapped_cls(loader, *values, **kwargs)


@dataclass
class _Source(compat.DataLoaderSource):
    """The fit loop's train-loader source: ``make()`` when given, else ``inner``'s loader through ``rebuild``."""

    inner: Any = None
    rebuild: Optional[Callable[[DataLoader], Any]] = None
    make: Optional[Callable[[], Any]] = None

    def dataloader(self) -> Any:
        if self.make is not None:
            return self.make()
        loader = self.inner.dataloader()
        return self.rebuild(loader) if self.rebuild is not None and isinstance(loader, DataLoader) else loader


class FitSession:
    """The services our callbacks share in one fit of one Trainer (see the module docstring)."""

    _open: ClassVar[weakref.WeakKeyDictionary[Any, FitSession]] = weakref.WeakKeyDictionary()

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._probe: Any = None
        #: the train loader Lightning built before our work (in configure_optimizers), set aside meanwhile
        self._lightnings: Optional[tuple[dict, dict]] = None
        self._sizes: Optional[tuple[Optional[ProbedSizes], bool]] = None
        self._configure_rng: list[Optional[dict[str, Any]]] = [None, None]
        action = f"{compat.MODULE_ACTION}{type(trainer.lightning_module).__name__}.configure_optimizers"
        self._tap = _profiler_tap.install(
            trainer,
            {action: lambda *_: self._configure_rng.__setitem__(1, rng_states())},
            on_start={action: lambda: self._configure_rng.__setitem__(0, rng_states())},
        )

    @classmethod
    def of(cls, trainer: Any) -> FitSession:
        """The trainer's session, opened on first use (in ``setup``, before ``configure_optimizers`` runs)."""
        return cls._open.get(trainer) or cls._open.setdefault(trainer, cls(trainer))

    @classmethod
    def close(cls, trainer: Any) -> None:
        """End the trainer's session (``teardown``/``on_exception``; a no-op when none is open)."""
        session = cls._open.pop(trainer, None)
        if session is not None:
            _profiler_tap.uninstall(trainer, session._tap)
            session._probe = None

    def probe_loader(self) -> Any:
        """The user's train loader as ``train_dataloader()`` returns it, built at most once (see the module docstring)."""
        if self._probe is None:
            trainer = self.trainer
            if compat.train_loader_built(trainer):  # set aside, untouched, until apply() decides
                self._probe = compat.built_train_loader(trainer)
                self._lightnings = compat.detach_train_loader(trainer)
            else:
                owners = [trainer.lightning_module, *([trainer.datamodule] if trainer.datamodule is not None else [])]
                with rng_kept(), restored_attributes(*owners):
                    self._probe = compat.request_dataloader(compat.train_source(trainer))
        return self._probe

    def loader(self, sampler: Any = None, **arguments: Any) -> DataLoader:
        """A copy of the user's loader with other arguments (see :func:`rebuild_loader`)."""
        return rebuild_loader(self.probe_loader(), sampler, **arguments)

    def sample_sizes(self) -> tuple[Optional[ProbedSizes], bool]:
        """Sample sizes, largest first (``None``: alike or not sized), and whether the dataset is sized map-style."""
        if self._sizes is None:
            dataset: Any = getattr(self.probe_loader(), "dataset", None)
            try:
                sized = len(dataset) > 0 and not isinstance(dataset, IterableDataset)
            except TypeError:
                sized = False
            with rng_kept():
                self._sizes = (largest_samples_first(dataset) if sized else None, sized)
        return self._sizes

    def processed_loader(self, make: Callable[[], Any]) -> Any:
        """The loader ``make()`` returns, set up by the fit loop as training's until ``reset_train_loader`` (a
        collective under DDP)."""
        trainer = self.trainer
        self.probe_loader()  # before the source is swapped: it may ask the user's
        with Undo().scope() as undo, rng_kept():
            compat.reset_train_loader(trainer)
            source = compat.train_source(trainer)
            given = _Source(source.instance, source.name, make=make)
            undo.set(trainer.fit_loop, compat.TRAIN_SOURCE_ATTRIBUTE, given)
            trainer.fit_loop.setup_data()
        return compat.built_train_loader(trainer) if compat.train_loader_built(trainer) else None

    def samples_per_rank(self) -> Optional[int]:
        """Samples each rank's loader draws in an epoch (its sampler's length), if known; a collective under DDP."""
        try:
            loader = self.processed_loader(self.loader)
            sampler = getattr(loader, "sampler", None)
            return len(sampler) if sampler is not None else len(loader.dataset)
        except (TypeError, AttributeError, NotImplementedError):
            return None
        finally:
            compat.reset_train_loader(self.trainer)

    def apply(
        self,
        undo: Undo,
        batch_size: Optional[tuple[str, int, bool]] = None,
        accumulate_grad_batches: Optional[int] = None,
        rebuild: Optional[Callable[[DataLoader], Any]] = None,
    ) -> bool:
        """Set what our callbacks decided (in ``undo``) and rebuild what depends on it as by hand; ``batch_size``:
        ``(batch_arg_name, size, lasting)``. Returns whether ``configure_optimizers()`` ran again."""
        trainer, module = self.trainer, self.trainer.lightning_module
        now, changed = rng_states(), False
        if batch_size is not None:
            name, size, lasting = batch_size
            for holder in compat.attribute_holders(module, name):
                held = holder[name] if isinstance(holder, dict) else getattr(holder, name)
                changed |= held != size
                undo.set(holder, name, size, lasting=lasting)
        if accumulate_grad_batches is not None and accumulate_grad_batches != trainer.accumulate_grad_batches:
            undo.set(trainer, "accumulate_grad_batches", accumulate_grad_batches)
            changed = True
        if rebuild is not None:
            source = compat.train_source(trainer)
            rebuilt = _Source(source.instance, source.name, inner=source, rebuild=rebuild)
            undo.set(trainer.fit_loop, compat.TRAIN_SOURCE_ATTRIBUTE, rebuilt)
        built, lightnings = self._lightnings is not None or compat.train_loader_built(trainer), self._lightnings
        self._probe, self._lightnings = None, None
        if lightnings is not None:  # put back: training uses the loader Lightning built, as by hand, unless...
            compat.attach_train_loader(trainer, lightnings)
        if not changed and not (built and rebuild is not None):
            return False
        compat.reset_train_loader(trainer)  # ...a change makes the loop build it again
        start, stop = self._configure_rng
        if start is not None:
            compat.set_rng_states(start)  # where configure_optimizers (and a loader built in it) first drew
        if changed:
            trainer.strategy.setup_optimizers(trainer)
        elif built:
            trainer.fit_loop.setup_data()
        if stop is None or not same_rng_states(now, stop):
            compat.set_rng_states(now)  # something drew between configure_optimizers and us: keep the present
        return changed


class EngineCallback(Callback):
    """A callback that changes the run through the engine: ``setup`` opens the fit's :class:`FitSession` (after undoing
    what an earlier fit left); ``teardown`` and ``on_exception`` close it and unwind ``_undo`` (after a fit that ended
    well, its lasting changes stay)."""

    _undo: Undo

    def _reset(self) -> None:
        """Forget the last fit's results (in ``setup``)."""

    def _release(self) -> None:
        """Let go of what only training holds (in ``teardown`` and ``on_exception``)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            compat.check_trainer_namespace(trainer, self)
            self._undo.undo()  # what an earlier fit that ended without teardown or on_exception left
            self._reset()
            FitSession.of(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._release()
        FitSession.close(trainer)
        if stage == "fit":
            self._undo.after_success(type(self).__name__)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release()
        FitSession.close(trainer)
        self._undo.after_failure(type(self).__name__)
