"""MemoryFill(on_oom="adapt"): an out-of-memory error in a real training step is absorbed.

Real OOM paths only: a user's MemoryBudget held over training on CPU (its cap set from an
independent measurement of plain steps), a simulated card, and 2 DDP processes. The truth for
the weights is a loop written by hand that trains the same batches unsplit without a cap.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import pytest
import torch
from helpers import quiet_trainer
from lightning import Trainer
from lightning.pytorch.loggers import CSVLogger
from oom_models import CapDuringTraining, TokenModel, VariableLengthDataset, pad_collate, step_peak, train_by_hand
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt import GpuOpt, MemoryFill
from lightning_gpuopt.core.memory import MemoryBudget
from lightning_gpuopt.core.oom import BatchSplitError, MicroBatchLimits, OutOfMemoryAtOneSampleError, split_batch
from lightning_gpuopt.presets import load_preset
from lightning_gpuopt.testing import SimulatedGpu

LONG = (20, 21)  # two long samples: in the third batch of 8


@pytest.fixture(scope="module")
def dataset() -> VariableLengthDataset:
    return VariableLengthDataset(40, long_at=LONG, long=48)


@pytest.fixture(scope="module")
def caps(dataset) -> dict[str, int]:
    """Caps from plain steps measured by hand: one that fits the short batches of 8 but not the
    batch with the long samples, and one that fits only batches of 4 short samples."""
    short8 = step_peak(TokenModel(dataset), pad_collate([dataset[i] for i in range(8)]))
    long8 = step_peak(TokenModel(dataset), pad_collate([dataset[i] for i in range(16, 24)]))
    short4 = step_peak(TokenModel(dataset), pad_collate([dataset[i] for i in range(4)]))
    assert long8 > 2 * short8 and short8 > short4
    return {"short": int(1.5 * short8), "short4": (short4 + short8) // 2}


def fit(
    dataset,
    cap: CapDuringTraining,
    on_oom: str = "adapt",
    steps: int = 4,
    accumulate: int = 1,
    batch_size: int = 8,
    **trainer_kwargs: Any,
):
    model = TokenModel(dataset, batch_size=batch_size)
    fill = MemoryFill(
        global_batch_size=batch_size * accumulate,
        max_memory="1GB",
        activation_checkpointing=False,
        on_oom=on_oom,
        verbose=False,
    )
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
    )
    options.update(trainer_kwargs)
    trainer = Trainer(callbacks=[fill, cap], **options)
    trainer.fit(model)
    return model, fill, trainer


def weights(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:  # float32: the split sums in another order
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- core: splitting and deciding


def test_split_batch_cuts_every_tensor_along_the_samples_and_weights_by_share():
    batch = {"x": torch.arange(12.0).reshape(6, 2), "pair": (torch.arange(6), torch.tensor(3.0)), "name": "b"}
    parts = split_batch(batch, 4, batch_size=6)
    assert [weight for _, weight in parts] == [4 / 6, 2 / 6]
    assert torch.equal(torch.cat([part["x"] for part, _ in parts]), batch["x"])
    assert [part["pair"][0].tolist() for part, _ in parts] == [[0, 1, 2, 3], [4, 5]]
    assert all(part["pair"][1] is batch["pair"][1] and part["name"] == "b" for part, _ in parts)
    with pytest.raises(BatchSplitError, match=r"shape \(5,\).*first dimension is not 6"):
        split_batch((torch.zeros(6), torch.zeros(5)), 2, batch_size=6)


def test_limits_hold_for_samples_at_least_as_large_and_stop_at_one():
    limits = MicroBatchLimits()
    limits.adapt(step=3, attempted=16, elements=1000, reason="r")
    limits.adapt(step=9, attempted=5, elements=100, reason="r")
    assert (limits.limit_for(99), limits.limit_for(100), limits.limit_for(999), limits.limit_for(5000)) == (
        None,
        2,
        2,
        2,
    )
    limits = MicroBatchLimits()
    limits.adapt(step=1, attempted=2, elements=10, reason="r")
    with pytest.raises(OutOfMemoryAtOneSampleError, match=r"micro-batch of 1 sample.*2 → 1 \(step 1\)"):
        limits.adapt(step=2, attempted=1, elements=10, reason="last")


# ---------------------------------------------------------------------- a real Trainer under a cap


def test_a_rare_long_batch_is_split_and_the_weights_equal_an_unsplit_run_by_hand(tmp_path, dataset, caps):
    model, fill, trainer = fit(dataset, CapDuringTraining(caps["short"]), default_root_dir=tmp_path)
    adaptations = fill.plan.oom_adaptations
    assert trainer.global_step == 4
    assert adaptations and {a.step for a in adaptations} == {2}  # the batch with the long samples
    assert adaptations[0].old_micro_batch_size == 8 and adaptations[-1].new_micro_batch_size < 8
    assert all("out of memory" in a.reason for a in adaptations)
    assert_same_weights(weights(model), train_by_hand(TokenModel(dataset), 8, 4))
    assert (tmp_path / "gpuopt_report.json").exists()
    report = json.loads((tmp_path / "gpuopt_report.json").read_text())["memory_fill"]
    assert [a["step"] for a in report["oom_adaptations"]] == [a.step for a in adaptations]


def test_with_raise_the_same_run_dies_at_the_same_step(dataset, caps):
    cap = CapDuringTraining(caps["short"])
    with pytest.raises(torch.OutOfMemoryError):
        fit(dataset, cap, on_oom="raise")
    assert cap.died_at == 2


def test_accumulation_groups_keep_their_gradients_when_a_later_micro_batch_runs_out(dataset, caps):
    # groups of 2 batches of 8: the long batch is the first of the second group, and its neighbour
    # the second; the accumulated gradients of the group must survive the failed tries
    model, fill, trainer = fit(dataset, CapDuringTraining(caps["short"]), steps=2, accumulate=2)
    assert trainer.global_step == 2 and {a.batch_idx for a in fill.plan.oom_adaptations} == {2}
    assert_same_weights(weights(model), train_by_hand(TokenModel(dataset), 8, 2, accumulate=2))
    model, fill, trainer = fit(
        VariableLengthDataset(40, long_at=(28, 29), long=48), CapDuringTraining(caps["short"]), steps=2, accumulate=2
    )
    assert {a.batch_idx for a in fill.plan.oom_adaptations} == {3}  # the second of its group
    assert_same_weights(
        weights(model),
        train_by_hand(TokenModel(VariableLengthDataset(40, long_at=(28, 29), long=48)), 8, 2, accumulate=2),
    )


def test_a_cap_that_shrinks_keeps_the_smaller_micro_batch_from_then_on(tmp_path, dataset, caps):
    short_only = VariableLengthDataset(40)
    cap = CapDuringTraining(caps["short"], shrink_at=1, shrunk_bytes=caps["short4"])
    model, fill, trainer = fit(short_only, cap, logger=CSVLogger(tmp_path), default_root_dir=tmp_path)
    adaptations = fill.plan.oom_adaptations
    # the cap shrank before step 1: that step adapted (halving until it fitted), the steps after it
    # ran under the same cap with the micro-batch kept, without another error
    assert trainer.global_step == 4 and adaptations and {a.step for a in adaptations} == {1}
    assert adaptations[0].old_micro_batch_size == 8 and adaptations[-1].new_micro_batch_size <= 4
    assert_same_weights(weights(model), train_by_hand(TokenModel(short_only), 8, 4))
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "gpuopt/oom_adaptations" in metrics and "gpuopt/oom_micro_batch_size" in metrics


def test_out_of_memory_at_one_sample_is_raised_with_what_was_tried(dataset, caps):
    cap = CapDuringTraining(caps["short"], shrink_at=1, shrunk_bytes=caps["short4"] // 4)
    with pytest.raises(OutOfMemoryAtOneSampleError, match=r"micro-batch of 1 sample.*8 → 4 \(step 1\)"):
        fit(dataset, cap)
    assert cap.died_at == 1


def test_no_out_of_memory_error_leaves_the_run_bit_for_bit_as_without(dataset):
    adapt, _, _ = fit(dataset, CapDuringTraining(10**9), accumulate=2, steps=2)
    plain, _, _ = fit(dataset, CapDuringTraining(10**9), on_oom="raise", accumulate=2, steps=2)
    for name, value in weights(adapt).items():
        assert torch.equal(value, weights(plain)[name]), name
    assert "training_step" not in vars(adapt)  # the wrapper is gone after fit


# ---------------------------------------------------------------------- a simulated card


class Stream(IterableDataset):
    def __init__(self, dataset: VariableLengthDataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset.items)


class StreamModel(TokenModel):
    """The samples as a stream: MemoryFill's trials see the first batches only."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(self.dataset), batch_size=self.batch_size, collate_fn=pad_collate)


