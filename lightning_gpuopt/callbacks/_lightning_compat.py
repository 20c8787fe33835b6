"""Every use of Lightning's private internals in lightning-gpuopt, in one place.

The rest of the package reaches Lightning's private attributes, private functions and profiler
action names only through the names below; ``tests/integration/test_lightning_compat.py`` checks each against the
installed Lightning (``lightning>=2.6``, the floor ``make test-min`` runs; written against 2.6.6), so a release
that moves or renames one fails there, naming it, rather than deep inside a callback.

Lightning ships its trainer twice, ``lightning.pytorch`` and ``pytorch_lightning`` (the same source with
the imports renamed), and their classes differ. Our callbacks are built on ``lightning.pytorch``;
``lightning_gpuopt.pytorch_lightning`` adds ``pytorch_lightning``'s ``Callback`` as a base. What a
callback makes for a Trainer comes from the Trainer's namespace (:func:`of_namespace`), what it
recognises is checked against both (:func:`any_namespace`), and the private functions below behave
the same in both, so one module serves both.

Each internal, grouped, with the public API it stands in for or why there is none:

Train data (the fit loop)
    * ``trainer.fit_loop._data_source`` (:func:`train_source`, :func:`set_train_source`,
      :data:`TRAIN_SOURCE_ATTRIBUTE`): no public API; where Lightning asks for the train loader each
      time it (re)builds it, swapped to rebuild the loader (``DataLoaderTuner``, ``BatchSizeSearch``).
    * ``lightning.pytorch.trainer.connectors.data_connector._DataLoaderSource``
      (:class:`DataLoaderSource`) and its ``instance``, ``name``, ``dataloader()``, ``is_module()``,
      ``is_defined()``: no public API; the class the source above is.
    * ``...data_connector._request_dataloader`` (:data:`request_dataloader`): no public API; asks a
      source for its loader as Lightning does (recording the loader's arguments).
    * ``trainer.fit_loop._data_fetcher`` (:func:`data_fetcher`) and its ``teardown()``/``batches``:
      no public API; the fetcher holding the prefetched batches.
    * ``trainer.fit_loop._combined_loader`` (:func:`reset_train_loader`, :func:`built_train_loader`):
      ``trainer.train_dataloader`` reads it, but gives ``.iterables`` (the user's structure), not
      ``.flattened[0]``, and nothing public makes the loop build the loader again.

Model attributes
    * ``lightning.pytorch.utilities.parsing._lightning_get_all_attr_holders``
      (:data:`attribute_holders`): the public ``lightning_getattr/lightning_setattr/lightning_hasattr``
      read or set ``batch_size`` but do not say where it is held (model, ``hparams``, datamodule), which
      the search needs to put each place back.

Loops and progress
    * ``trainer.fit_loop.epoch_loop._batches_that_stepped`` (:func:`batches_that_stepped`,
      :func:`set_batches_that_stepped`): no public setter for the logged step (the ``step`` loggers
      get); ``trainer.global_step`` counts optimizer steps, a different figure.
    * ``epoch_loop._broadcast_sigterm_tensor`` (:func:`skip_sigterm_broadcast`,
      :func:`restore_sigterm_broadcast`): no public API; the per-step SIGTERM collective under DDP.
    * ``lightning.pytorch.loops.loop._Loop``, ``lightning.pytorch.loops.progress._BaseProgress``
      (:func:`loop_classes`, :func:`progress_classes`): no public base classes; to find every progress
      counter of the fit loop.
    * ``trainer._logger_connector.reset_results()/reset_metrics()`` (:func:`reset_logged_results`): no
      public API; drops what trial steps logged.
    * ``trainer._signal_connector`` and its ``received_sigterm`` (:func:`signal_connector`): the public
      ``trainer.received_sigterm`` has no setter.

Optimizers
    * ``strategy._optimizers``/``strategy._lightning_optimizers`` (:func:`strategy_optimizer_lists`,
      :func:`set_strategy_optimizer_lists`): the public ``strategy.optimizers`` setter builds new
      ``LightningOptimizer`` wrappers, which would drop the step hooks the manual loop set on the
      existing ones; both lists are saved and put back as they were.
    * ``LightningOptimizer._to_lightning_optimizer`` (:func:`to_lightning_optimizer`): no public
      constructor binding a ``LightningOptimizer`` to a strategy.
    * ``lightning.pytorch.core.optimizer._init_optimizers_and_lr_schedulers``
      (:data:`init_optimizers_and_lr_schedulers`) and ``_MockOptimizer`` (:class:`MockOptimizer`): no
      public API reads every return form of ``configure_optimizers()`` as ``Trainer.fit`` does.

DataLoaders
    * ``lightning.pytorch.utilities.data._update_dataloader`` (:data:`update_dataloader`),
      ``_get_dataloader_init_args_and_kwargs`` (:data:`dataloader_init_args_and_kwargs`),
      ``lightning.fabric.utilities.data._reinstantiate_wrapped_cls`` (:data:`reinstantiate_wrapped_cls`)
      and a loader's ``__pl_saved_arg_names`` (:func:`saved_arg_names`): no public API re-creates a
      loader with other arguments the way Lightning re-creates it for its distributed sampler.

RNG
    * ``lightning.fabric.utilities.seed._collect_rng_states``/``_set_rng_states``
      (:data:`collect_rng_states`, :data:`set_rng_states`): the public ``seed_everything`` and
      ``reset_seed`` seed, they do not save and restore torch's, numpy's and Python's states.

Checkpointing
    * ``ModelCheckpoint._every_n_train_steps``/``_every_n_epochs``/``_train_time_interval``
      (:func:`checkpoint_schedule`) and ``_last_checkpoint_saved`` (:func:`last_checkpoint_saved`): the
      constructor arguments are not kept as public attributes; read with defaults, so a rename only
      loses the schedule from a finding's text.

The CLI
    * ``trainer._data_connector.attach_data`` (:func:`attach_data`): no public API attaches a model and
      datamodule to a Trainer without ``fit``.
    * ``LightningArgumentParser._option_string_actions`` (argparse's, under jsonargparse;
      :func:`parser_option_actions`): no public API finds an added flag's action to set its help.

Profiler action names (what Lightning passes to ``trainer.profiler``; strings, no import)
    * ``"[<epoch loop class>].train_dataloader_next"`` (:func:`fetch_action`),
      ``"[Strategy]<Strategy class>.<hook>"`` (:func:`strategy_action`), ``"save_checkpoint"``
      (:data:`SAVE_CHECKPOINT_ACTION`), ``"[Callback]<state_key>.<hook>"``,
      ``"[LightningModule]<class>.<hook>"``, ``"[LightningDataModule]<class>.<hook>"``
      (:data:`CALLBACK_ACTION`, :data:`MODULE_ACTION`, :data:`DATAMODULE_ACTION`,
      :data:`HOOK_ACTION_PREFIXES`): no public API times the train fetch or each hook call; the names
      are not documented.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource, _request_dataloader
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _update_dataloader
from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders

# -- train data (the fit loop) ------------------------------------------------------------------

#: the fit loop's attribute holding the train-loader source (for ``Changes.set_attribute``)
TRAIN_SOURCE_ATTRIBUTE = "_data_source"

# no public API: the class of ``trainer.fit_loop._data_source``
DataLoaderSource = _DataLoaderSource

# no public API: a source's loader, requested as Lightning requests it
request_dataloader = _request_dataloader


def train_source(trainer: Any) -> Any:
    """``trainer.fit_loop._data_source`` (no public API: where the train loader comes from)."""
    return trainer.fit_loop._data_source


def set_train_source(trainer: Any, source: Any) -> None:
    """Set ``trainer.fit_loop._data_source`` (no public setter)."""
    trainer.fit_loop._data_source = source


def data_fetcher(trainer: Any) -> Any:
    """``trainer.fit_loop._data_fetcher`` (no public API; ``None`` until the loop set its data up)."""
    return trainer.fit_loop._data_fetcher


def reset_train_loader(trainer: Any) -> None:
    """Make the fit loop build the train loader again (no public API: ``fit_loop.setup_data()`` keeps
    a built ``_combined_loader``)."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


