"""Leave no trace (issue 11): a run with our callbacks equals the settings they chose written by hand,
bit for bit, and a fit that fails at any phase leaves the Trainer, the model, the loaders, the
precision and the process's signal handlers as they were.

The truth is always a run written by hand: the same seed, the chosen batch size, accumulation,
precision, checkpointed blocks and loader settings set directly, no callback of ours. Compared:
the weights after the steps, the RNG states (torch, numpy, Python's ``random``) and the logger's
rows apart from ``gpuopt/*``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from helpers import REPO, TESTS, quiet_trainer
from lightning import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import Logger
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt, MemoryEstimator, MemoryFill
from lightning_gpuopt.core.checkpointing import enable_checkpointing, select_blocks

SAMPLES, FEATURES, CLASSES = 64, 8, 4
#: the module's run hooks as they were called (a user writing to a file or a tracker does the same)
HOOK_CALLS: list[str] = []
MAX_MEMORY = "64MB"  # every plan below fits in it: the plans differ by preset, not by memory


# ---------------------------------------------------------------------- a model that draws from every RNG


class Noisy(Dataset):
    """Fixed samples; ``fail_when(index)`` may raise (a user's data failing at a chosen moment)."""

    def __init__(self, tag: float = 0.0, fail_when: Optional[Callable[[int], bool]] = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator) + tag
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
        self.fail_when = fail_when

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail_when is not None and self.fail_when(index):
            raise RuntimeError("the user's dataset failed")
        return self.x[index], self.y[index]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.act, self.drop = nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.linear(x)))


