"""Every Lightning internal that :mod:`lightning_gpuopt.callbacks._lightning_compat` relies on, checked
against the installed Lightning, under both namespaces (``lightning.pytorch`` and ``pytorch_lightning``:
one compat module serves both, each internal is checked on each namespace's objects).

A release that moves, renames or retypes one fails here with a message naming the attribute or import
and the installed version, rather than somewhere deep inside a callback. The attributes are read on
the real objects of a short CPU fit, in the middle of it (``on_train_batch_start``), where the
callbacks read them; the profiler action names are checked against what the Trainer records.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import lightning
import lightning.pytorch
import pytest
import pytorch_lightning
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

COMPAT = "lightning_gpuopt/callbacks/_lightning_compat.py"


@dataclass(frozen=True)
class Namespace:
    name: str  # "lightning.pytorch" or "pytorch_lightning"
    pl: ModuleType
    version: str
    compat_module: str

    @property
    def compat(self) -> ModuleType:
        return importlib.import_module(self.compat_module)

    def module_path(self, path: str) -> str:
        """A ``lightning.pytorch``/``lightning.fabric`` module path in this namespace."""
        return _renamed(path, self.name)


def _renamed(path: str, namespace: str) -> str:
    """As Lightning renames imports for ``pytorch_lightning`` (``lightning.pytorch`` -> ``pytorch_lightning``,
    ``lightning.fabric`` -> ``lightning_fabric``)."""
    if namespace == "lightning.pytorch":
        return path
    return path.replace("lightning.pytorch", "pytorch_lightning").replace("lightning.fabric", "lightning_fabric")


NAMESPACES = [
    Namespace(
        "lightning.pytorch", lightning.pytorch, lightning.__version__, "lightning_gpuopt.callbacks._lightning_compat"
    ),
    Namespace(
        "pytorch_lightning",
        pytorch_lightning,
        pytorch_lightning.__version__,
        "lightning_gpuopt.callbacks._lightning_compat",
    ),
]


@pytest.fixture(params=NAMESPACES, ids=[ns.name for ns in NAMESPACES], scope="module")
def ns(request: Any) -> Namespace:
    return request.param


def moved(ns: Namespace, what: str, expected: str, found: str = "") -> None:
    """Fail loudly: ``what`` is gone or changed in the installed Lightning."""
    pytest.fail(
        f"{ns.name} {ns.version}: {what} is not what {COMPAT} relies on (expected {expected}"
        f"{'; found ' + found if found else ''}). This Lightning release moved, renamed or changed it: update "
        f"the compat module's function for it and its docstring (or pin lightning below this version).",
        pytrace=False,
    )


# -- private imports --------------------------------------------------------------------------------

#: (module, name, compat's name for it, a call signature it must accept: (args, kwargs) of placeholders)
PRIVATE_IMPORTS = [
    ("lightning.fabric.utilities.seed", "_collect_rng_states", "collect_rng_states", ((), {"include_cuda": False})),
    ("lightning.fabric.utilities.seed", "_set_rng_states", "set_rng_states", (("states",), {})),
    (
        "lightning.fabric.utilities.data",
        "_reinstantiate_wrapped_cls",
        "reinstantiate_wrapped_cls",
        (("loader", 1), {"x": 2}),
    ),
    (
        "lightning.pytorch.core.optimizer",
        "_init_optimizers_and_lr_schedulers",
        "init_optimizers_and_lr_schedulers",
        (("model",), {}),
    ),
    ("lightning.pytorch.core.optimizer", "_MockOptimizer", "MockOptimizer", None),
    ("lightning.pytorch.loops.loop", "_Loop", None, None),
    ("lightning.pytorch.loops.progress", "_BaseProgress", None, None),
    ("lightning.pytorch.trainer.connectors.data_connector", "_DataLoaderSource", "DataLoaderSource", None),
    (
        "lightning.pytorch.trainer.connectors.data_connector",
        "_request_dataloader",
        "request_dataloader",
        (("source",), {}),
    ),
    (
        "lightning.pytorch.utilities.data",
        "_get_dataloader_init_args_and_kwargs",
        "dataloader_init_args_and_kwargs",
        (("loader", "sampler"), {}),
    ),
    (
        "lightning.pytorch.utilities.parsing",
        "_lightning_get_all_attr_holders",
        "attribute_holders",
        (("model", "batch_size"), {}),
    ),
]


@pytest.mark.parametrize(
    ("module", "name", "ours", "call"), PRIVATE_IMPORTS, ids=[f"{m}.{n}" for m, n, _, _ in PRIVATE_IMPORTS]
)
def test_private_import_exists_and_takes_our_arguments(ns, module, name, ours, call):
    path = ns.module_path(module)
    try:
        found = getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as error:
        moved(ns, f"`from {path} import {name}`", "it to import", f"{type(error).__name__}: {error}")
    if call is None:
        if not inspect.isclass(found):
            moved(ns, f"`{path}.{name}`", "a class", repr(found))
    else:
        args, kwargs = call
        try:
            inspect.signature(found).bind(*args, **kwargs)
        except TypeError as error:
            moved(
                ns,
                f"`{path}.{name}`",
                f"a callable taking {args} and {sorted(kwargs)}",
                f"{inspect.signature(found)}: {error}",
            )
    # one compat module serves both namespaces: it holds lightning.pytorch's, which must be pytorch_lightning's twin
    ours_found = getattr(importlib.import_module(module), name)
    if ours is not None and getattr(ns.compat, ours) is not ours_found:
        moved(ns, f"`{module}.{name}`", f"the object the compat module calls `{ours}`")
    if call is not None and _parameters(found) != _parameters(ours_found):
        moved(ns, f"`{path}.{name}`", f"the parameters of `{module}.{name}`", str(inspect.signature(found)))


def _parameters(function: Any) -> list[tuple]:
    """Names, kinds and whether each has a default (the annotations name each namespace's own classes)."""
    return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(function).parameters.values()]