#: what ``fit_loop.setup_data()`` sets when it builds the train loader (the loop's, then the trainer's)
_LOADER_STATE = (
    ("_combined_loader", "_data_fetcher", "max_batches", "_last_train_dl_reload_epoch"),
    ("val_check_batch",),
)


def detach_train_loader(trainer: Any) -> tuple[dict, dict]:
    """Take the fit loop's built train loader and what ``setup_data()`` set with it out of the loop (the
    fetcher not torn down, its iterator kept); the loop has none afterwards. No public API."""
    loop_names, trainer_names = _LOADER_STATE
    saved = ({n: getattr(trainer.fit_loop, n) for n in loop_names}, {n: getattr(trainer, n) for n in trainer_names})
    trainer.fit_loop._combined_loader, trainer.fit_loop._data_fetcher = None, None
    return saved


def attach_train_loader(trainer: Any, saved: tuple[dict, dict]) -> None:
    """Put back what :func:`detach_train_loader` took (whatever the loop holds now is torn down first)."""
    reset_train_loader(trainer)
    for name, value in saved[0].items():
        setattr(trainer.fit_loop, name, value)
    for name, value in saved[1].items():
        setattr(trainer, name, value)


def train_loader_built(trainer: Any) -> bool:
    """Whether the fit loop holds a built train loader (``_combined_loader``; no public API says so)."""
    return trainer.fit_loop._combined_loader is not None


