"""MemoryFill with a real Trainer on CPU, under simulated budgets (MemoryBudget).

Budgets are derived from independent measurements (a fresh model's real training steps inside a
LiveTensorTracker), never from the callback's own figures; gradients are checked against a
plain float32 step computed by hand on the same samples.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
from helpers import quiet_trainer
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models_memory import make_model
from torch.nn import functional as F

from lightning_gpuopt.callbacks.batch_size_search import NoBatchSizeFitsError
from lightning_gpuopt.callbacks.memory_fill import MemoryFill
from lightning_gpuopt.core.checkpointing import enable_checkpointing, find_repeated_blocks
from lightning_gpuopt.core.op_memory import LiveTensorTracker


def trainer_for(tmp_path, callbacks, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 2, **kwargs})


class PeakAroundTraining(Callback):
    """The independent measurement: live tensor storage over the real training steps."""

    def __init__(self) -> None:
        self.tracker: Optional[LiveTensorTracker] = None
        self.peak_bytes = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.tracker = LiveTensorTracker(existing=(pl_module, *trainer.optimizers), device="cpu")
        self.tracker.__enter__()

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        assert self.tracker is not None
        self.tracker.__exit__(None, None, None)
        self.peak_bytes = self.tracker.peak_bytes


def measured_peak(tmp_path, name: str, batch_size: int, checkpointing: bool = False, **trainer_kwargs: Any) -> int:
    """Peak of 2 real training steps of a fresh ``name`` model at ``batch_size``."""
    model = make_model(name, num_samples=256, batch_size=batch_size)
    if checkpointing:
        enable_checkpointing(find_repeated_blocks(model))
    meter = PeakAroundTraining()
    trainer_for(tmp_path / f"peak{batch_size}{checkpointing}", [meter], **trainer_kwargs).fit(model)
    return meter.peak_bytes


def budget_between(low_peak: int, high_peak: int, margin: float = 0.1) -> int:
    """A max_memory whose cap (less the margin) lies halfway between two measured peaks."""
    return int((low_peak + high_peak) / 2 / (1 - margin))


class GradientRecorder(Callback):
    """Gradients and weights at each optimizer step (listed after MemoryFill: sees its correction)."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.precision_plugins: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.precision_plugins.append(trainer.precision_plugin)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.steps.append((grads, weights))