def test_lightning_optimizer_to_lightning_optimizer(ns):
    from_module = importlib.import_module(ns.module_path("lightning.pytorch.core.optimizer"))
    method = getattr(from_module.LightningOptimizer, "_to_lightning_optimizer", None)
    if not callable(method):
        moved(ns, "`LightningOptimizer._to_lightning_optimizer`", "a classmethod (optimizer, strategy)", repr(method))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    strategy = ns.pl.Trainer(accelerator="cpu", logger=False).strategy
    wrapped = ns.compat.to_lightning_optimizer(optimizer, strategy)
    if not isinstance(wrapped, from_module.LightningOptimizer) or wrapped.optimizer is not optimizer:
        moved(
            ns,
            "`LightningOptimizer._to_lightning_optimizer(optimizer, strategy)`",
            "a LightningOptimizer wrapping the optimizer",
            repr(wrapped),
        )


# -- attributes of a real Trainer, read mid-fit ------------------------------------------------------------


def _is_source(value: Any, c: ModuleType) -> bool:
    return (
        type(value).__name__ == c.DataLoaderSource.__name__
        and hasattr(value, "instance")
        and hasattr(value, "name")
        and all(callable(getattr(value, m, None)) for m in ("dataloader", "is_module", "is_defined"))
    )


def _progress(trainer: Any, c: ModuleType) -> list:
    """What the trial engine saves and resets: the counters of the loops (of this namespace's build)."""
    return c.progress_counters(trainer.fit_loop)


