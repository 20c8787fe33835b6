"""Every use of Lightning's private internals, in one place, each checked against the installed Lightning (``>=2.6``,
written against 2.6.6) by ``tests/integration/test_lightning_compat.py``, so a release that moves one fails there, by
name. One module serves ``lightning.pytorch`` and ``pytorch_lightning``: what a callback makes comes from the Trainer's
namespace (:func:`of_namespace`), what it recognises is checked against both (:func:`any_namespace`). Each internal,
with why no public API will do (none exists unless named):

* ``fit_loop._data_source`` (:data:`TRAIN_SOURCE_ATTRIBUTE`), a ``_DataLoaderSource`` (``instance``, ``name``,
  ``dataloader()``, ``is_module()``, ``is_defined()``): swapped to rebuild the train loader; ``_request_dataloader``
  asks a source as Lightning does. ``fit_loop._data_fetcher`` (``teardown()``, ``batches``), ``_combined_loader``:
  ``trainer.train_dataloader`` gives ``.iterables``, not ``.flattened[0]``, and cannot make the loop rebuild it.
* ``_lightning_get_all_attr_holders``: ``lightning_getattr``/``setattr`` do not say where ``batch_size`` is held.
* ``epoch_loop._batches_that_stepped``: the logged step has no setter (``trainer.global_step`` counts optimizer
  steps); ``epoch_loop._broadcast_sigterm_tensor``: the per-step SIGTERM collective, skipped in trials.
* ``loops.loop._Loop``, ``loops.progress._BaseProgress``: no public base classes, to find every progress counter.
* ``trainer._logger_connector.reset_results()/reset_metrics()``, ``trainer._results.batch``;
  ``trainer._signal_connector.received_sigterm`` (``trainer.received_sigterm`` has no setter).
* ``strategy._optimizers``/``_lightning_optimizers``: the ``strategy.optimizers`` setter builds new wrappers,
  dropping the step hooks set on the old ones; ``LightningOptimizer._to_lightning_optimizer``.
* ``_init_optimizers_and_lr_schedulers``, ``_MockOptimizer``: read ``configure_optimizers()`` as ``fit`` does.
* ``_get_dataloader_init_args_and_kwargs``, ``_reinstantiate_wrapped_cls``, a loader's ``__pl_saved_arg_names``:
  re-create a loader with other arguments, as Lightning does for its sampler.
* ``_collect_rng_states``/``_set_rng_states``: ``seed_everything`` seeds; it does not save and restore states.
* ``ModelCheckpoint._every_n_train_steps``/``_every_n_epochs``/``_train_time_interval``/``_last_checkpoint_saved``:
  the constructor's arguments are not kept publicly (read with defaults).
* ``trainer._data_connector.attach_data``: attach model and datamodule without ``fit``;
  ``LightningArgumentParser._option_string_actions``: find a flag's action to set its help.
* ``trainer._accelerator_connector`` (``_precision_flag``, ``_precision_plugin_flag``, ``_accelerator_flag``,
  ``_check_and_init_precision``): on CPU it writes ``"bf16-mixed"`` over the only record of a ``"16-mixed"`` asked.
* ``fit_loop.on_advance_end`` (:data:`EPOCH_END_HOOKS`) calls every ``on_train_epoch_end``; ``epoch_loop.val_loop.run``
  is a validation run in ``fit``: wrapped on the instance, as no hook comes before every callback's. A callback's
  hook set to ``None`` is skipped: ``_call_callback_hooks`` calls it only when callable (:func:`skip_unused_batch_hooks`);
  its locals and ``_call_lightning_module_hook``'s name the hook a save runs in (:func:`running_hook`).
  ``epoch_loop._on_before_fetch`` (:data:`BEFORE_FETCH`), bound to the fetcher at each epoch's start, runs before every
  training ``next()``: no hook comes between two steps; ``batch_progress.current`` says whether a step ran to its end.
* Profiler action names (undocumented): ``"[<epoch loop>].train_dataloader_next"``, ``"[Strategy]<class>.<hook>"``,
  ``"save_checkpoint"``, and ``"[Callback]"``, ``"[LightningModule]"``, ``"[LightningDataModule]"`` hooks.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import sys
from typing import Any, Iterator, Optional

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource, _request_dataloader
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders

DataLoaderSource = _DataLoaderSource
request_dataloader = _request_dataloader
attribute_holders = _lightning_get_all_attr_holders
init_optimizers_and_lr_schedulers = _init_optimizers_and_lr_schedulers
MockOptimizer = _MockOptimizer
dataloader_init_args_and_kwargs = _get_dataloader_init_args_and_kwargs
reinstantiate_wrapped_cls = _reinstantiate_wrapped_cls
collect_rng_states = _collect_rng_states
set_rng_states = _set_rng_states
#: readers of private attributes: the train-loader source; its fetcher (``None`` until the loop set its data up); the
#: step loggers get; the connector whose ``received_sigterm`` is settable; a parser's flag -> action map
train_source = operator.attrgetter("fit_loop._data_source")
data_fetcher = operator.attrgetter("fit_loop._data_fetcher")
batches_that_stepped = operator.attrgetter("fit_loop.epoch_loop._batches_that_stepped")
signal_connector = operator.attrgetter("_signal_connector")
parser_option_actions = operator.attrgetter("_option_string_actions")

TRAIN_SOURCE_ATTRIBUTE = "_data_source"  #: the fit loop's attribute holding the train-loader source (for ``Undo.set``)
#: what ``fit_loop.setup_data()`` sets in the loop when it builds the train loader (and ``trainer.val_check_batch``)
_LOOP_STATE = ("_combined_loader", "_data_fetcher", "max_batches", "_last_train_dl_reload_epoch")


def reset_train_loader(trainer: Any) -> None:
    """Make the fit loop build the train loader again (``setup_data()`` keeps a built ``_combined_loader``)."""
    loop = trainer.fit_loop
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


def detach_train_loader(trainer: Any) -> tuple[dict, dict]:
    """Take the built train loader and what ``setup_data()`` set with it out of the loop (fetcher kept as is)."""
    loop = trainer.fit_loop
    saved = ({n: getattr(loop, n) for n in _LOOP_STATE}, {"val_check_batch": trainer.val_check_batch})
    loop._combined_loader, loop._data_fetcher = None, None
    return saved


def attach_train_loader(trainer: Any, saved: tuple[dict, dict]) -> None:
    """Put back what :func:`detach_train_loader` took (tearing down what the loop holds now)."""
    reset_train_loader(trainer)
    for owner, values in zip((trainer.fit_loop, trainer), saved):
        for name, value in values.items():
            setattr(owner, name, value)


def train_loader_built(trainer: Any) -> bool:
    return trainer.fit_loop._combined_loader is not None


def built_train_loader(trainer: Any) -> Any:
    return trainer.fit_loop._combined_loader.flattened[0]


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


def any_namespace(module: str, name: str) -> tuple[Any, ...]:
    """``name`` from ``module`` of ``lightning.pytorch`` and, once imported, of ``pytorch_lightning``."""
    roots = ["lightning.pytorch", *(["pytorch_lightning"] if "pytorch_lightning" in sys.modules else [])]
    return tuple(getattr(importlib.import_module(f"{root}.{module}".rstrip(".")), name) for root in roots)


_PACKAGE_FOR = {"lightning": "lightning_gpuopt", "pytorch_lightning": "lightning_gpuopt.pytorch_lightning"}


def check_trainer_namespace(trainer: Any, callback: Any) -> None:
    """Raise ``TypeError``, naming the import that fits, unless ``trainer`` is of ``callback``'s namespace, then
    :func:`check_strategy` (a callback the Trainer does not hold, a part of GpuOpt, is its owner's to check)."""
    if callback not in getattr(trainer, "callbacks", [callback]):
        return
    ours, theirs = _namespace(callback), type(trainer).__module__.split(".")[0]
    if ours == theirs:
        return check_strategy(trainer, callback)
    name, kind = type(callback).__name__, f"`{type(trainer).__module__}.{type(trainer).__name__}`"
    advice = f"use it with a Trainer from `{ours}` ({kind} is neither)"
    if theirs in _PACKAGE_FOR:
        advice = f"import it as `from {_PACKAGE_FOR[theirs]} import {name}`"
    raise TypeError(f"{name} from `{_PACKAGE_FOR[ours]}` is built on `{ours}`, but the Trainer is {kind}: {advice}.")


#: strategies that shard the model over the ranks (known by class name: DeepSpeed is never imported), and our
#: callbacks that refuse them (their trials and estimates step the whole module on one rank), with GpuOpt's switch
SHARDED_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
UNSHARDED_ONLY = {"BatchSizeSearch": "", "MemoryFill": "fill_memory=False", "MemoryEstimator": "estimate=False"}


def check_strategy(trainer: Any, callback: Any) -> None:
    """Raise ``MisconfigurationException``, naming the strategy and what to do instead, when ``callback`` (or a
    part of GpuOpt) is in :data:`UNSHARDED_ONLY` and the Trainer's strategy is (a subclass of) a sharded one."""
    strategy = next((c.__name__ for c in type(trainer.strategy).__mro__ if c.__name__ in SHARDED_STRATEGIES), None)
    refused = [type(p).__name__ for p in getattr(callback, "parts", [callback]) if type(p).__name__ in UNSHARDED_ONLY]
    if strategy is None or not refused:
        return
    owner = type(callback).__name__
    fix = f"Remove {owner}" if owner in refused else f"Pass {', '.join(UNSHARDED_ONLY[n] for n in refused)} to {owner}"
    raise of_namespace(trainer, "utilities.exceptions", "MisconfigurationException")(
        f"{' and '.join(refused)} cannot run under {strategy}, which shards the model over the ranks (trials and "
        f"estimates step the whole module on one rank). {fix}, and find the batch size with strategy='ddp' or on "
        f"one device, then set it by hand; DataWaitMonitor and DataLoaderTuner run under {strategy}."
    )


def progress_counters(loop: Any, seen: Optional[set[int]] = None) -> list[Any]:
    """Every progress counter (``loops.progress._BaseProgress``) of ``loop`` and its child loops (``_Loop``)."""
    seen, found = set() if seen is None else seen, []
    for value in list(vars(loop).values()):
        if isinstance(value, any_namespace("loops.progress", "_BaseProgress")) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
        elif isinstance(value, any_namespace("loops.loop", "_Loop")):
            found += progress_counters(value, seen)
    return found


def set_batches_that_stepped(trainer: Any, value: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def skip_sigterm_broadcast(epoch_loop: Any) -> None:
    """Make ``epoch_loop._broadcast_sigterm_tensor`` (the per-step SIGTERM collective) a no-op."""
    epoch_loop._broadcast_sigterm_tensor = lambda: None


def restore_sigterm_broadcast(epoch_loop: Any) -> None:
    """Undo :func:`skip_sigterm_broadcast` (a no-op when it was not skipped)."""
    if "_broadcast_sigterm_tensor" in vars(epoch_loop):
        del epoch_loop._broadcast_sigterm_tensor


def reset_logged_results(trainer: Any) -> None:
    """``trainer._logger_connector.reset_results()`` and ``reset_metrics()``: drop what was logged meanwhile, and
    the batch ``_results`` holds until ``on_batch_end`` (which a step that ran out of memory never reaches)."""
    trainer._logger_connector.reset_results()
    if trainer._results is not None:
        trainer._results.batch = None
    trainer._logger_connector.reset_metrics()


def swap_strategy_optimizers(strategy: Any, optimizers: Any, lightning_optimizers: Any) -> tuple[Any, Any]:
    """Set ``strategy._optimizers`` and ``_lightning_optimizers`` (the setter rewraps them); returns what they held."""
    held = strategy._optimizers, strategy._lightning_optimizers
    strategy._optimizers, strategy._lightning_optimizers = optimizers, lightning_optimizers
    return held


def to_lightning_optimizer(optimizer: Any, strategy: Any) -> LightningOptimizer:
    return of_namespace(strategy, "core.optimizer", "LightningOptimizer")._to_lightning_optimizer(optimizer, strategy)


def saved_arg_names(loader: Any) -> list[str]:
    """The positional argument names Lightning recorded on ``loader`` (``__pl_saved_arg_names``), or none."""
    return list(getattr(loader, "__pl_saved_arg_names", ()))


def checkpoint_schedule(callback: Any) -> tuple[Optional[int], Optional[int], Any]:
    """A ``ModelCheckpoint``'s ``(every_n_train_steps, every_n_epochs, train_time_interval)``; ``None``: off."""
    every_steps = getattr(callback, "_every_n_train_steps", 0) or None
    every_epochs = getattr(callback, "_every_n_epochs", 0) or None
    return every_steps, every_epochs, getattr(callback, "_train_time_interval", None)


def last_checkpoint_saved(callback: Any) -> str:
    return getattr(callback, "_last_checkpoint_saved", "")


def attach_data(trainer: Any, module: Any, datamodule: Any = None) -> None:
    trainer._data_connector.attach_data(module, datamodule=datamodule)


SAVE_CHECKPOINT_ACTION, TRAINING_BATCH_ACTION = "save_checkpoint", "run_training_batch"  # a save; a whole step
EPOCH_END_HOOKS = "on_advance_end"  #: the fit loop's method that calls the training epoch's end hooks
BEFORE_FETCH = "_on_before_fetch"  #: the training epoch loop's method its fetcher calls before each ``next()``


def step_completed(trainer: Any) -> bool:
    """Whether the last training step started ran to its end (``on_train_batch_start`` did not return ``-1``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return bool(progress.completed == progress.ready)


#: hook actions are ``"<prefix><owner>.<hook>"``: a callback's state key, a module's or datamodule's class
CALLBACK_ACTION, MODULE_ACTION, DATAMODULE_ACTION = "[Callback]", "[LightningModule]", "[LightningDataModule]"
HOOK_ACTION_PREFIXES = (CALLBACK_ACTION, MODULE_ACTION, DATAMODULE_ACTION)


# fmt: off
#: hooks Lightning calls every batch
_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                "on_before_zero_grad", "on_before_optimizer_step", "on_validation_batch_start",
                "on_validation_batch_end")
# fmt: on


def overrides(obj: Any, hook: str, base: tuple[str, str] = ("callbacks", "Callback")) -> bool:
    """Whether ``obj``'s class has its own ``hook``, not the no-op of Lightning's class ``base`` (either namespace)."""
    return getattr(type(obj), hook, None) not in {getattr(cls, hook, None) for cls in any_namespace(*base)}


def skip_unused_batch_hooks(callback: Any) -> None:
    """Set to ``None`` on ``callback`` the per-batch hooks its class leaves as ``Callback``'s no-ops: Lightning calls a
    callback's hook only when it is callable (``_call_callback_hooks``), so they cost no profiler action a batch."""
    for name in _BATCH_HOOKS:
        if not overrides(callback, name):
            setattr(callback, name, None)


def running_hook(frame: Any) -> str:
    """The profiler action of the innermost hook call ``frame`` runs in (``""``: none), from the frames of
    ``_call_callback_hooks`` (its locals ``callback``, ``hook_name``) and ``_call_lightning_module_hook``."""
    callback_hooks = {caller.__code__ for caller in any_namespace("trainer.call", "_call_callback_hooks")}
    module_hooks = {caller.__code__ for caller in any_namespace("trainer.call", "_call_lightning_module_hook")}
    while frame is not None:
        if frame.f_code in callback_hooks:
            return f"{CALLBACK_ACTION}{frame.f_locals['callback'].state_key}.{frame.f_locals['hook_name']}"
        if frame.f_code in module_hooks:
            return f"{MODULE_ACTION}{type(frame.f_locals['pl_module']).__name__}.{frame.f_locals['hook_name']}"
        frame = frame.f_back
    return ""


def fetch_action(trainer: Any) -> str:
    return f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"


def strategy_action(trainer: Any, hook: str) -> str:
    return f"[Strategy]{type(trainer.strategy).__name__}.{hook}"


def precision_as_asked(trainer: Any) -> bool:
    """Whether ``trainer.precision`` is the Trainer's own (on CPU, Lightning may run "16-mixed" as "bf16-mixed")."""
    c = trainer._accelerator_connector
    rewritten = c._accelerator_flag == "cpu" and c._precision_flag == "bf16-mixed" and not hasattr(c, "_fp16_kept")
    return trainer.precision_plugin is c.precision_plugin and not rewritten


@contextlib.contextmanager
def fp16_kept_on_cpu() -> Iterator[None]:
    """While entered, a Trainer made with ``precision="16-mixed"`` on CPU keeps float16 autocast and a GradScaler."""
    classes: Any = any_namespace("trainer.connectors.accelerator_connector", "_AcceleratorConnector")
    originals = {_namespace(cls): vars(cls)["_check_and_init_precision"] for cls in classes}

    def keeping_fp16(connector: Any) -> Any:
        connector._fp16_kept, original, asked = True, originals[_namespace(connector)], connector._precision_flag
        if asked != "16-mixed" or connector._accelerator_flag != "cpu" or connector._precision_plugin_flag:
            return original(connector)
        connector._precision_flag = "32-true"  # to learn whether the strategy has its own class (XLA, FSDP, ...)
        plain, connector._precision_flag = original(connector), asked
        if type(plain) is not of_namespace(connector, "plugins.precision", "Precision"):
            return original(connector)
        return of_namespace(connector, "plugins.precision", "MixedPrecision")(asked, "cpu")

    try:
        for cls in classes:
            cls._check_and_init_precision = keeping_fp16
        yield
    finally:
        for cls in classes:
            cls._check_and_init_precision = originals[_namespace(cls)]