def reference_gradients(model: Any, weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """Gradients of one float32 step of ``model`` (at ``weights``) on the whole batch ``(x, y)``."""
    twin = copy.deepcopy(model)
    twin.load_state_dict(weights, strict=False)
    twin.zero_grad()
    F.cross_entropy(twin(x), y).backward()
    return {n: p.grad for n, p in twin.named_parameters()}


def assert_close(grads: dict, expected: dict) -> None:
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def fill_fit(tmp_path, name: str, samples: int, initial: int, *extra: Callback, trainer_kwargs=None, **fill_kwargs):
    model = make_model(name, num_samples=samples, batch_size=initial)
    fill = MemoryFill(**{"margin": 0.1, **fill_kwargs})  # the budgets here are set for a flat 10% margin
    trainer = trainer_for(tmp_path, [fill, *extra], **(trainer_kwargs or {}))
    trainer.fit(model)
    return fill, model, trainer


@pytest.fixture(scope="module")
def mlp_budget_for_8(tmp_path_factory) -> int:
    """A budget in which micro-batches of 8 to 15 of the MLP fit when accumulating, 16 does not."""
    root = tmp_path_factory.mktemp("mlp")
    return budget_between(*(measured_peak(root, "mlp", size, accumulate_grad_batches=2) for size in (15, 16)))


@pytest.fixture(scope="module")
def mlp_bf16_budget_for_8(tmp_path_factory) -> int:
    """The same in bf16-mixed, measured in bf16-mixed: on a CPU without native bf16 (no
    avx512_bf16/AMX) oneDNN's bf16 matmul allocates an fp32 buffer of its output's size (1 MiB for
    a 512x512 weight gradient), so a float32 budget says nothing about what bf16 micro-batches fit."""
    root = tmp_path_factory.mktemp("mlp-bf16")
    peaks = (measured_peak(root, "mlp", size, accumulate_grad_batches=2, precision="bf16-mixed") for size in (15, 16))
    return budget_between(*peaks)


def test_accumulation_equals_one_large_batch_and_steps_once_per_group(tmp_path, mlp_budget_for_8):
    recorder = GradientRecorder()
    fill, model, trainer = fill_fit(
        tmp_path,
        "mlp",
        64,
        32,
        recorder,
        global_batch_size=32,
        max_memory=mlp_budget_for_8,
        trainer_kwargs=dict(max_steps=-1, max_epochs=1),
    )
    plan = fill.plan
    assert (plan.largest_fit, plan.micro_batch_size, plan.accumulate_grad_batches) == (15, 8, 4)
    assert plan.global_batch_size == plan.requested_global_batch_size == 32
    assert trainer.global_step == 2 == len(recorder.steps)  # 8 micro-batches, one optimizer step per 4
    inputs, targets = model.loader(64).dataset.tensors
    for step, (grads, weights) in enumerate(recorder.steps):
        rows = slice(32 * step, 32 * (step + 1))
        assert_close(grads, reference_gradients(model, weights, inputs[rows], targets[rows]))
    assert plan.changes == ["batch size: 32 → 8", "accumulate_grad_batches: 1 → 4"]


def test_a_short_last_group_is_a_mean_over_its_micro_batches(tmp_path, mlp_budget_for_8):
    recorder = GradientRecorder()
    fill, model, trainer = fill_fit(
        tmp_path,
        "mlp",
        40,
        32,
        recorder,
        global_batch_size=32,
        max_memory=mlp_budget_for_8,
        trainer_kwargs=dict(max_steps=-1, max_epochs=1),
    )
    assert (fill.plan.micro_batch_size, fill.plan.accumulate_grad_batches) == (8, 4)
    assert trainer.global_step == 2  # groups of 4 and 1 micro-batches
    inputs, targets = model.loader(40).dataset.tensors
    grads, weights = recorder.steps[1]
    assert_close(grads, reference_gradients(model, weights, inputs[32:40], targets[32:40]))


class OneCycleModel(LightningModule):
    """A scheduler sized by ``estimated_stepping_batches``: wrong if the steps per epoch change after it."""

    def __init__(self, inner: LightningModule) -> None:
        super().__init__()
        self.inner = inner
        self.batch_size = inner.batch_size
        self.total_steps: Optional[int] = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.inner(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)  # the memory the budget was measured with
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return self.inner.loader(self.batch_size)


def test_step_counting_lr_schedulers_see_the_new_steps_per_epoch(tmp_path, mlp_budget_for_8):
    model = OneCycleModel(make_model("mlp", num_samples=128, batch_size=64))  # 2 steps an epoch as written
    fill = MemoryFill(global_batch_size=32, max_memory=mlp_budget_for_8, margin=0.1)  # 4 optimizer steps an epoch after
    trainer = trainer_for(tmp_path, [fill], max_steps=-1, max_epochs=2)
    trainer.fit(model)
    assert (fill.plan.micro_batch_size, fill.plan.accumulate_grad_batches) == (8, 4)
    assert trainer.global_step == 8 == model.total_steps
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == model.total_steps


def test_checkpointing_keeps_loss_and_gradients_lowers_the_peak():
    torch.manual_seed(0)
    plain, checkpointed = make_model("transformer"), make_model("transformer")
    checkpointed.load_state_dict(plain.state_dict())
    handle = enable_checkpointing(find_repeated_blocks(checkpointed))
    assert handle.names == ["network.encoder.layers.0", "network.encoder.layers.1"]
    x, y = next(iter(plain.loader(32)))
    results = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)  # the same dropout masks
        with LiveTensorTracker(existing=(model,), device="cpu") as tracker:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, tracker.peak_bytes))
    (loss_a, grads_a, peak_a), (loss_b, grads_b, peak_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert_close(grads_b, grads_a)
    assert peak_b < 0.8 * peak_a, (peak_a, peak_b)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    handle.remove()
    assert "forward" not in vars(checkpointed.network.encoder.layers[0])


def test_checkpointed_batchnorm_blocks_update_running_stats_once():
    torch.manual_seed(0)

    def block():
        return torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())

    plain = torch.nn.Sequential(block(), block())
    checkpointed = copy.deepcopy(plain)
    enable_checkpointing(find_repeated_blocks(checkpointed))
    x = torch.randn(8, 4, 6, 6)
    for model in (plain, checkpointed):
        model(x).square().mean().backward()
    for name, buffer in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[name], buffer, msg=name)