#: attribute -> (how it is read, what it must be, the check); each read in on_train_batch_start
ATTRIBUTES: dict[str, tuple[Callable[[Any, ModuleType], Any], str, Callable[[Any, Any, ModuleType], bool]]] = {
    "trainer.fit_loop._data_source": (
        lambda t, c: t.fit_loop._data_source,
        "a _DataLoaderSource with instance, name, dataloader(), is_module(), is_defined()",
        lambda v, t, c: _is_source(v, c) and c.train_source(t) is v and v.is_module() and v.is_defined(),
    ),
    "trainer.fit_loop._data_fetcher": (
        lambda t, c: t.fit_loop._data_fetcher,
        "the fit loop's data fetcher, with teardown() and a `batches` list (the prefetched batches)",
        lambda v, t, c: (
            callable(getattr(v, "teardown", None))
            and isinstance(getattr(v, "batches", None), list)
            and c.data_fetcher(t) is v
        ),
    ),
    "trainer.fit_loop._combined_loader": (
        lambda t, c: t.fit_loop._combined_loader,
        "a CombinedLoader whose .flattened[0] is the train DataLoader",
        lambda v, t, c: isinstance(v.flattened[0], DataLoader) and c.built_train_loader(t) is v.flattened[0],
    ),
    "trainer.fit_loop.epoch_loop._batches_that_stepped": (
        lambda t, c: t.fit_loop.epoch_loop._batches_that_stepped,
        "an int (the step loggers get)",
        lambda v, t, c: type(v) is int and c.batches_that_stepped(t) == v,
    ),
    "trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor": (
        lambda t, c: t.fit_loop.epoch_loop._broadcast_sigterm_tensor,
        "a method of the epoch loop, called each step",
        lambda v, t, c: inspect.ismethod(v) and "_broadcast_sigterm_tensor" in dir(type(t.fit_loop.epoch_loop)),
    ),
    "trainer._logger_connector.reset_results/reset_metrics": (
        lambda t, c: t._logger_connector,
        "a connector with reset_results() and reset_metrics()",
        lambda v, t, c: callable(getattr(v, "reset_results", None)) and callable(getattr(v, "reset_metrics", None)),
    ),
    "trainer._signal_connector.received_sigterm": (
        lambda t, c: t._signal_connector,
        "a connector with a bool received_sigterm that trainer.received_sigterm reads",
        lambda v, t, c: (
            type(v.received_sigterm) is bool and c.signal_connector(t) is v and t.received_sigterm is v.received_sigterm
        ),
    ),
    "trainer.strategy._optimizers": (
        lambda t, c: t.strategy._optimizers,
        "the list of torch optimizers, the same object the public strategy.optimizers returns",
        lambda v, t, c: (
            isinstance(v, list)
            and len(v) == 1
            and isinstance(v[0], torch.optim.Optimizer)
            and t.strategy.optimizers is v
        ),
    ),
    "trainer.strategy._lightning_optimizers": (
        lambda t, c: t.strategy._lightning_optimizers,
        "a list of LightningOptimizer, one per optimizer",
        lambda v, t, c: (
            isinstance(v, list)
            and len(v) == 1
            and isinstance(v[0], c.any_namespace("core.optimizer", "LightningOptimizer"))
            and v[0].optimizer is t.strategy._optimizers[0]
        ),
    ),
    "fit loop progress counters (_Loop / _BaseProgress)": (
        lambda t, c: _progress(t, c),
        "the fit loop and its epoch loop being _Loop instances holding _BaseProgress counters",
        lambda v, t, c: (
            isinstance(t.fit_loop, c.any_namespace("loops.loop", "_Loop"))
            and isinstance(t.fit_loop.epoch_loop, c.any_namespace("loops.loop", "_Loop"))
            and len(v) >= 3
            and all(isinstance(p, c.any_namespace("loops.progress", "_BaseProgress")) and callable(p.reset) for p in v)
        ),
    ),
    "trainer._data_connector.attach_data": (
        lambda t, c: t._data_connector.attach_data,
        "a method (model, datamodule=...)",
        lambda v, t, c: callable(v) and "datamodule" in inspect.signature(v).parameters,
    ),
    "ModelCheckpoint._every_n_train_steps/_every_n_epochs/_train_time_interval": (
        lambda t, c: [
            vars(t.checkpoint_callback)[k] for k in ("_every_n_train_steps", "_every_n_epochs", "_train_time_interval")
        ],
        "the schedule ModelCheckpoint(every_n_train_steps=1, train_time_interval=None) keeps: 1, 0, None",
        lambda v, t, c: v == [1, 0, None] and c.checkpoint_schedule(t.checkpoint_callback) == (1, None, None),
    ),
    "ModelCheckpoint._last_checkpoint_saved": (
        lambda t, c: vars(t.checkpoint_callback)["_last_checkpoint_saved"],
        "a str: the path last saved",
        lambda v, t, c: isinstance(v, str) and c.last_checkpoint_saved(t.checkpoint_callback) == v,
    ),
}