def fit_on_card(tmp_path, memory: str, on_oom: str, precision: Optional[str], watcher: CapDuringTraining):
    dataset = VariableLengthDataset(40, long_at=LONG, long=1024)
    model = StreamModel(dataset, batch_size=8, hidden=256)
    with SimulatedGpu("T4", memory=memory) as gpu:
        fill = MemoryFill(
            global_batch_size=8, activation_checkpointing=False, precision=precision, on_oom=on_oom, verbose=False
        )
        trainer = quiet_trainer(tmp_path, [fill, watcher], max_steps=4, limit_val_batches=0)
        trainer.fit(model)
    return model, fill, trainer, gpu


def test_on_a_simulated_card_the_long_batch_the_plan_could_not_see_is_absorbed(tmp_path):
    watcher = CapDuringTraining(10**12)  # no cap of its own: records the step an exception ended the run
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        fit_on_card(tmp_path, "28MiB", "raise", None, watcher)
    assert watcher.died_at == 2
    model, fill, trainer, gpu = fit_on_card(tmp_path, "28MiB", "adapt", None, CapDuringTraining(10**12))
    assert fill.plan.micro_batch_size == 8 and trainer.global_step == 4
    assert {a.step for a in fill.plan.oom_adaptations} == {2}
    assert gpu.peak_reserved_bytes <= gpu.profile.total_bytes
    dataset = VariableLengthDataset(40, long_at=LONG, long=1024)
    assert_same_weights(weights(model), train_by_hand(TokenModel(dataset, hidden=256), 8, 4))


