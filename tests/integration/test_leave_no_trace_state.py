"""No measurement touches the user's state (issue 25): the estimate's trace and every trial leave the
schedulers, the optimizers (state and param groups' ``lr``), the module's buffers (BatchNorm), a
torchmetrics metric, the RNG and the loggers as a run by hand has them, for every callback and preset,
under automatic optimization (one optimizer, two schedulers) and manual optimization (two optimizers, a
scheduler each, one ``lr`` a tensor that schedulers fill in place). One fit per callback and mode, and
one by hand per choice, shared by the checks of each kind of state.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
import torchmetrics
from lightning import Callback, LightningModule, Trainer, seed_everything
from test_leave_no_trace import CALLBACKS, MAX_MEMORY, Noisy, Settings, chosen, make_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_gpuopt import DataWaitMonitor, MemoryEstimator, MemoryFill

FEATURES, CLASSES = 8, 4


class Stateful(LightningModule):
    """Every kind of state a measurement could touch, drawn on and logged at each step."""

    def __init__(self, manual: bool = False, batch_size: int = 16, loader_kwargs: Optional[dict] = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["loader_kwargs"])
        self.automatic_optimization = not manual
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, CLASSES)
        self.mean_loss = torchmetrics.MeanMetric()
        self.loader_kwargs, self.dataset = loader_kwargs or {}, Noisy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = F.cross_entropy(self(x), y) + float(np.random.rand()) * 0 + random.random() * 0
        self.mean_loss.update(loss.detach())
        self.log("mean_loss", self.mean_loss.compute())
        if self.logger is not None:  # straight to the logger, as users write to a tracker
            self.logger.log_metrics({"direct_loss": float(loss)}, step=self.global_step)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        return None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=True, **self.loader_kwargs)

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            every_step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return [optimizer], [
                torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9),
                {"scheduler": every_step, "interval": "step"},
            ]
        first = torch.optim.Adam(self.body.parameters(), lr=1e-2)
        second = torch.optim.SGD(self.head.parameters(), lr=torch.tensor(0.1), momentum=0.9)
        schedules = [
            torch.optim.lr_scheduler.ExponentialLR(first, 0.9),
            torch.optim.lr_scheduler.StepLR(second, 1, 0.8),
        ]
        return [first, second], schedules


class LearningRates(Callback):
    """Every param group's ``lr`` after each training batch."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append(tuple(float(g["lr"]) for o in trainer.optimizers for g in o.param_groups))


def state_of(trainer: Trainer, model: Stateful, lrs: LearningRates) -> dict[str, Any]:
    """What each kind of state is after the fit."""
    return {
        "scheduler": (lrs.rows, [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]),
        "optimizer": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "buffers": dict(model.named_buffers()),
        "metric": {name: getattr(model.mean_loss, name) for name in ("mean_value", "weight", "_update_count")},
        "rng": (torch.get_rng_state(), np.random.get_state()[1], random.getstate()),
        "logger": trainer.logger.without_ours(),
        "weights": dict(model.named_parameters()),
    }


def run(tmp_path: Path, manual: bool, callbacks: list, settings: Settings) -> dict[str, Any]:
    seed_everything(0)
    model = Stateful(manual, settings.batch_size, settings.loader_kwargs)
    lrs = LearningRates()
    trainer = make_trainer(
        tmp_path,
        [*callbacks, lrs],
        max_steps=6 if manual else 3,
        precision=settings.precision,
        accumulate_grad_batches=settings.accumulate_grad_batches,
    )
    trainer.fit(model)
    return state_of(trainer, model, lrs)


STATE_CALLBACKS: dict[str, Callable[[], Callback]] = {
    "MemoryEstimator": lambda: MemoryEstimator(max_memory=MAX_MEMORY, verbose=False),
    "DataWaitMonitor": lambda: DataWaitMonitor(verbose=False),
    **{name: make for name, make in CALLBACKS.items() if name != "MemoryFill"},  # it checkpoints: no blocks here
    "MemoryFill": lambda: MemoryFill(
        global_batch_size=32,
        max_memory=MAX_MEMORY,
        precision="bf16-mixed",
        min_micro_batch_size=8,
        objective="memory",
        verbose=False,
    ),
}
_RUNS: dict[tuple, tuple[dict, dict]] = {}


def runs(tmp_path_factory: Any, manual: bool, name: str) -> tuple[dict, dict]:
    """(with the callback, by hand with its choice), each fitted once per session."""
    if (manual, name) not in _RUNS:
        callback = STATE_CALLBACKS[name]()
        ours = run(tmp_path_factory.mktemp("run"), manual, [callback], Settings())
        settings = Settings() if isinstance(callback, (MemoryEstimator, DataWaitMonitor)) else chosen(callback)
        key = (manual, settings.batch_size, settings.accumulate_grad_batches, settings.precision)
        key += tuple(sorted(settings.loader_kwargs.items()))
        if key not in _RUNS:
            _RUNS[key] = run(tmp_path_factory.mktemp("by_hand"), manual, [], settings)
        _RUNS[(manual, name)] = ours, _RUNS[key]
    return _RUNS[(manual, name)]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["scheduler", "optimizer", "buffers", "metric", "rng", "logger", "weights"])
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("name", list(STATE_CALLBACKS))
def test_no_measurement_touches_the_users_state(tmp_path_factory, name, manual, kind):
    ours, by_hand = runs(tmp_path_factory, manual, name)
    assert same(ours[kind], by_hand[kind]), (ours[kind], by_hand[kind])
