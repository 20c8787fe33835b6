"""A run with our callbacks equals the chosen settings written by hand, bit for bit, when the user's code
draws from the global RNG where users' code does: ``setup()`` splits the data with ``random_split`` and no
generator, ``train_dataloader()`` makes synthetic data with ``torch.randn``, dropout in the step, a
validation loader, and a OneCycleLR schedule sized by ``trainer.estimated_stepping_batches`` (Lightning then
builds the train loader inside ``configure_optimizers``). The user's hooks run as few times as they must:
``train_dataloader()`` at most twice per fit, ``configure_optimizers()`` again only when the batch or the
accumulation changed.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Callable

import numpy as np
import pytest
import torch
from helpers import quiet_trainer
from lightning import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, GpuOpt, MemoryFill
from lightning_gpuopt.core.checkpointing import enable_checkpointing, select_blocks

#: calls of the user's hooks, kept outside the module (our trials put the module's attributes back)
CALLS: Counter = Counter()
SAMPLES, FEATURES, CLASSES = 80, 8, 3  # 64 train samples: accumulation groups of 8 x 4 end with the epoch
MAX_MEMORY = "64MB"


class Drawing(LightningModule):
    def __init__(self, batch_size: int = 8, schedule: bool = True, workers: int = 0, lr_times: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, CLASSES))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2)])
        self.subset: Any = None

    def setup(self, stage: str) -> None:
        self.subset = random_split(range(SAMPLES), [SAMPLES - 16, 16])[0]  # the global RNG, no generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body[1](self.body[0](x))
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.body[3](self.body[2](hidden))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def train_dataloader(self) -> DataLoader:
        CALLS["train_dataloader"] += 1
        x, y = torch.randn(SAMPLES, FEATURES), torch.randint(0, CLASSES, (SAMPLES,))  # synthetic data
        data = TensorDataset(x[list(self.subset)], y[list(self.subset)])
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, FEATURES), torch.randint(0, CLASSES, (16,))), batch_size=8)

    def configure_optimizers(self) -> Any:
        CALLS["configure_optimizers"] += 1
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05 * self.hparams.lr_times, momentum=0.9)
        if not self.hparams.schedule:
            return optimizer
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1 * self.hparams.lr_times, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Rows(Callback):
    """What training logged at each batch, and the learning rate each optimizer step used."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.rows.append((trainer.global_step, float(outputs["loss"]), lr, len(batch[0])))


def fit(tmp_path: Any, callbacks: list, checkpointed: tuple = (), **kwargs: Any) -> tuple[Drawing, Rows, tuple]:
    seed_everything(0)
    model = Drawing(**kwargs.pop("model", {}))
    if checkpointed:
        enable_checkpointing(select_blocks(model, list(checkpointed)))
    rows = Rows()
    trainer = quiet_trainer(tmp_path, [*callbacks, rows], max_epochs=2, limit_val_batches=1, **kwargs)
    CALLS.clear()
    trainer.fit(model)
    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    return model, rows, rng


def settings_of(callback: Callback) -> dict:
    if isinstance(callback, GpuOpt):
        found = settings_of(callback.fill) if callback.fill is not None else {}
        if callback.tuner is not None and callback.tuner.result is not None:
            found["loader"] = callback.tuner.result.setting.loader_kwargs()
        return found
    if isinstance(callback, MemoryFill):
        plan = callback.plan
        return dict(
            lr_times=plan.lr_change[1] / plan.lr_change[0] if plan.lr_change else 1.0,
            batch_size=plan.micro_batch_size,
            accumulate=plan.accumulate_grad_batches,
            precision=plan.precision,
            checkpointed=plan.checkpointed_modules,
        )
    if isinstance(callback, BatchSizeSearch):
        return dict(batch_size=callback.result.batch_size)
    return dict(loader=callback.result.setting.loader_kwargs())


def by_hand(tmp_path: Any, settings: dict, schedule: bool) -> tuple[Drawing, Rows, tuple, Counter]:
    workers = settings.get("loader", {}).get("num_workers", 0)
    model_kwargs = dict(batch_size=settings.get("batch_size", 8), schedule=schedule, workers=workers)
    model_kwargs["lr_times"] = settings.get("lr_times", 1.0)  # the learning rate scaled by hand
    kwargs = dict(accumulate_grad_batches=settings.get("accumulate", 1), precision=settings.get("precision", "32-true"))
    model, rows, rng = fit(tmp_path / "by_hand", [], settings.get("checkpointed", ()), model=model_kwargs, **kwargs)
    return model, rows, rng, Counter(CALLS)