def built_train_loader(trainer: Any) -> Any:
    """The fit loop's first train loader, ``_combined_loader.flattened[0]`` (``trainer.train_dataloader``
    gives the user's structure, ``.iterables``, not the flattened loaders)."""
    combined = trainer.fit_loop._combined_loader
    assert combined is not None
    return combined.flattened[0]


# -- model attributes -------------------------------------------------------------------------

# every place an attribute is held (model, its hparams, the datamodule and its hparams): the public
# lightning_getattr/lightning_setattr read and set it, but do not say where it lives
attribute_holders = _lightning_get_all_attr_holders


# -- the two namespaces ---------------------------------------------------------------------------


def _namespace(obj: Any) -> str:
    mro = type(obj).__mro__ if not isinstance(obj, type) else obj.__mro__
    return "pytorch_lightning" if any(c.__module__.split(".")[0] == "pytorch_lightning" for c in mro) else "lightning"


def of_namespace(obj: Any, module: str, name: str) -> Any:
    """``name`` from ``module`` (a path under ``lightning.pytorch``; ``""``: the package) of ``obj``'s namespace.

    >>> import lightning.pytorch as pl
    >>> of_namespace(pl.Trainer, "loggers.logger", "DummyLogger").__module__
    'lightning.pytorch.loggers.logger'
    """
    root = "pytorch_lightning" if _namespace(obj) == "pytorch_lightning" else "lightning.pytorch"
    return getattr(importlib.import_module(f"{root}.{module}".rstrip(".")), name)


def any_namespace(module: str, name: str) -> tuple[type, ...]:
    """``name`` from ``module`` of ``lightning.pytorch`` and, once imported, of ``pytorch_lightning`` (for ``isinstance``)."""
    roots = ["lightning.pytorch", *(["pytorch_lightning"] if "pytorch_lightning" in sys.modules else [])]
    return tuple(getattr(importlib.import_module(f"{root}.{module}".rstrip(".")), name) for root in roots)


# -- loops and progress -------------------------------------------------------------------------


def loop_classes() -> tuple[type, ...]:
    """``lightning.pytorch.loops.loop._Loop`` (no public base class): every loop."""
    return any_namespace("loops.loop", "_Loop")