def _model_class(pl: ModuleType) -> type:
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny


def _datamodule_class(pl: ModuleType) -> type:
    class TinyData(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            generator = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, 4)  # batch_size positional: recorded in __pl_saved_arg_names

    return TinyData


def _recording_profiler(pl: ModuleType) -> Any:
    class Recording(pl.profilers.PassThroughProfiler):
        def __init__(self) -> None:
            super().__init__()
            self.actions: list[str] = []

        def start(self, action_name: str) -> None:
            self.actions.append(action_name)

    return Recording()


@pytest.fixture(scope="module")
def fitted(ns, tmp_path_factory) -> dict:
    """One short CPU fit per namespace: each attribute read mid-fit, the profiler's actions, the trainer."""
    pl, c = ns.pl, ns.compat
    results: dict[str, tuple[bool, str]] = {}
    seen: dict[str, Any] = {}

    class Reader(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != 1:  # the second step: a checkpoint was saved after the first
                return
            seen["loader"] = c.request_dataloader(c.train_source(trainer))
            for name, (read, _, check) in ATTRIBUTES.items():
                try:
                    value = read(trainer, c)
                except Exception as error:  # noqa: BLE001 - reported by the test of this attribute
                    results[name] = (False, f"{type(error).__name__}: {error}")
                    continue
                try:
                    results[name] = (bool(check(value, trainer, c)), repr(value)[:200])
                except Exception as error:  # noqa: BLE001
                    results[name] = (False, f"{repr(value)[:200]} ({type(error).__name__}: {error})")

    reader = Reader()
    profiler = _recording_profiler(pl)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path_factory.mktemp("ckpt"), every_n_train_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[reader, checkpoint],
        profiler=profiler,
        default_root_dir=tmp_path_factory.mktemp("root"),
    )
    model, data = _model_class(pl)(), _datamodule_class(pl)()
    trainer.fit(model, datamodule=data)
    return {
        "results": results,
        "actions": profiler.actions,
        "trainer": trainer,
        "model": model,
        "data": data,
        "reader": reader,
        "loader": seen.get("loader"),
    }


@pytest.mark.parametrize("attribute", list(ATTRIBUTES))
def test_trainer_attribute_is_where_we_read_it(ns, fitted, attribute):
    expected = ATTRIBUTES[attribute][1]
    if attribute not in fitted["results"]:
        moved(ns, f"`{attribute}`", expected, "the fit never reached its second training step")
    ok, found = fitted["results"][attribute]
    if not ok:
        moved(ns, f"`{attribute}`", expected, found)