CALLBACKS: dict[str, Callable[[], Callback]] = {
    "BatchSizeSearch": lambda: BatchSizeSearch(max_memory=MAX_MEMORY, max_batch_size=32, verbose=False),
    "BatchSizeSearch-cap": lambda: BatchSizeSearch(max_memory=MAX_MEMORY, mode="cap", verbose=False),
    "MemoryFill": lambda: MemoryFill(
        global_batch_size=32, max_memory=MAX_MEMORY, min_micro_batch_size=8, verbose=False
    ),
    "MemoryFill-scale_lr": lambda: MemoryFill(
        global_batch_size=32, max_memory=MAX_MEMORY, min_micro_batch_size=8, scale_lr="linear", verbose=False
    ),
    "DataLoaderTuner": lambda: DataLoaderTuner(
        max_seconds=0.3, batches_per_candidate=2, max_num_workers=0, verbose=False
    ),
    "GpuOpt-diagnose": lambda: GpuOpt("diagnose"),
    "GpuOpt-fill-memory": lambda: GpuOpt("fill-memory", global_batch_size=32, max_memory=MAX_MEMORY),
    "GpuOpt-low-memory": lambda: GpuOpt(
        "low-memory", global_batch_size=32, max_memory=MAX_MEMORY, precision="bf16-mixed"
    ),
}


@pytest.mark.parametrize("schedule", [True, False], ids=["onecycle-by-estimated-steps", "no-schedule"])
@pytest.mark.parametrize("name", list(CALLBACKS))
def test_a_run_with_the_callback_equals_its_choice_by_hand_when_the_users_code_draws_from_the_rng(
    tmp_path, name: str, schedule: bool
) -> None:
    callback = CALLBACKS[name]()
    model, rows, rng = fit(tmp_path / "run", [callback], model=dict(schedule=schedule))
    calls = Counter(CALLS)
    settings = settings_of(callback)
    assert settings.get("lr_times", 1.0) == (4.0 if name == "MemoryFill-scale_lr" else 1.0)  # 8 -> 32: linear
    hand_model, hand_rows, hand_rng, hand_calls = by_hand(tmp_path, settings, schedule)
    assert rows.rows == hand_rows.rows and len(rows.rows) >= 4  # losses, learning rates and batch sizes
    for (key, ours), theirs in zip(model.state_dict().items(), hand_model.state_dict().values()):
        assert torch.equal(ours, theirs), key
    if name == "MemoryFill-scale_lr":  # put back at teardown: the schedule's learning rate, divided by 4
        last = [m.trainer.optimizers[0].param_groups[0]["lr"] for m in (model, hand_model)]
        assert last[0] == pytest.approx(last[1] / 4, rel=1e-12) and last[0] != last[1]
    assert torch.equal(rng[0], hand_rng[0]) and np.array_equal(rng[1], hand_rng[1]) and rng[2] == hand_rng[2]
    assert hand_calls["train_dataloader"] == 1 and calls["train_dataloader"] <= 2, calls
    changed = settings.get("batch_size", 8) != 8 or settings.get("accumulate", 1) != 1
    assert calls["configure_optimizers"] == 1 + changed, (calls, settings)


def test_a_schedule_sized_by_estimated_stepping_batches_anneals_over_the_steps_training_takes(tmp_path) -> None:
    search = BatchSizeSearch(max_memory=MAX_MEMORY, max_batch_size=32, verbose=False)
    _, rows, _ = fit(tmp_path, [search], model=dict(schedule=True))
    steps = {row[0] for row in rows.rows}
    assert search.result.batch_size == 32 and len(steps) == 2 * -(-(SAMPLES - 16) // 32)
    assert rows.rows[-2][2] < 1e-6  # annealed to the end of OneCycleLR at the last step: not cut short


def test_a_loader_that_hard_codes_the_batch_is_refused_before_training(tmp_path) -> None:
    class HardCoded(Drawing):
        def train_dataloader(self) -> DataLoader:
            loader = super().train_dataloader()
            return DataLoader(loader.dataset, batch_size=8, shuffle=True)  # ignores self.hparams.batch_size

    seed_everything(0)
    trainer = quiet_trainer(
        tmp_path, [BatchSizeSearch(max_memory=MAX_MEMORY, max_batch_size=32, verbose=False)], max_epochs=1
    )
    with pytest.raises(Exception, match=r"batches of \[8\] samples: HardCoded.train_dataloader\(\) does not build"):
        trainer.fit(HardCoded(schedule=False))
    assert trainer.global_step == 0
