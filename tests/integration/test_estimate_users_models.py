"""Users' model shapes (tests/models_users.py) through the estimate: a right answer or a clear refusal.

Truth is independent of the estimate: the torch profiler's allocator events on the host
(:func:`helpers.profiler_peak_bytes`) for a step sequence written by hand, and real training under
a :class:`~lightning_gpuopt.core.memory.MemoryBudget` at the reported batch size and above it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import lightning as L
import pytest
import torch
from helpers import TESTS, profiler_peak_bytes
from models_users import DataloaderIterModule, DictBatchModule, DictDataModule, GanModule, ResNetModule
from torch.nn import functional as F

from lightning_gpuopt import GpuOpt, MemoryEstimator, cli
from lightning_gpuopt.callbacks.memory_estimator import render_estimate
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep
from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error
from lightning_gpuopt.core.op_memory import storage_bytes

#: the predicted peak against the profiler's allocator peak
ALLOCATOR_TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Trainers without a logger write the report into the working directory: keep it out of the repo."""
    monkeypatch.chdir(tmp_path)


def trainer_for(callbacks: list, **kwargs: Any) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


def resnet_group_peak(micro_batch: int, accumulate: int, width: int = 32, size: int = 8) -> tuple[int, Any]:
    """The profiler's peak of one accumulation group of the ResNet written by hand (Lightning's order:
    forward, zero_grad on a group's first micro-batch, backward; clip and step after the last), in
    the steady state (after two groups); returns ``(peak, (model, optimizer, batch, loss_fn))``."""
    torch.manual_seed(0)
    model = ResNetModule(width=width, size=size, num_samples=micro_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    batch = (model.images[:micro_batch], model.labels[:micro_batch])

    def loss_fn(data: Any) -> torch.Tensor:
        return F.cross_entropy(model(data[0]), data[1])

    def group() -> None:
        for index in range(accumulate):
            loss = loss_fn(batch) / accumulate
            if index == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    group(), group()
    return profiler_peak_bytes(group, existing=(model, optimizer, batch)), (model, optimizer, batch, loss_fn)


# --------------------------------------------------------------------------- 12.5: accumulation


@pytest.mark.parametrize("accumulate", [1, 4])
def test_an_accumulating_step_is_traced_as_it_runs_and_matches_the_profiler(accumulate):
    # a ResNet with many parameters for its activations: its peak is at the optimizer step, where
    # the gradients already live; adding a set of gradients on top overshot by 18%
    truth, (model, optimizer, batch, loss_fn) = resnet_group_peak(16, accumulate)
    step = TrainingStep(
        model, batch, loss_fn, optimizers=[optimizer], batch_size=16, accumulate_grad_batches=accumulate
    )
    estimate = StepEstimator(step).estimate()
    assert estimate.method == "traced" and estimate.accumulate_grad_batches == accumulate
    error = (estimate.predicted_peak_bytes - truth) / truth
    assert abs(error) <= ALLOCATOR_TOLERANCE, (estimate.predicted_peak_bytes, truth)
    assert estimate.untraced_bytes == 0  # nothing added outside the trace (and so to the measurement)
    assert any("accumulating 4 micro-batches" in note for note in estimate.notes) == (accumulate > 1)


class PeakUnderBudget(L.Callback):
    """The independent measurement: a MemoryBudget from train start to train end, its peak kept."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.budget: Optional[MemoryBudget] = None
        self.peak_bytes: Optional[int] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.budget = MemoryBudget(self.cap_bytes, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def _leave(self) -> None:
        if self.budget is not None:
            budget, self.budget = self.budget, None
            self.peak_bytes = budget.peak_bytes
            budget.__exit__(None, None, None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._leave()


def test_gpuopt_report_under_accumulation_agrees_with_the_plan_and_the_real_peak():
    # fill-memory plans micro-batches with accumulation under 12 MB (80 samples do not fit at once); the combined report used to
    # show the estimator's figures with the gradients counted twice: a largest batch of 18 next to
    # a plan whose trials fitted 25 (a budget 10% below the estimator's capacity)
    # on_oom="raise": OOM recovery holds a micro-batch's new gradients apart from the accumulated ones
    # until its backward ends (one gradient-sized buffer more), which the estimate does not model
    gpuopt = GpuOpt(
        "fill-memory", max_memory="12MB", global_batch_size=80, monitor=False, tune_loader=False, on_oom="raise"
    )
    model = ResNetModule(width=32, size=8, num_samples=160, batch_size=8)
    trainer_for([gpuopt], gradient_clip_val=1.0).fit(model)
    plan, memory = gpuopt.report.memory_fill, gpuopt.report.memory
    assert plan.accumulate_grad_batches > 1 and memory.accumulate_grad_batches == plan.accumulate_grad_batches
    assert memory.batch_size == plan.micro_batch_size
    # the estimate's largest batch and the trials' agree within the estimate's error (gradients counted twice: 18 vs 25)
    assert abs(memory.max_batch_size - plan.largest_fit) <= 0.1 * plan.largest_fit
    assert memory.predicted_peak_bytes <= memory.capacity_bytes
    # the reported peak against the profiler's peak of the same step written by hand
    truth, _ = resnet_group_peak(plan.micro_batch_size, plan.accumulate_grad_batches)
    assert abs(memory.predicted_peak_bytes - truth) / truth <= ALLOCATOR_TOLERANCE
    assert abs(memory.measured_peak_bytes - truth) / truth <= ALLOCATOR_TOLERANCE


# --------------------------------------------------------------------------- 12.7: gpuopt estimate

USERS_MODELS = str(TESTS / "models_users.py")


def cli_estimate(capsys, *args: str) -> dict:
    status = cli.main(["estimate", *args, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out)


def fits_under(cap_bytes: int, model: L.LightningModule, datamodule: Any = None, **trainer_kwargs: Any) -> bool:
    """Do three real training steps fit ``cap_bytes`` (a MemoryBudget from train start)?"""
    try:
        trainer_for([PeakUnderBudget(cap_bytes)], max_steps=3, **trainer_kwargs).fit(model, datamodule=datamodule)
    except Exception as error:
        if is_out_of_memory_error(error):
            return False
        raise
    return True


def test_estimate_builds_configure_optimizers_with_a_trainer_and_its_largest_batch_trains(capsys):
    # configure_optimizers() reads self.trainer.estimated_stepping_batches (OneCycleLR): the command
    # fell back to Adam, whose state is twice SGD-with-momentum's, and reported a smaller largest batch
    estimate = cli_estimate(
        capsys,
        f"{USERS_MODELS}:ResNetModule",
        "--init-args",
        '{"width": 32, "size": 8}',
        "--batch-size",
        "16",
        "--max-memory",
        "12MB",
    )
    assert estimate["setup"]["optimizer"] == "SGD (configure_optimizers())"
    assert estimate["optimizer_bytes"] == estimate["params_bytes"]  # the momentum buffers
    largest = estimate["max_batch_size"]
    model = ResNetModule(width=32, size=8, num_samples=4 * largest, batch_size=largest)
    assert fits_under(12_000_000, model, gradient_clip_val=1.0)  # the reported batch trains in that memory


def test_estimate_takes_a_datamodule_with_dict_batches_and_its_largest_batch_is_the_real_one(capsys):
    estimate = cli_estimate(
        capsys,
        f"{USERS_MODELS}:DictBatchModule",
        "--datamodule",
        f"{USERS_MODELS}:DictDataModule",
        "--datamodule-init-args",
        '{"batch_size": 16}',
        "--max-memory",
        "30MB",
    )
    setup = estimate["setup"]
    assert setup["batch_source"] == "the datamodule's train_dataloader()" and setup["batch_size"] == 16
    assert setup["datamodule"] == "models_users.DictDataModule" and setup["optimizer"].startswith("AdamW")
    assert estimate["method"] == "traced" and estimate["optimizer_bytes"] >= 2 * estimate["params_bytes"]
    largest = estimate["max_batch_size"]
    # the independent truth: real training in that memory at the reported batch, and one more
    assert fits_under(30_000_000, DictBatchModule(), DictDataModule(num_samples=3 * largest, batch_size=largest))
    assert not fits_under(
        30_000_000, DictBatchModule(), DictDataModule(num_samples=3 * largest, batch_size=largest + 1)
    )


def test_estimate_batch_size_sets_the_datamodules_and_bad_datamodule_arguments_are_named(capsys):
    estimate = cli_estimate(
        capsys,
        f"{USERS_MODELS}:DictBatchModule",
        "--datamodule",
        f"{USERS_MODELS}:DictDataModule",
        "--batch-size",
        "24",
        "--max-memory",
        "30MB",
    )
    assert estimate["batch_size"] == 24 and estimate["batch_bytes"] == 24 * (256 * 4 + 8)
    status = cli.main(
        ["estimate", f"{USERS_MODELS}:DictBatchModule", "--datamodule", f"{USERS_MODELS}:DictBatchModule"]
    )
    err = capsys.readouterr().err
    assert status == 2 and "`--datamodule`=" in err and "not a lightning.pytorch.LightningDataModule class" in err
    assert "DictDataModule" in err  # the classes that would work
    with_datamodule = ["estimate", f"{USERS_MODELS}:DictBatchModule", "--datamodule", f"{USERS_MODELS}:DictDataModule"]
    status = cli.main([*with_datamodule, "--datamodule-init-args", '{"batch": 3}'])
    err = capsys.readouterr().err
    assert status == 2 and "`--datamodule-init-args`" in err and "DictDataModule(" in err
    # YAML text, type-checked against the datamodule's signature
    status = cli.main([*with_datamodule, "--datamodule-init-args", "batch_size: many"])
    err = capsys.readouterr().err
    assert status == 2 and "`--datamodule-init-args`='batch_size: many': Parser key \"data.batch_size\"" in err
    assert "DictDataModule(features: int = 256, num_samples: int = 512, batch_size: int = 16)" in err
    status = cli.main(["estimate", f"{USERS_MODELS}:DictBatchModule"])
    err = capsys.readouterr().err
    assert status == 2 and "gives no batch" in err and "--datamodule" in err


class ResNetWithBrokenOptimizers(ResNetModule):
    def configure_optimizers(self) -> Any:
        raise ValueError("no such schedule")


def test_estimate_refuses_when_configure_optimizers_raises_instead_of_guessing_adam(capsys, monkeypatch):
    import models_users

    monkeypatch.setattr(models_users, "ResNetWithBrokenOptimizers", ResNetWithBrokenOptimizers, raising=False)
    status = cli.main(["estimate", "models_users:ResNetWithBrokenOptimizers", "--batch-size", "4"])
    err = capsys.readouterr().err
    assert status == 2 and "configure_optimizers() of ResNetWithBrokenOptimizers raised ValueError" in err
    assert "--optimizer adam|adamw|sgd|none" in err


# --------------------------------------------------------------------------- 12.8: manual optimization


def test_manual_optimization_is_traced_with_every_optimizers_state_and_leaves_no_trace(recwarn):
    estimator = MemoryEstimator(max_memory="100MB", verbose=False)
    torch.manual_seed(0)
    with_estimator = GanModule()
    trainer = trainer_for([estimator], max_steps=3)
    trainer.fit(with_estimator)
    estimate = estimator.estimate
    assert estimate.method == "traced" and estimate.not_traced_reason is None
    # both Adam optimizers' state (exp_avg, exp_avg_sq, step), as the real optimizers hold it after training
    assert estimate.optimizer_bytes == storage_bytes(*trainer.optimizers) > 2 * estimate.params_bytes
    assert not [w for w in recwarn if "MemoryEstimator" in str(w.message)]  # nothing to warn about
    # the predicted peak against real training without the estimator (a MemoryBudget from train start)
    torch.manual_seed(0)
    without = GanModule()
    peak = PeakUnderBudget(10**9)
    plain = trainer_for([peak], max_steps=3)
    plain.fit(without)
    assert abs(estimate.predicted_peak_bytes - peak.peak_bytes) / peak.peak_bytes <= ALLOCATOR_TOLERANCE
    # the trace stepped twins: the real run is the same, bit for bit, and counted the same steps
    assert trainer.global_step == plain.global_step == 4  # 2 batches x 2 optimizer steps
    for mine, theirs in zip(with_estimator.state_dict().values(), without.state_dict().values()):
        assert torch.equal(mine, theirs)


class AccumulatingByHand(GanModule):
    """Manual optimization with accumulation by hand: the generator's Adam steps every ``every``-th batch."""

    def __init__(self, every: int = 2) -> None:
        super().__init__()
        self.every = every

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        optimizer = self.optimizers()
        z = torch.randn(real.shape[0], self.latent, device=real.device, dtype=real.dtype)
        self.manual_backward(F.mse_loss(self.generator(z), real) / self.every)
        if (batch_idx + 1) % self.every == 0:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.generator.parameters(), lr=2e-4)]