class Net(LightningModule):
    """Dropout (torch RNG), a numpy and a ``random`` draw per step, a shuffled loader: every RNG
    a trial, an estimate or a loader timing could disturb is one training reads."""

    def __init__(
        self,
        batch_size: int = 16,
        tag: float = 0.0,
        loader_kwargs: Optional[dict] = None,
        fail_in: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loader_kwargs", "fail_in"])
        self.embed = nn.Linear(FEATURES, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, CLASSES)
        self.loader_kwargs = loader_kwargs or {}
        self.fail_in = fail_in
        self.dataset = Noisy(tag, fail_when=self._tuning_fails if fail_in == "tuning" else None)
        self.outputs: dict[str, list[float]] = {"train": []}
        self.tags_seen: list[float] = []
        self.validated_in_autocast: list[bool] = []

    def _tuning_fails(self, index: int) -> bool:
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name == "tune_loader":
                return True
            frame = frame.f_back
        return False

    def setup(self, stage: str) -> None:
        if self.fail_in == "setup":
            raise RuntimeError("the user's setup failed")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_in == "trials":  # the first training step of a fit with a search is a trial's
            raise RuntimeError("the user's training step failed")
        x, y = batch
        self.tags_seen.append(float(x.mean().round()))
        noise = float(np.random.rand()) * 0 + random.random() * 0
        loss = F.cross_entropy(self(x), y) + noise
        self.outputs["train"].append(float(loss))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated_in_autocast.append(torch.is_autocast_enabled("cpu"))

    def on_train_start(self) -> None:
        HOOK_CALLS.append("on_train_start")  # outside the module: trials restore its attributes

    def on_train_end(self) -> None:
        HOOK_CALLS.append("on_train_end")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=True, **self.loader_kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Rows(Logger):
    """Every logged row, as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Optional[int], dict]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def without_ours(self) -> list[tuple[Optional[int], dict]]:
        rows = [
            (step, {k: v for k, v in metrics.items() if not k.startswith("gpuopt/")}) for step, metrics in self.rows
        ]
        return [(step, metrics) for step, metrics in rows if metrics]


class FailsInTraining(Callback):
    """A user callback failing at the first training step (callbacks do not see trial steps)."""

    def __init__(self) -> None:
        self.armed = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.armed:
            raise RuntimeError("the user's callback failed")


# ---------------------------------------------------------------------- runs and settings


@dataclass
class Settings:
    """What a callback chose, to be written by hand."""

    batch_size: int = 16
    accumulate_grad_batches: int = 1
    precision: str = "32-true"
    checkpointed: list[str] = field(default_factory=list)
    loader_kwargs: dict = field(default_factory=dict)


@dataclass
class Outcome:
    weights: dict[str, torch.Tensor]
    rng: tuple
    rows: list
    steps: int


def make_trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 3, "logger": Rows(), "log_every_n_steps": 1, **kwargs})


def fit(trainer: Trainer, model: Net) -> Outcome:
    trainer.logger.rows.clear()
    trainer.fit(model)
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Outcome(weights, rng, trainer.logger.without_ours(), trainer.global_step)


def fresh_model(**kwargs: Any) -> Net:
    seed_everything(0)
    return Net(**kwargs)


def by_hand(tmp_path: Path, settings: Settings) -> Outcome:
    model = fresh_model(batch_size=settings.batch_size, loader_kwargs=settings.loader_kwargs)
    if settings.checkpointed:
        enable_checkpointing(select_blocks(model, settings.checkpointed))
    trainer = make_trainer(
        tmp_path / "by_hand", [], accumulate_grad_batches=settings.accumulate_grad_batches, precision=settings.precision
    )
    return fit(trainer, model)


def chosen(callback: Callback) -> Settings:
    """The settings ``callback`` chose in its last fit."""
    if isinstance(callback, GpuOpt):
        settings = chosen(callback.fill) if callback.fill is not None else Settings()
        if callback.tuner is not None:
            settings.loader_kwargs = chosen(callback.tuner).loader_kwargs
        return settings
    if isinstance(callback, MemoryFill):
        plan = callback.plan
        return Settings(plan.micro_batch_size, plan.accumulate_grad_batches, plan.precision, plan.checkpointed_modules)
    if isinstance(callback, BatchSizeSearch):
        return Settings(batch_size=callback.result.batch_size)
    assert isinstance(callback, DataLoaderTuner)
    return Settings(loader_kwargs=callback.result.setting.loader_kwargs())


def assert_same(run: Outcome, hand: Outcome) -> None:
    assert run.steps == hand.steps == 3
    assert run.weights.keys() == hand.weights.keys()
    for name in run.weights:
        assert torch.equal(run.weights[name], hand.weights[name]), name
    assert torch.equal(run.rng[0], hand.rng[0])
    assert (
        run.rng[1][0] == hand.rng[1][0]
        and np.array_equal(run.rng[1][1], hand.rng[1][1])
        and run.rng[1][2:] == hand.rng[1][2:]
    )
    assert run.rng[2] == hand.rng[2]
    assert run.rows == hand.rows and run.rows


CALLBACKS: dict[str, Callable[[], Callback]] = {
    "BatchSizeSearch": lambda: BatchSizeSearch(max_memory=MAX_MEMORY, max_batch_size=32, verbose=False),
    "MemoryFill": lambda: MemoryFill(
        global_batch_size=32,
        max_memory=MAX_MEMORY,
        precision="bf16-mixed",
        activation_checkpointing=True,
        min_micro_batch_size=8,
        objective="memory",
        verbose=False,
    ),
    "DataLoaderTuner": lambda: DataLoaderTuner(max_seconds=0.5, batches_per_candidate=2, verbose=False),
    "GpuOpt-diagnose": lambda: GpuOpt("diagnose"),
    "GpuOpt-fill-memory": lambda: GpuOpt("fill-memory", global_batch_size=32, max_memory=MAX_MEMORY),
    "GpuOpt-max-throughput": lambda: GpuOpt(
        "max-throughput", global_batch_size=32, max_memory=MAX_MEMORY, precision="bf16-mixed", loader_max_seconds=0.5
    ),
    "GpuOpt-low-memory": lambda: GpuOpt(
        "low-memory", global_batch_size=32, max_memory=MAX_MEMORY, precision="bf16-mixed"
    ),
}


# ---------------------------------------------------------------------- run A equals run B


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_a_run_with_the_callback_equals_its_choice_written_by_hand(tmp_path, name):
    callback = CALLBACKS[name]()
    run = fit(make_trainer(tmp_path / "run", [callback]), fresh_model())
    settings = chosen(callback)
    if name in ("MemoryFill", "GpuOpt-low-memory", "GpuOpt-max-throughput"):
        assert settings.precision == "bf16-mixed"  # the comparison covers a precision the callback switched
    if name in ("MemoryFill", "GpuOpt-low-memory"):
        assert settings.checkpointed and settings.accumulate_grad_batches == 4  # micro-batch 8 of 32
    assert_same(run, by_hand(tmp_path, settings))


# ---------------------------------------------------------------------- a failed fit leaves no trace

PHASES = {
    "BatchSizeSearch": ("setup", "trials", "training"),
    "MemoryFill": ("setup", "trials", "training"),
    "DataLoaderTuner": ("setup", "tuning", "training"),
    "GpuOpt-max-throughput": ("setup", "trials", "tuning", "training"),
}


@dataclass
class Before:
    precision_plugin: Any
    source: Any
    handlers: tuple
    module_keys: list[str]


def state_before(trainer: Trainer, model: Net) -> Before:
    return Before(
        trainer.strategy.precision_plugin,
        trainer.fit_loop._data_source,
        (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)),
        list(model.state_dict()),
    )


def assert_as_before(trainer: Trainer, model: Net, before: Before) -> None:
    assert trainer.strategy.precision_plugin is before.precision_plugin
    assert trainer.precision == "32-true"
    assert trainer.accumulate_grad_batches == 1
    assert model.hparams.batch_size == 16
    assert trainer.fit_loop._data_source is before.source and type(before.source) is _DataLoaderSource
    assert list(model.state_dict()) == before.module_keys  # no checkpoint wrapper left
    assert all(type(block).forward is Block.forward and "forward" not in vars(block) for block in model.blocks)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before.handlers


@pytest.mark.parametrize("name,phase", [(name, phase) for name, phases in PHASES.items() for phase in phases])
def test_a_fit_failing_at_any_phase_leaves_no_trace_and_the_next_fit_is_a_fresh_one(tmp_path, name, phase):
    callback, failing = CALLBACKS[name](), FailsInTraining()
    failing.armed = phase == "training"
    trainer = make_trainer(tmp_path / "run", [callback, failing])
    model = fresh_model(fail_in=phase)
    before = state_before(trainer, model)
    with pytest.raises(RuntimeError, match="the user's"):
        trainer.fit(model)
    assert_as_before(trainer, model, before)
    if phase == "training" and name == "MemoryFill":  # validate after the failure runs as the user set it up
        trainer.validate(model, DataLoader(Noisy(), batch_size=8), verbose=False)
        assert model.validated_in_autocast and not any(model.validated_in_autocast)

    failing.armed = False
    again = fresh_model()
    run = fit(trainer, again)
    assert_same(run, by_hand(tmp_path, chosen(callback)))


def test_trial_mode_failing_while_it_is_set_up_puts_back_what_it_had_changed(tmp_path, monkeypatch):
    from lightning_gpuopt.callbacks._engine import trials as trials_module

    def failing(*args: Any) -> int:  # an error after trial mode set the callbacks, loggers, limits and collector
        raise RuntimeError("the user's strategy failed")

    monkeypatch.setattr(trials_module, "_ddp_bucket_bytes", failing)
    trainer, model = make_trainer(tmp_path, [CALLBACKS["BatchSizeSearch"]()]), fresh_model()
    before = state_before(trainer, model)
    settings = (list(trainer.callbacks), list(trainer.loggers), trainer.limit_train_batches, trainer.limit_val_batches)
    try:
        with pytest.raises(RuntimeError, match="the user's"):
            trainer.fit(model)
        assert gc.get_freeze_count() == 0  # the objects set aside from the collector are back
        assert (trainer.callbacks, trainer.loggers, trainer.limit_train_batches, trainer.limit_val_batches) == settings
        assert_as_before(trainer, model, before)
    finally:
        gc.unfreeze()


def test_a_trainer_reused_after_a_failed_fit_trains_the_next_model_on_its_own_data(tmp_path):
    for callback in (
        DataLoaderTuner(max_seconds=0.3, batches_per_candidate=2, verbose=False),
        GpuOpt(None, tune_loader=True, loader_max_seconds=0.3),
    ):
        failing = FailsInTraining()
        trainer = make_trainer(tmp_path, [callback, failing])
        with pytest.raises(RuntimeError, match="the user's callback failed"):
            trainer.fit(fresh_model(tag=1.0))
        failing.armed = False
        second = fresh_model(tag=2.0)
        trainer.fit(second)
        assert second.tags_seen and set(second.tags_seen) == {2.0}


# ---------------------------------------------------------------------- the user's code sees one fit


def test_the_users_hooks_and_attributes_see_one_fit_and_checkpoints_keep_the_users_batch(tmp_path):
    def make_fill() -> MemoryFill:  # trials at the user's 16, then at 32
        return MemoryFill(global_batch_size=32, max_memory=MAX_MEMORY, verbose=False)

    fill = make_fill()
    trainer = make_trainer(tmp_path, [fill], enable_checkpointing=True)
    model = fresh_model()
    HOOK_CALLS.clear()
    trainer.fit(model)
    assert fill.search.result.num_trials >= 2 and fill.plan.micro_batch_size == 32
    assert HOOK_CALLS == ["on_train_start", "on_train_end"]
    assert len(model.outputs["train"]) == 3  # 3 training steps; none of the trials' steps
    checkpoint_path = trainer.checkpoint_callback.best_model_path
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    assert checkpoint["hyper_parameters"]["batch_size"] == 16 == model.hparams.batch_size
    # a resume with the same callback plans the same batch from the user's 16 and trains on
    resumed_fill = make_fill()
    resumed = Net.load_from_checkpoint(checkpoint_path)
    assert resumed.hparams.batch_size == 16
    resumed_trainer = make_trainer(tmp_path / "resumed", [resumed_fill], max_steps=5)
    resumed_trainer.fit(resumed, ckpt_path=checkpoint_path)
    assert resumed_trainer.global_step == 5
    assert (resumed_fill.plan.micro_batch_size, resumed_fill.plan.accumulate_grad_batches) == (
        fill.plan.micro_batch_size,
        fill.plan.accumulate_grad_batches,
    )


# ---------------------------------------------------------------------- SIGTERM and Ctrl+C during our work

_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    # Ctrl+C as in a terminal: a process started in the background inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[:0] = {tests!r}
    from test_leave_no_trace import CALLBACKS, Net, fresh_model, make_trainer, state_before, assert_as_before
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    name, signum, where = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
    sent = []

    class Signalling(Net):
        def training_step(self, batch, batch_idx):  # the first step of a fit with a search is a trial's
            if where == "trials" and not sent:
                sent.append(1)
                os.kill(os.getpid(), signum)
            return super().training_step(batch, batch_idx)

    def during_timing(index):
        if where == "tuning" and not sent and Net._tuning_fails(None, index):
            sent.append(1)
            os.kill(os.getpid(), signum)
        return False

    callback = CALLBACKS[name]()
    trainer = make_trainer({root!r}, [callback])
    model = Signalling()
    model.dataset.fail_when = during_timing
    before = state_before(trainer, model)
    outcome = "returned"
    try:
        trainer.fit(model)
    except SIGTERMException:
        outcome = "SIGTERMException"
    except SystemExit as exit:
        outcome = f"SystemExit({{exit.code}})"
    assert_as_before(trainer, model, before)
    import gc
    assert gc.get_freeze_count() == 0  # the trials set the objects alive aside from the collector, and back
    trained = trainer.global_step
    again = make_trainer({root!r} + "/again", [callback])
    again.fit(fresh_model())
    print(json.dumps(dict(outcome=outcome, trained=trained, again=again.global_step)))
    """
)


