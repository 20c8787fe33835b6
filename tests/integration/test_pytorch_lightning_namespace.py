"""The callbacks under both Lightning namespaces: ``lightning.pytorch`` and ``pytorch_lightning``.

``lightning_gpuopt`` is built on ``lightning.pytorch``; ``lightning_gpuopt.pytorch_lightning``'s classes add
``pytorch_lightning``'s ``Callback`` (and ``LightningCLI``) as a base, with one source for both. Each test runs a real Trainer
of one namespace; the figures are checked by training (a found batch trains under the same cap, the
first size that missed runs out of memory) and against the other namespace's run of the same model.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import lightning.pytorch
import pytest
import pytorch_lightning
import pytorch_lightning.cli
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gpuopt
import lightning_gpuopt.pytorch_lightning as gpuopt_pl
from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error

NAMESPACES = {
    "lightning.pytorch": (lightning.pytorch, lightning_gpuopt),
    "pytorch_lightning": (pytorch_lightning, gpuopt_pl),
}
CALLBACKS = ["BatchSizeSearch", "DataLoaderTuner", "DataWaitMonitor", "GpuOpt", "MemoryEstimator", "MemoryFill"]


def module_class(pl: ModuleType) -> type:
    class Regressor(pl.LightningModule):
        def __init__(self, batch_size: int = 16, samples: int = 1024) -> None:
            super().__init__()
            self.batch_size = batch_size
            self.samples = samples
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(1)
            data = TensorDataset(
                torch.randn(self.samples, 64, generator=generator), torch.randn(self.samples, 1, generator=generator)
            )
            return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    return Regressor


def trainer(pl: ModuleType, tmp_path: Any, callbacks: list, **kwargs: Any) -> Any:
    settings = dict(
        default_root_dir=tmp_path,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    settings.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **settings)


@pytest.mark.parametrize("callback_name", CALLBACKS)
@pytest.mark.parametrize(
    ("trainer_namespace", "callback_namespace"),
    [("pytorch_lightning", "lightning.pytorch"), ("lightning.pytorch", "pytorch_lightning")],
)
def test_a_callback_refuses_the_other_namespaces_trainer_and_names_the_import(
    tmp_path, callback_name, trainer_namespace, callback_namespace
):
    pl, _ = NAMESPACES[trainer_namespace]
    _, package = NAMESPACES[callback_namespace]
    callback = (
        getattr(package, callback_name)("diagnose") if callback_name == "GpuOpt" else getattr(package, callback_name)()
    )
    model = module_class(pl)()
    with pytest.raises(TypeError) as raised:
        trainer(pl, tmp_path, [callback]).fit(model)
    fix = NAMESPACES[trainer_namespace][1].__name__
    assert f"from {fix} import {callback_name}" in str(raised.value)
    assert model.net[0].weight.grad is None  # refused before any step


def test_the_pytorch_lightning_classes_share_the_source_and_core_results_and_subclass_its_callback():
    assert issubclass(gpuopt_pl.GpuOpt, pytorch_lightning.Callback) and issubclass(
        gpuopt_pl.GpuOpt, lightning_gpuopt.GpuOpt
    )
    assert issubclass(gpuopt_pl.GpuOptCLI, pytorch_lightning.cli.LightningCLI)
    assert gpuopt_pl.BatchSizeSearchResult is lightning_gpuopt.BatchSizeSearchResult
    assert gpuopt_pl.MemoryBudget is lightning_gpuopt.MemoryBudget


def _search(namespace: str, tmp_path: Any, cap: str) -> Any:
    pl, package = NAMESPACES[namespace]
    search = package.BatchSizeSearch(max_memory=cap, margin=0.0, verbose=False)
    torch.manual_seed(0)
    trainer(pl, tmp_path / namespace, [search], max_steps=1).fit(module_class(pl)())
    return search.result


def _trains_an_epoch(pl: ModuleType, tmp_path: Any, batch_size: int, cap: str) -> bool:
    """Two whole shuffled epochs at ``batch_size`` with a MemoryBudget of ``cap`` held from train start
    (the model and the optimizer counted, as the search counts them)."""

    class BudgetAroundTraining(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.budget = MemoryBudget(cap, existing=(pl_module, *trainer.optimizers), device="cpu")
            self.budget.__enter__()

        def _leave(self) -> None:
            budget, self.budget = getattr(self, "budget", None), None
            if budget is not None:
                budget.__exit__(None, None, None)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._leave()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._leave()  # Lightning calls no callback's teardown after an exception

    model = module_class(pl)(batch_size=batch_size)
    try:
        trainer(pl, tmp_path, [BudgetAroundTraining()], max_steps=-1, max_epochs=2).fit(model)
    except Exception as error:
        if is_out_of_memory_error(error):
            return False
        raise
    return True


def test_batch_size_search_under_pytorch_lightning_finds_a_batch_that_trains_and_agrees_with_lightning(tmp_path):
    cap = "4MB"
    found = _search("pytorch_lightning", tmp_path, cap)
    assert 16 < found.batch_size < 1024  # the cap binds: not the whole dataset (the bug found 2048 of 2048)
    assert found.batch_size == _search("lightning.pytorch", tmp_path, cap).batch_size
    assert _trains_an_epoch(pytorch_lightning, tmp_path / "fits", found.batch_size, cap)
    missed = min(trial.batch_size for trial in found.trials if not trial.fits)
    assert not _trains_an_epoch(pytorch_lightning, tmp_path / "misses", missed, cap)


def test_memory_fill_amp_under_pytorch_lightning_plans_as_under_lightning(tmp_path):
    plans = {}
    for namespace, (pl, package) in NAMESPACES.items():
        fill = package.MemoryFill(max_memory="4MB", precision="bf16-mixed", global_batch_size=512, verbose=False)
        torch.manual_seed(0)
        run = trainer(pl, tmp_path / namespace, [fill], max_steps=2)
        run.fit(module_class(pl)())
        plans[namespace] = fill.plan
    plan = plans["pytorch_lightning"]
    assert plan.precision == "bf16-mixed"
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 512
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (
        plans["lightning.pytorch"].micro_batch_size,
        plans["lightning.pytorch"].accumulate_grad_batches,
    )


def test_data_wait_monitor_and_estimator_under_pytorch_lightning_measure_every_step(tmp_path):
    monitor = gpuopt_pl.DataWaitMonitor(warmup_steps=1, verbose=False)
    estimator = gpuopt_pl.MemoryEstimator(verbose=False)
    trainer(pytorch_lightning, tmp_path, [monitor, estimator], max_steps=6).fit(module_class(pytorch_lightning)())
    assert monitor.report.totals.steps == 5
    assert monitor.report.totals.compute_s > 0
    assert estimator.estimate.method == "traced"
    assert estimator.estimate.measured_peak_bytes > 0


def test_gpuopt_cli_under_pytorch_lightning_takes_the_flag(tmp_path):
    model_class = module_class(pytorch_lightning)
    cli = gpuopt_pl.GpuOptCLI(
        model_class,
        args=[
            "fit",
            "--gpuopt",
            "diagnose",
            "--trainer.max_steps=8",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ],
        save_config_kwargs={"overwrite": True},
    )
    parts = [callback for callback in cli.trainer.callbacks if isinstance(callback, gpuopt_pl.GpuOpt)]
    assert len(parts) == 1
    assert isinstance(cli.trainer, pytorch_lightning.Trainer)
    assert parts[0].monitor.report is not None