@pytest.mark.parametrize("every", [2, 5])
def test_accumulation_by_hand_is_traced_until_the_optimizer_steps_or_given_no_max_batch_size(every):
    estimator = MemoryEstimator(max_memory="100MB", verbose=False)
    torch.manual_seed(0)
    trainer = trainer_for([estimator], max_steps=6)
    trainer.fit(AccumulatingByHand(every))
    estimate = estimator.estimate
    if every > 4:  # no step in the batches traced: said, and no largest batch from a step without one
        assert estimate.method != "traced" and "did not step every optimizer" in estimate.not_traced_reason
        assert estimate.max_batch_size is None
        return
    assert estimate.method == "traced" and estimate.optimizer_bytes == storage_bytes(trainer.optimizers[0]) > 0
    # the window with the step (batches 0 and 1) sets the peak: measured over the first 3 batches
    assert abs(estimate.estimate_error) <= ALLOCATOR_TOLERANCE, estimate.estimate_error
    assert estimate.max_batch_size is not None


def test_a_dataloader_iter_step_falls_back_with_the_reason_not_a_type_error():
    estimator = MemoryEstimator(max_memory="100MB", verbose=False)
    with pytest.warns(UserWarning, match="training_step takes dataloader_iter"):
        trainer_for([estimator], max_steps=2).fit(DataloaderIterModule())
    estimate = estimator.estimate
    assert estimate.method != "traced" and "dataloader_iter" in estimate.not_traced_reason
    assert not any("TypeError" in note for note in estimate.notes)
    assert estimate.optimizer_bytes == estimate.params_bytes  # SGD with momentum, by rule
    assert "not traced because" in render_estimate(estimate)


class CalledInTrainingStep(L.LightningModule):
    """No ``forward``: ``training_step`` calls the model it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_without_forward_gets_its_parameters_by_child_in_one_note():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32, 32), torch.randint(0, 10, (32,))), batch_size=8
    )
    estimator = MemoryEstimator(verbose=False)
    trainer_for([estimator]).fit(CalledInTrainingStep(), loader)
    assert "no torchinfo summary (it has no `forward`); parameters by child: model 2,762" in estimator.estimate.notes
    assert not any("could not summarise" in note for note in estimator.estimate.notes)
    assert estimator.estimate.method == "traced"