def progress_classes() -> tuple[type, ...]:
    """``lightning.pytorch.loops.progress._BaseProgress`` (no public base class): every progress counter."""
    return any_namespace("loops.progress", "_BaseProgress")


def batches_that_stepped(trainer: Any) -> int:
    """``epoch_loop._batches_that_stepped``: the step loggers get (``trainer.global_step`` counts
    optimizer steps, a different figure)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Any, value: int) -> None:
    """Set ``epoch_loop._batches_that_stepped`` (no public setter for the logged step)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def skip_sigterm_broadcast(epoch_loop: Any) -> None:
    """Turn ``epoch_loop._broadcast_sigterm_tensor`` (the per-step SIGTERM collective) into a no-op
    (no public API)."""
    epoch_loop._broadcast_sigterm_tensor = lambda: None


def restore_sigterm_broadcast(epoch_loop: Any) -> None:
    """Undo :func:`skip_sigterm_broadcast` (a no-op when it was not skipped)."""
    if "_broadcast_sigterm_tensor" in vars(epoch_loop):
        del epoch_loop._broadcast_sigterm_tensor


def reset_logged_results(trainer: Any) -> None:
    """``trainer._logger_connector.reset_results()`` then ``reset_metrics()`` (no public API): drops
    what was logged meanwhile."""
    trainer._logger_connector.reset_results()
    trainer._logger_connector.reset_metrics()


def signal_connector(trainer: Any) -> Any:
    """``trainer._signal_connector``, whose ``received_sigterm`` is settable (the public
    ``trainer.received_sigterm`` has no setter)."""
    return trainer._signal_connector


# -- optimizers ---------------------------------------------------------------------------------

# no public API reads configure_optimizers() as Trainer.fit does (every return form)
init_optimizers_and_lr_schedulers = _init_optimizers_and_lr_schedulers
# no public API: what init_optimizers_and_lr_schedulers returns for configure_optimizers() -> None
MockOptimizer = _MockOptimizer


def strategy_optimizer_lists(strategy: Any) -> tuple[Any, Any]:
    """``(strategy._optimizers, strategy._lightning_optimizers)`` as they are (the public
    ``strategy.optimizers`` gives the first only)."""
    return strategy._optimizers, strategy._lightning_optimizers


def set_strategy_optimizer_lists(strategy: Any, optimizers: Any, lightning_optimizers: Any) -> None:
    """Set both lists as given (the public ``strategy.optimizers`` setter builds new
    ``LightningOptimizer`` wrappers, dropping the hooks the loops set on the existing ones)."""
    strategy._optimizers = optimizers
    strategy._lightning_optimizers = lightning_optimizers


def to_lightning_optimizer(optimizer: Any, strategy: Any) -> LightningOptimizer:
    """``LightningOptimizer._to_lightning_optimizer`` of the strategy's namespace (no public constructor
    binding one to a strategy)."""
    return of_namespace(strategy, "core.optimizer", "LightningOptimizer")._to_lightning_optimizer(optimizer, strategy)


# -- dataloaders --------------------------------------------------------------------------------

# no public API: a loader re-created with another sampler, as Lightning re-creates it
update_dataloader = _update_dataloader
# no public API: the arguments a loader was built with
dataloader_init_args_and_kwargs = _get_dataloader_init_args_and_kwargs
# no public API: a loader re-created from those arguments
reinstantiate_wrapped_cls = _reinstantiate_wrapped_cls


def saved_arg_names(loader: Any) -> list[str]:
    """The positional argument names Lightning recorded on ``loader`` (``__pl_saved_arg_names``; no
    public API), empty when it recorded none."""
    return list(getattr(loader, "__pl_saved_arg_names", ()))


# -- RNG ----------------------------------------------------------------------------------------

# no public API saves the torch, numpy and Python RNG states (seed_everything/reset_seed only seed)
collect_rng_states = _collect_rng_states
set_rng_states = _set_rng_states


# -- checkpointing ------------------------------------------------------------------------------