@pytest.mark.parametrize(
    "name,signame,where",
    [
        ("BatchSizeSearch", "SIGTERM", "trials"),
        ("DataLoaderTuner", "SIGTERM", "tuning"),
        ("GpuOpt-max-throughput", "SIGTERM", "tuning"),
        ("MemoryFill", "SIGINT", "trials"),
        ("DataLoaderTuner", "SIGINT", "tuning"),
    ],
)
def test_a_signal_during_our_work_restores_everything_and_ends_fit_as_lightning_does(tmp_path, name, signame, where):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=[str(Path(__file__).parent), str(TESTS)], root=str(tmp_path)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, str(script), name, signame, where], capture_output=True, text=True, env=env, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    # SIGTERM: fit stops with Lightning's SIGTERMException before training; Ctrl+C: Lightning's exit(1)
    expected = "SIGTERMException" if signame == "SIGTERM" else "SystemExit(1)"
    assert result == dict(outcome=expected, trained=0, again=3)


# ---------------------------------------------------------------------- the undo stack itself


def test_undos_run_last_change_first_and_one_that_fails_skips_none():
    from lightning_gpuopt.callbacks._engine.undo import Undo

    undone: list[str] = []

    def failing() -> None:
        undone.append("b")
        raise OSError("cannot put b back")

    changes = Undo()
    changes.add("a", lambda: undone.append("a"))
    changes.add("b", failing)
    changes.add("kept", lambda: undone.append("kept"), lasting=True)
    changes.add("c", lambda: undone.append("c"))
    with pytest.raises(RuntimeError, match="could not undo the change of b at teardown: OSError"):
        changes.after_success("Test")  # a fit that ended well: the lasting change stays
    assert undone == ["c", "b", "a"]
    assert len(changes) == 0

    undone.clear()
    changes.add("kept", lambda: undone.append("kept"), lasting=True)
    changes.add("b", failing)
    changes.add("SIGINT", lambda: undone.append("SIGINT"), last=True)
    with pytest.warns(UserWarning, match="Test: could not undo the change of b after the failed fit"):
        changes.after_failure("Test")  # a failed fit: everything
    assert undone == ["b", "kept", "SIGINT"]