@pytest.fixture(scope="module")
def transformer_budget_needing_checkpointing(tmp_path_factory) -> int:
    """Micro-batches of 8 fit with checkpointing when accumulating, not without checkpointing."""
    root = tmp_path_factory.mktemp("transformer")
    return budget_between(
        measured_peak(root, "transformer", 8, checkpointing=True, accumulate_grad_batches=2),
        measured_peak(root, "transformer", 8),
    )


def test_a_budget_that_fits_only_with_checkpointing_turns_it_on(tmp_path, transformer_budget_needing_checkpointing):
    budget = transformer_budget_needing_checkpointing
    fill, model, _ = fill_fit(tmp_path, "transformer", 256, 32, global_batch_size=32, max_memory=budget)
    plan = fill.plan
    assert plan.checkpointing and plan.checkpointed_classes == ["TransformerEncoderLayer"]
    assert plan.micro_batch_size >= 8 and plan.global_batch_size == 32
    assert "forward" not in vars(model.network.encoder.layers[0])  # undone at teardown
    # the same budget without the lever: the largest fit is below 8
    off, _, _ = fill_fit(
        tmp_path / "off",
        "transformer",
        256,
        32,
        global_batch_size=32,
        max_memory=budget,
        activation_checkpointing=False,
    )
    assert not off.plan.checkpointing and off.plan.largest_fit < 8 <= plan.largest_fit


def test_a_budget_that_fits_plainly_changes_nothing_but_the_batch(tmp_path):
    fill, model, trainer = fill_fit(tmp_path, "transformer", 256, 16, global_batch_size=48, max_memory="200MB")
    plan = fill.plan
    assert plan.changes == ["batch size: 16 → 48"]
    assert (plan.precision, plan.checkpointing, plan.accumulate_grad_batches) == ("32-true", False, 1)
    assert trainer.accumulate_grad_batches == 1 and model.batch_size == 16  # put back at teardown


def test_bf16_mixed_on_cpu_when_asked_grows_the_micro_batch(tmp_path):
    root = tmp_path / "peaks"
    budget = budget_between(measured_peak(root, "transformer", 20), measured_peak(root, "transformer", 21))
    recorder = GradientRecorder()
    options = dict(global_batch_size=64, max_memory=budget, activation_checkpointing=False)
    amp, _, trainer = fill_fit(tmp_path / "amp", "transformer", 128, 16, recorder, precision="bf16-mixed", **options)
    plain, _, _ = fill_fit(tmp_path / "plain", "transformer", 128, 16, precision=None, **options)
    assert plain.plan.largest_fit == 20
    assert amp.plan.precision == "bf16-mixed" and amp.plan.changes[0] == "precision: 32-true → bf16-mixed"
    assert isinstance(recorder.precision_plugins[0], MixedPrecision)  # training ran in it
    assert amp.plan.largest_fit > plain.plan.largest_fit
    assert trainer.precision == "32-true"  # put back at teardown


def test_explicit_precision_and_accumulation_are_respected(tmp_path, mlp_bf16_budget_for_8):
    fill, _, _trainer = fill_fit(
        tmp_path,
        "mlp",
        64,
        8,
        precision="bf16-mixed",
        global_batch_size=32,
        max_memory=mlp_bf16_budget_for_8,
        trainer_kwargs=dict(precision="bf16-mixed", accumulate_grad_batches=4),
    )
    plan = fill.plan
    assert (plan.precision, plan.micro_batch_size, plan.accumulate_grad_batches, plan.global_batch_size) == (
        "bf16-mixed",
        8,
        4,
        32,
    )
    assert any("set explicitly" in reason for reason in plan.reasons)
    assert plan.changes == []


class ManualModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model("mlp", num_samples=64, batch_size=32)
        self.batch_size = 32
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self.inner(batch[0]), batch[1]))
        optimizer.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> Any:
        return self.inner.loader(self.batch_size)