def test_profiler_action_names_are_what_lightning_records(ns, fitted):
    c, trainer, actions = ns.compat, fitted["trainer"], set(fitted["actions"])
    expected = {
        "the train fetch (fetch_action)": c.fetch_action(trainer),
        "the strategy's batch_to_device (strategy_action)": c.strategy_action(trainer, "batch_to_device"),
        "the strategy's training_step (strategy_action)": c.strategy_action(trainer, "training_step"),
        "trainer.save_checkpoint (SAVE_CHECKPOINT_ACTION)": c.SAVE_CHECKPOINT_ACTION,
        "a callback hook (CALLBACK_ACTION)": f"{c.CALLBACK_ACTION}{fitted['reader'].state_key}.on_train_batch_start",
        "a LightningModule hook (MODULE_ACTION)": f"{c.MODULE_ACTION}{type(fitted['model']).__name__}.on_before_backward",
        "a LightningDataModule hook (DATAMODULE_ACTION)": f"{c.DATAMODULE_ACTION}{type(fitted['data']).__name__}.setup",
    }
    for what, name in expected.items():
        if name not in actions:
            near = sorted(a for a in actions if name.split("]")[0].split(".")[0] in a or name.split(".")[-1] in a)[:8]
            moved(ns, f"the profiler action for {what}, {name!r}", "the Trainer to record it", f"similar: {near}")
    for action in actions:  # every hook action parses as "<prefix><owner>.<hook>" (HookTimes._owner)
        if action.startswith(c.HOOK_ACTION_PREFIXES) and "." not in action[action.index("]") + 1 :]:
            moved(ns, f"the profiler action {action!r}", "'<prefix><owner>.<hook>'")


# -- functions of the compat module, exercised -----------------------------------------------------------


def test_train_loader_reset_and_rebuild(ns, fitted):
    c, trainer = ns.compat, fitted["trainer"]
    c.reset_train_loader(trainer)
    if trainer.fit_loop._data_fetcher is not None or trainer.fit_loop._combined_loader is not None:
        moved(ns, "fit_loop._data_fetcher/_combined_loader", "both None after reset_train_loader")
    trainer.fit_loop.setup_data()
    if not isinstance(c.built_train_loader(trainer), DataLoader):
        moved(ns, "fit_loop.setup_data() then _combined_loader.flattened[0]", "a rebuilt DataLoader")
    c.reset_train_loader(trainer)
    source = c.train_source(trainer)
    setattr(trainer.fit_loop, c.TRAIN_SOURCE_ATTRIBUTE, source)
    if trainer.fit_loop._data_source is not source:
        moved(ns, "fit_loop._data_source", "settable")


def test_loader_recreated_from_its_recorded_arguments(ns, fitted):
    c, loader = ns.compat, fitted["loader"]
    if c.saved_arg_names(loader)[:2] != ["dataset", "batch_size"]:
        moved(
            ns,
            "a train loader's `__pl_saved_arg_names`",
            "the positional names ['dataset', 'batch_size']",
            repr(getattr(loader, "__pl_saved_arg_names", None)),
        )
    args, kwargs = c.dataloader_init_args_and_kwargs(loader, loader.sampler)
    copy = c.reinstantiate_wrapped_cls(loader, *args, **{**kwargs, "num_workers": 0})
    if type(copy) is not type(loader) or copy.batch_size != loader.batch_size or copy.dataset is not loader.dataset:
        moved(
            ns,
            "_get_dataloader_init_args_and_kwargs/_reinstantiate_wrapped_cls",
            "a copy of the loader (same class, dataset, batch size)",
            repr(copy),
        )


def test_step_counter_sigterm_broadcast_and_logged_results(ns, fitted):
    c, trainer = ns.compat, fitted["trainer"]
    steps = c.batches_that_stepped(trainer)
    c.set_batches_that_stepped(trainer, steps + 5)
    if trainer.fit_loop.epoch_loop._batches_that_stepped != steps + 5:
        moved(ns, "epoch_loop._batches_that_stepped", "settable")
    c.set_batches_that_stepped(trainer, steps)
    epoch_loop = trainer.fit_loop.epoch_loop
    c.skip_sigterm_broadcast(epoch_loop)
    if epoch_loop._broadcast_sigterm_tensor() is not None:
        moved(ns, "epoch_loop._broadcast_sigterm_tensor", "replaced by a no-op")
    c.restore_sigterm_broadcast(epoch_loop)
    if "_broadcast_sigterm_tensor" in vars(epoch_loop) or not inspect.ismethod(epoch_loop._broadcast_sigterm_tensor):
        moved(ns, "epoch_loop._broadcast_sigterm_tensor", "the class's method back after restore_sigterm_broadcast")
    stage, trainer.training = trainer.state.stage, True  # the fit loop active, as in a trial
    trainer._results.batch = held = [torch.zeros(3)]  # as on_batch_start sets it
    c.reset_logged_results(trainer)
    if trainer._results.batch is held:
        moved(ns, "trainer._results.batch", "the batch a step holds until on_batch_end, dropped")
    trainer.state.stage = stage