def checkpoint_schedule(callback: Any) -> tuple[Optional[int], Optional[int], Any]:
    """A ``ModelCheckpoint``'s ``(every_n_train_steps, every_n_epochs, train_time_interval)``, read
    from ``_every_n_train_steps``, ``_every_n_epochs``, ``_train_time_interval`` (not kept as public
    attributes); ``None`` for one that is off or missing."""
    every_steps = getattr(callback, "_every_n_train_steps", 0) or None
    every_epochs = getattr(callback, "_every_n_epochs", 0) or None
    interval = getattr(callback, "_train_time_interval", None)
    return every_steps, every_epochs, interval


def last_checkpoint_saved(callback: Any) -> str:
    """``ModelCheckpoint._last_checkpoint_saved``, the file it last wrote (no public attribute; ``""``
    when missing)."""
    return getattr(callback, "_last_checkpoint_saved", "")


# -- the CLI ------------------------------------------------------------------------------------


def attach_data(trainer: Any, module: Any, datamodule: Any = None) -> None:
    """``trainer._data_connector.attach_data`` (no public API attaches a model and datamodule without ``fit``)."""
    trainer._data_connector.attach_data(module, datamodule=datamodule)


def parser_option_actions(parser: Any) -> dict[str, Any]:
    """The parser's flag -> action map, ``_option_string_actions`` (argparse's; no public API finds an
    added flag's action to edit its help)."""
    return parser._option_string_actions


# -- profiler action names ----------------------------------------------------------------------

#: ``trainer.save_checkpoint`` runs in ``profiler.profile(SAVE_CHECKPOINT_ACTION)``
SAVE_CHECKPOINT_ACTION = "save_checkpoint"
#: a callback's hook: ``"[Callback]<state_key>.<hook>"``
CALLBACK_ACTION = "[Callback]"
#: a LightningModule's hook: ``"[LightningModule]<class>.<hook>"``
MODULE_ACTION = "[LightningModule]"
#: a LightningDataModule's hook: ``"[LightningDataModule]<class>.<hook>"``
DATAMODULE_ACTION = "[LightningDataModule]"
#: the prefixes of the user's hooks (callbacks, module, datamodule)
HOOK_ACTION_PREFIXES = (CALLBACK_ACTION, MODULE_ACTION, DATAMODULE_ACTION)


def fetch_action(trainer: Any) -> str:
    """The profiler action around the train loader's ``next()``:
    ``"[<epoch loop class>].train_dataloader_next"`` (no public API times the fetch)."""
    return f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"


def strategy_action(trainer: Any, hook: str) -> str:
    """The profiler action around a strategy hook: ``"[Strategy]<Strategy class>.<hook>"``."""
    return f"[Strategy]{type(trainer.strategy).__name__}.{hook}"


# -- the namespace a Trainer comes from ----------------------------------------------------------

_PACKAGE_FOR = {"lightning": "lightning_gpuopt", "pytorch_lightning": "lightning_gpuopt.pytorch_lightning"}


def check_trainer_namespace(trainer: Any, callback: Any) -> None:
    """Raise ``TypeError`` unless ``trainer`` comes from the namespace ``callback`` is built on, naming the
    import that fits. A callback the Trainer does not hold (a part of GpuOpt) is its owner's to check."""
    if callback not in getattr(trainer, "callbacks", [callback]):
        return
    ours, theirs = _namespace(callback), type(trainer).__module__.split(".")[0]
    if ours == theirs:
        return
    name, kind = type(callback).__name__, f"`{type(trainer).__module__}.{type(trainer).__name__}`"
    fix = _PACKAGE_FOR.get(theirs)
    advice = (
        f"import it as `from {fix} import {name}`"
        if fix
        else f"use it with a Trainer from `{ours}` ({kind} is neither)"
    )
    raise TypeError(f"{name} from `{_PACKAGE_FOR[ours]}` is built on `{ours}`, but the Trainer is {kind}: {advice}.")