def test_manual_optimization_refuses_accumulation_with_the_reason(tmp_path, mlp_budget_for_8):
    trainer = trainer_for(
        tmp_path,
        [MemoryFill(global_batch_size=32, max_memory=mlp_budget_for_8, margin=0.1, activation_checkpointing=False)],
    )
    with pytest.raises(
        NoBatchSizeFitsError,
        match=r"largest micro-batch that fits is 1[5-9], but 32 .*manual optimization: Lightning cannot accumulate",
    ):
        trainer.fit(ManualModel())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(precision="yes"), "`precision`='yes' is not a precision MemoryFill switches to"),
        (dict(accumulation=True), "`accumulation` must be one of 'auto', False, got True"),
        (dict(objective="speed"), "`objective` must be one of 'throughput', 'memory', got 'speed'"),
        (dict(global_batch_size=0), "`global_batch_size` must be an integer >= 1"),
        (dict(activation_checkpointing=[3]), "`activation_checkpointing` must be 'auto', .*, got \\[3\\]"),
        (dict(margin=1.5), "`margin` must be a number in \\[0, 1\\), got 1.5"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryFill(**kwargs)


def test_checkpointing_classes_that_match_nothing_list_the_blocks(tmp_path):
    trainer = trainer_for(tmp_path, [MemoryFill(max_memory="200MB", activation_checkpointing=["NoSuchBlock"])])
    with pytest.raises(ValueError, match=r"'NoSuchBlock' matches no module.*TransformerEncoderLayer"):
        trainer.fit(make_model("transformer", num_samples=64, batch_size=8))


def test_global_batch_must_divide_over_accumulation_set_by_the_user(tmp_path):
    trainer = trainer_for(tmp_path, [MemoryFill(max_memory="200MB", global_batch_size=30)], accumulate_grad_batches=4)
    with pytest.raises(MisconfigurationException, match=r"global_batch_size=30 .* accumulate_grad_batches=4"):
        trainer.fit(make_model("mlp", num_samples=64, batch_size=8))


class UntraceableTransformer(type(make_model("transformer"))):
    """A step that needs real values (``.item()``): no estimate, so the trials decide alone."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        assert loss.item() < 1e9
        return loss


def test_without_an_estimate_the_trials_turn_checkpointing_on(tmp_path, transformer_budget_needing_checkpointing):
    plain = make_model("transformer", num_samples=256, batch_size=32)
    model = UntraceableTransformer(plain.network, plain.inputs, batch_size=32)
    fill = MemoryFill(global_batch_size=32, max_memory=transformer_budget_needing_checkpointing, margin=0.1)
    trainer_for(tmp_path, [fill]).fit(model)
    plan = fill.plan
    assert plan.checkpointing and plan.micro_batch_size >= 8
    assert any("the trials found a largest micro-batch of" in reason for reason in plan.reasons), plan.reasons
    assert plan.predicted_peak_bytes is None  # nothing could be traced


def test_accumulating_training_stays_within_the_budget_the_trials_kept(tmp_path):
    """Training keeps earlier micro-batches' gradients alive through the next backward: the trials
    must measure that, or the real steps go past the budget (they did, before the trials accumulated)."""
    from helpers import BudgetAroundTraining

    # without accumulation 32 fits this cap and 33 does not: a global batch of 64 = 32 x 2 would
    # be planned from trials that never accumulated
    cap = budget_between(*(measured_peak(tmp_path / "peaks", "transformer", size) for size in (32, 33)), margin=0)
    fill = MemoryFill(global_batch_size=64, max_memory=cap, margin=0.0, activation_checkpointing=False)
    guard = BudgetAroundTraining(cap)
    trainer_for(tmp_path, [fill, guard], max_steps=3).fit(make_model("transformer", num_samples=256, batch_size=64))
    plan = fill.plan  # the fit above raises OutOfMemoryError if a real step goes past the cap
    assert guard.budget is None and plan.accumulate_grad_batches > 1 and plan.global_batch_size == 64
    assert plan.largest_fit < 32 and any("when accumulating" in reason for reason in plan.reasons)


def test_the_predicted_peak_far_below_the_limit_is_the_peak_the_trial_measured(tmp_path):
    """The plan's predicted peak comes from its estimate's lines, not a trace of its own: far below the limit (the
    MLP at 64 in 200 MB, where Adam's step sets the peak) the line re-drawn near the limit alone said 37% less."""
    fill, _, _ = fill_fit(tmp_path, "mlp", 128, 32, global_batch_size=64, max_memory="200MB")
    plan = fill.plan
    assert (plan.micro_batch_size, plan.largest_fit) == (64, 64)  # the trial measured the planned micro-batch
    assert plan.predicted_peak_bytes == pytest.approx(plan.measured_peak_bytes, rel=0.05)