def test_attach_data_attribute_holders_and_configure_optimizers(ns, tmp_path):
    pl, c = ns.pl, ns.compat
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, default_root_dir=tmp_path
    )
    model, data = _model_class(pl)(), _datamodule_class(pl)()
    c.attach_data(trainer, model, datamodule=data)
    trainer.strategy.connect(model)
    if trainer.datamodule is not data or data.trainer is not trainer:
        moved(ns, "trainer._data_connector.attach_data(model, datamodule=...)", "the datamodule attached")
    data.setup(stage="fit")
    model.batch_size, data.batch_size = 4, 8
    holders = c.attribute_holders(model, "batch_size")
    if len(holders) != 2 or holders[0] is not model or holders[1] is not data:
        moved(ns, "_lightning_get_all_attr_holders(model, 'batch_size')", "[the model, the datamodule]", repr(holders))
    optimizers, schedulers = c.init_optimizers_and_lr_schedulers(model)
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.SGD) or schedulers:
        moved(
            ns,
            "_init_optimizers_and_lr_schedulers(model)",
            "([the SGD of configure_optimizers()], [])",
            repr((optimizers, schedulers)),
        )
    model.configure_optimizers = lambda: None  # type: ignore[method-assign]
    with pytest.warns(
        UserWarning
    ):  # Lightning: "configure_optimizers returned None, this fit will run with no optimizer"
        optimizers, _ = c.init_optimizers_and_lr_schedulers(model)
    if not (len(optimizers) == 1 and isinstance(optimizers[0], c.MockOptimizer)):
        moved(
            ns,
            "_init_optimizers_and_lr_schedulers for configure_optimizers() -> None",
            "[_MockOptimizer()]",
            repr(optimizers),
        )


def test_precision_as_asked_and_fp16_kept_on_cpu(ns):
    """On a CPU accelerator Lightning runs "16-mixed" as "bf16-mixed" and keeps no record of what was asked."""
    pl, c = ns.pl, ns.compat
    mixed = importlib.import_module(ns.module_path("lightning.pytorch.plugins.precision")).MixedPrecision
    connector = importlib.import_module(ns.module_path("lightning.pytorch.trainer.connectors.accelerator_connector"))
    original = vars(connector._AcceleratorConnector)["_check_and_init_precision"]

    def made(**settings: Any) -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **settings)

    swapped = made()
    swapped.strategy.precision_plugin = mixed("bf16-mixed", "cpu")
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        rewritten = made(precision="16-mixed")
    trainers = {"nothing": made(), "16-mixed": rewritten, "bf16-mixed": made(precision="bf16-mixed")}
    trainers.update(plugin=made(plugins=[mixed("16-mixed", "cpu")]), swapped=swapped)
    with c.fp16_kept_on_cpu():
        trainers.update(kept=made(precision="16-mixed"), kept_bf16=made(precision="bf16-mixed"))
    found = {name: (str(t.precision), c.precision_as_asked(t)) for name, t in trainers.items()}
    expected = {
        "nothing": ("32-true", True),
        "16-mixed": ("bf16-mixed", False),  # Lightning's rewrite
        "bf16-mixed": ("bf16-mixed", False),  # cannot be told from the rewrite
        "plugin": ("16-mixed", True),
        "swapped": ("bf16-mixed", False),
        "kept": ("16-mixed", True),
        "kept_bf16": ("bf16-mixed", True),
    }
    if found != expected:
        moved(ns, "_accelerator_connector._precision_flag/_check_and_init_precision", str(expected), str(found))
    kept = trainers["kept"].precision_plugin
    if not isinstance(kept, mixed) or kept.device != "cpu" or not isinstance(kept.scaler, torch.amp.GradScaler):
        moved(ns, "MixedPrecision under fp16_kept_on_cpu", "MixedPrecision('16-mixed', 'cpu') with a GradScaler")
    if vars(connector._AcceleratorConnector)["_check_and_init_precision"] is not original:
        moved(ns, "_AcceleratorConnector._check_and_init_precision", "Lightning's own after fp16_kept_on_cpu")