def test_on_a_simulated_card_with_16_mixed_the_gradient_scaler_applies_once(tmp_path):
    # 16-mixed (a T4 has no bfloat16) with its GradScaler: the split run equals the same run on a
    # card large enough for the long batch (a gradient scaled twice, or not unscaled, would not)
    model, fill, _, _ = fit_on_card(tmp_path, "28MiB", "adapt", "auto", CapDuringTraining(10**12))
    assert fill.plan.precision == "16-mixed" and {a.step for a in fill.plan.oom_adaptations} == {2}
    whole, fill_whole, _, _ = fit_on_card(tmp_path, "1GiB", "raise", "auto", CapDuringTraining(10**12))
    assert fill_whole.plan.precision == "16-mixed" and not fill_whole.plan.oom_adaptations
    for name, value in weights(whole).items():
        torch.testing.assert_close(weights(model)[name], value, rtol=1e-3, atol=1e-5, msg=name)


# ---------------------------------------------------------------------- options


def test_on_oom_option_presets_and_gpuopt_override():
    with pytest.raises(ValueError, match=r"`on_oom` must be one of 'adapt', 'raise', got 'skip'"):
        MemoryFill(on_oom="skip")
    assert all(load_preset(name)["on_oom"] == "adapt" for name in ("fill-memory", "max-throughput", "low-memory"))
    assert GpuOpt("fill-memory").fill.on_oom == "adapt"
    assert GpuOpt("fill-memory", on_oom="raise").fill.on_oom == "raise"


def test_manual_optimization_is_not_adapted_and_says_so(tmp_path, dataset):
    class Manual(TokenModel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()

    fill = MemoryFill(
        global_batch_size=8, max_memory="1GB", activation_checkpointing=False, on_oom="adapt", verbose=False
    )
    trainer = quiet_trainer(tmp_path, [fill], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Manual(dataset, batch_size=8))
    assert any("cannot adapt manual optimization" in str(w.message) for w in caught)
    assert any("cannot adapt manual optimization" in reason for reason in fill.plan.reasons)


def test_a_callback_calling_training_step_itself_gets_the_original(tmp_path, dataset):
    from lightning import Callback

    class CallsTrainingStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            loss = pl_module.training_step(batch, batch_idx)  # e.g. a tracer: its own forward and backward
            self.has_graph = loss.grad_fn is not None and type(loss.grad_fn).__name__ != "_HandGradientsBackward"
            pl_module.zero_grad()

    caller = CallsTrainingStep()
    _model, _fill, trainer = fit(dataset, caller, steps=2, default_root_dir=tmp_path)
    assert caller.has_graph and trainer.global_step == 2
    assert "training_step" not in vars(trainer.strategy)


class Unfreezing(TokenModel):
    """Adam, and a large parameter frozen until step 2 (a layer unfrozen mid-run): its optimizer state is
    created by the optimizer step of step 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.big = torch.nn.Parameter(torch.zeros(100_000), requires_grad=False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.big.requires_grad_(self.global_step >= 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.big[:1].sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)


def test_out_of_memory_in_the_optimizer_step_says_adapt_covers_forward_and_backward_only(dataset):
    # measured by hand: the peak of step 2's forward and backward, and of its optimizer step (Adam's new state)
    model = Unfreezing(dataset)
    optimizer, batch = model.configure_optimizers(), pad_collate([dataset[i] for i in range(8)])
    with MemoryBudget(10**12, existing=(model, optimizer), device="cpu") as meter:
        for step in range(3):
            model.big.requires_grad_(step >= 2)
            optimizer.zero_grad()
            model.training_step(batch, 0).backward()
            backward_peak = meter.peak_bytes
            optimizer.step()
    assert meter.peak_bytes > backward_peak + 700_000  # Adam's two buffers of 400 kB
    cap = CapDuringTraining((backward_peak + meter.peak_bytes) // 2)
    fill = MemoryFill(
        global_batch_size=8, max_memory="1GB", activation_checkpointing=False, on_oom="adapt", verbose=False
    )
    trainer = quiet_trainer(None, [fill, cap], max_steps=4)
    with pytest.raises(
        torch.OutOfMemoryError, match=r"covers forward and backward only: out of memory in the optimizer step"
    ):
        trainer.fit(Unfreezing(dataset, batch_size=8))
    assert cap.died_at == 2 and fill.plan.oom_adaptations == []