# ---------------------------------------------------------------------- torch.compile stays compiled


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles and the calls of them."""

    def __init__(self) -> None:
        self.graphs = self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


class CompiledNet(Net):
    """``Net`` whose blocks are compiled in ``__init__`` (``self.blocks = torch.compile(...)``) or in
    ``configure_model`` (``Module.compile``)."""

    def __init__(self, where: str, backend: CountingBackend, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where, self.backend = where, backend
        if where == "__init__":
            self.blocks = torch.compile(self.blocks, backend=backend)

    def configure_model(self) -> None:
        if self.where == "configure_model":
            self.blocks.compile(backend=self.backend)


def compiled_fit(tmp_path: Path, callbacks: list, where: str, settings: Optional[Settings] = None) -> tuple:
    """(graphs compiled, compiled calls, training steps, weights) of a fit from a fresh dynamo."""
    torch._dynamo.reset()
    backend, settings = CountingBackend(), settings or Settings()
    seed_everything(0)
    model = CompiledNet(where, backend, batch_size=settings.batch_size, loader_kwargs=settings.loader_kwargs)
    if settings.checkpointed:
        enable_checkpointing(select_blocks(model, settings.checkpointed))
    trainer = make_trainer(
        tmp_path, callbacks, accumulate_grad_batches=settings.accumulate_grad_batches, precision=settings.precision
    )
    trainer.fit(model)
    return backend.graphs, backend.calls, trainer.global_step, model.state_dict()


COMPILED = {
    "MemoryEstimator": (lambda: MemoryEstimator(max_memory=MAX_MEMORY, verbose=False), "__init__"),
    "BatchSizeSearch": (CALLBACKS["BatchSizeSearch"], "__init__"),
    "MemoryFill": (
        lambda: MemoryFill(
            global_batch_size=32, max_memory=MAX_MEMORY, precision="bf16-mixed", min_micro_batch_size=8, verbose=False
        ),
        "__init__",
    ),
    "DataLoaderTuner": (lambda: DataLoaderTuner(max_seconds=0.2, batches_per_candidate=2, verbose=False), "__init__"),
    "DataWaitMonitor": (lambda: DataWaitMonitor(verbose=False), "configure_model"),
    "GpuOpt-diagnose": (CALLBACKS["GpuOpt-diagnose"], "configure_model"),
    "GpuOpt-fill-memory": (CALLBACKS["GpuOpt-fill-memory"], "__init__"),
    "GpuOpt-low-memory": (
        lambda: GpuOpt(
            "low-memory",
            global_batch_size=32,
            max_memory=MAX_MEMORY,
            precision="bf16-mixed",
            activation_checkpointing=False,
        ),
        "__init__",
    ),
    "GpuOpt-max-throughput": (CALLBACKS["GpuOpt-max-throughput"], "__init__"),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_a_compiled_module_trains_compiled_every_step_as_by_hand(tmp_path, name):
    """Compiled in ``__init__`` or in ``configure_model``: the same graphs, compiled calls and weights as the
    chosen settings by hand (our traces and trials run it eager and leave dynamo's caches alone). Without
    activation checkpointing: blocks checkpointed inside a compiled module compile no graph, by hand too."""
    make, where = COMPILED[name]
    callback = make()
    graphs, calls, steps, weights = compiled_fit(tmp_path / "run", [callback], where)
    settings = chosen(callback) if not isinstance(callback, (MemoryEstimator, DataWaitMonitor)) else Settings()
    hand = compiled_fit(tmp_path / "by_hand", [], where, settings)
    assert (graphs, steps) == (hand[0], hand[2]) and graphs >= 1 and calls >= steps == 3
    # the loader tuner times each candidate with the (compiled) training step running, state put back
    tuned = "DataLoaderTuner" in name or "max-throughput" in name
    assert calls > hand[1] if tuned else calls == hand[1]
    assert all(torch.equal(weights[key], hand[3][key]) for key in hand[3])