def test_strategy_optimizer_lists_round_trip(ns, fitted):
    c, strategy = ns.compat, fitted["trainer"].strategy
    lists = strategy._optimizers, strategy._lightning_optimizers
    saved = c.swap_strategy_optimizers(strategy, [], [])
    if saved[0] is not lists[0] or saved[1] is not lists[1]:
        moved(ns, "strategy._optimizers/_lightning_optimizers", "the lists the strategy held")
    if strategy.optimizers != [] or strategy._lightning_optimizers != []:
        moved(ns, "strategy._optimizers/_lightning_optimizers", "settable, and read by strategy.optimizers")
    c.swap_strategy_optimizers(strategy, *saved)
    if strategy._optimizers is not saved[0] or strategy._lightning_optimizers is not saved[1]:
        moved(ns, "strategy._optimizers/_lightning_optimizers", "the very lists put back")


def test_parser_option_actions(ns, tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    pl, c = ns.pl, ns.compat
    cli_module = importlib.import_module(ns.module_path("lightning.pytorch.cli"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py"])
    cli = cli_module.LightningCLI(
        _model_class(pl),
        run=False,
        save_config_callback=None,
        seed_everything_default=False,
        args=["--trainer.logger=false", "--trainer.accelerator=cpu", "--trainer.enable_checkpointing=false"],
    )
    actions = c.parser_option_actions(cli.parser)
    if (
        not isinstance(actions, dict)
        or "--trainer.max_steps" not in actions
        or not hasattr(actions["--trainer.max_steps"], "help")
    ):
        moved(
            ns,
            "`LightningArgumentParser._option_string_actions`",
            "argparse's flag -> action dict",
            repr(type(actions)),
        )


def test_local_file_protocol_is_the_test_core_makes(ns):
    """The report goes where Lightning puts its logs: Lightning decides local or URL for its log dirs and
    checkpoints with its private ``_is_local_file_protocol``, ``report_dir`` with ``core.storage.is_url``
    (core imports no Lightning): they must agree. The package does not import Lightning's; this test does."""
    from lightning_gpuopt.core.storage import is_url

    cloud_io = importlib.import_module(ns.module_path("lightning.fabric.utilities.cloud_io"))
    is_local_file_protocol = cloud_io._is_local_file_protocol
    paths = ["lightning_logs/version_0", "/abs/run", "~/run", "file:///tmp/run", "s3://bucket/run", "memory://run"]
    paths += ["gcs://bucket/run", "simplecache::s3://bucket/run", "C:/runs", "relative/with:colon"]
    disagree = [path for path in paths if is_local_file_protocol(path) == is_url(path)]
    if disagree:
        moved(
            ns, "`_is_local_file_protocol`", "the local/URL decision of core.storage.is_url", f"differs on {disagree}"
        )


def test_module_docstring_names_every_internal(ns):
    doc = ns.compat.__doc__ or ""
    names = [name for _, name, _, _ in PRIVATE_IMPORTS] + [
        "_data_source",
        "_data_fetcher",
        "_combined_loader",
        "_batches_that_stepped",
        "_broadcast_sigterm_tensor",
        "_logger_connector",
        "_signal_connector",
        "_optimizers",
        "_lightning_optimizers",
        "_to_lightning_optimizer",
        "__pl_saved_arg_names",
        "_every_n_train_steps",
        "_last_checkpoint_saved",
        "_data_connector",
        "_option_string_actions",
        "_accelerator_connector",
        "_precision_flag",
        "_precision_plugin_flag",
        "_check_and_init_precision",
        "train_dataloader_next",
        "[Strategy]",
        "[Callback]",
        "[LightningModule]",
        "[LightningDataModule]",
        "save_checkpoint",
        "on_advance_end",
        "val_loop.run",
        "_call_callback_hooks",
        "_call_lightning_module_hook",
        "_on_before_fetch",
        "batch_progress",
    ]
    missing = [name for name in names if name not in doc]
    assert not missing, f"{COMPAT}'s docstring does not list {missing}"


def test_a_hook_set_to_none_is_skipped_and_epoch_end_hooks_run_in_on_advance_end(ns, tmp_path):
    pl, c = ns.pl, ns.compat
    calls: list[str] = []
    running: set[str] = {c.running_hook(sys._getframe())}  # no hook: ""

    class Hooks(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            calls.append("batch_end")
            running.add(c.running_hook(sys._getframe()))

    class Model(_model_class(pl)):  # type: ignore[misc]  # a class made at run time
        def on_train_batch_start(self, *args: Any) -> None:
            running.add(c.running_hook(sys._getframe()))

        def on_train_epoch_end(self, *args: Any) -> None:
            calls.append("epoch_end")

    hooks = Hooks()
    c.skip_unused_batch_hooks(hooks)
    skipped = [name for name in c._BATCH_HOOKS if getattr(hooks, name) is None]
    if skipped != [name for name in c._BATCH_HOOKS if name != "on_train_batch_end"]:
        moved(ns, "skip_unused_batch_hooks", "every per-batch hook not overridden set to None", skipped)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[hooks], default_root_dir=tmp_path)  # fmt: skip
    epoch_end = getattr(trainer.fit_loop, c.EPOCH_END_HOOKS)
    setattr(trainer.fit_loop, c.EPOCH_END_HOOKS, lambda: (calls.append("on_advance_end"), epoch_end()))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))  # a None hook: no TypeError
    if calls != ["batch_end", "batch_end", "on_advance_end", "epoch_end"]:
        moved(ns, f"fit_loop.{c.EPOCH_END_HOOKS}", "the caller of every on_train_epoch_end", calls)
    expected = {"", f"[Callback]{hooks.state_key}.on_train_batch_end", "[LightningModule]Model.on_train_batch_start"}
    if running != expected:
        moved(ns, "_call_callback_hooks/_call_lightning_module_hook locals", "running_hook's hook names", running)


def test_the_fetch_start_runs_before_every_training_batch_and_a_step_ended_by_minus_one_is_not_completed(ns, tmp_path):
    pl, c = ns.pl, ns.compat
    events: list[Any] = []

    class Hooks(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            events.append("step")

        def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
            events.append(c.step_completed(trainer))

    class Model(_model_class(pl)):  # type: ignore[misc]  # a class made at run time
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
            return -1 if self.current_epoch == 0 and batch_idx == 1 else None

    trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[Hooks()], default_root_dir=tmp_path)  # fmt: skip
    fetch_starts = getattr(trainer.fit_loop.epoch_loop, c.BEFORE_FETCH)
    setattr(trainer.fit_loop.epoch_loop, c.BEFORE_FETCH, lambda: (events.append("fetch"), fetch_starts()))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))
    if events != ["fetch", "step", "fetch", "step", False, "fetch", "step", "fetch", "step", True]:
        moved(ns, f"epoch_loop.{c.BEFORE_FETCH} / batch_progress.current", "a call before each fetch; -1 seen", events)
