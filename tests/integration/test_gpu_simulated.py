"""The GPU decisions, run in CI on simulated CUDA cards (``SimulatedGpu``): the twins of
``tests/test_gpu.py`` and a test for each GPU defect fixed. Tensors stay on the CPU; every
decision sees a CUDA card of the profile, memory counted at the allocator through a model of the
caching allocator, OOMs raised as a real card raises them.

Every chosen batch is checked independently: a fresh model trains a whole shuffled epoch at it,
on a fresh simulated card of the same size, without running out of memory.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
from helpers import MLP, SlowDataset, preloaded_batches, preloaded_dataset, quiet_trainer
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from models_memory import ClassifierModule, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt, MemoryFill, NoBatchSizeFitsError
from lightning_gpuopt.core.device import HostEvent, device_for
from lightning_gpuopt.core.nvml import NvmlSampler
from lightning_gpuopt.core.timing import CudaStepTimer, StepStart
from lightning_gpuopt.testing import SimulatedGpu

MIB = 2**20
#: two cards in every twin: one with native bfloat16 (Hopper), one without (Turing)
PROFILES = ["H100", "T4"]


def trains_a_shuffled_epoch(
    tmp_path, profile: str, memory: str, name: str, batch_size: int, samples: int, **trainer_kwargs: Any
) -> bool:
    """The independent check: does a fresh model train one whole shuffled epoch at ``batch_size`` on
    a fresh card of that size?"""
    model = make_model(name, num_samples=samples, batch_size=batch_size)
    generator = torch.Generator().manual_seed(1)
    loader = DataLoader(model.loader(batch_size).dataset, batch_size=batch_size, shuffle=True, generator=generator)
    try:
        with SimulatedGpu(profile, memory=memory):
            quiet_trainer(tmp_path, [], max_epochs=1, **trainer_kwargs).fit(model, loader)
    except torch.OutOfMemoryError:
        return False
    return True


# ----------------------------------------------------------------------------- timing and NVML


def test_step_timer_sees_the_host_pause_between_steps_as_idle():
    """Twin of the CUDA-event test: the simulated card's events are host clock readings."""
    timer, pause_s, steps = CudaStepTimer(HostEvent), 0.02, 6
    x = torch.randn(256, 256)
    started = time.perf_counter()
    for step in range(steps):
        timer.step_start(StepStart(measured=True, clean_gap=step > 0))
        for _ in range(5):
            x = torch.tanh(x @ x / 256)
        timer.step_end()
        time.sleep(pause_s)
    totals = timer.finish()
    wall = time.perf_counter() - started
    assert totals.steps == steps and totals.busy_s > 0
    assert totals.idle_s >= (steps - 1) * pause_s  # sleep never returns early
    assert totals.busy_s + totals.idle_s <= wall


def test_nvml_sampler_reads_the_simulated_cards_memory_and_utilisation():
    with SimulatedGpu("A100", memory="512MiB") as gpu:
        sampler = NvmlSampler(interval_s=0.05, uuids=[gpu.device.uuid])
        assert sampler.start()
        x = torch.randn(512, 512)
        gpu.place(x)
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            x = torch.tanh(x @ x / 512)
        usage = sampler.stop()
        reserved = gpu.reserved_bytes
    assert gpu.nvml.initialised == 0  # every nvmlInit was shut down
    own = next(card for card in usage if card.uuid == gpu.profile.uuid)
    assert own.samples >= 3 and own.util_mean is not None and own.util_mean > 0
    assert own.memory_used_max_bytes == gpu.profile.context_bytes + reserved  # v2: the driver's reserve apart
    assert own.memory_total_bytes == gpu.profile.nvml_total_bytes > 512 * MIB  # NVML's total includes it


def test_nvml_on_a_mig_instance_reads_memory_without_utilisation():
    with SimulatedGpu("A100-MIG-1g.10gb") as gpu:
        sampler = NvmlSampler(interval_s=0.05, uuids=[gpu.device.uuid])
        assert sampler.start()
        usage = sampler.stop()
    own = next(card for card in usage if card.uuid == gpu.profile.uuid)
    assert own.util_mean is None and own.memory_used_max_bytes == gpu.profile.context_bytes


@pytest.mark.parametrize("profile", PROFILES)
def test_monitor_on_a_card_input_bound_with_an_idle_gpu_and_compute_bound_with_a_busy_one(tmp_path, profile):
    with SimulatedGpu(profile, memory="1GiB"):
        slow = DataWaitMonitor(warmup_steps=2)
        quiet_trainer(tmp_path, [slow], max_steps=20).fit(
            MLP(), DataLoader(SlowDataset(960, delay_s=0.002), batch_size=16)
        )
        busy = DataWaitMonitor(warmup_steps=2)
        model = MLP(features=256, hidden=1024, layers=3)
        quiet_trainer(tmp_path, [busy], max_steps=20).fit(
            model, DataLoader(preloaded_batches(20, 512, 256), batch_size=None)
        )
    assert slow.report.verdict == "input-bound", slow.report.verdict_reason
    assert slow.report.gpu_idle_fraction > 0.5 and slow.report.totals.gpu_util_mean is not None
    assert busy.report.verdict == "compute-bound", busy.report.verdict_reason
    assert busy.report.gpu_idle_fraction < slow.report.gpu_idle_fraction
    assert profile in slow.report.device or "H100" in slow.report.device or "T4" in slow.report.device


class SlowTransfer(MLP):
    """A model whose host-to-device copy is slow (a large batch, pageable memory)."""

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        time.sleep(0.05)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_host_to_device_copies_count_as_gpu_work_not_idle(tmp_path):
    with SimulatedGpu("H100", memory="1GiB"):
        monitor = DataWaitMonitor(warmup_steps=2)
        quiet_trainer(tmp_path, [monitor], max_steps=15).fit(
            SlowTransfer(), DataLoader(preloaded_batches(15, 16, 32), batch_size=None)
        )
    report = monitor.report
    assert report.totals.transfer_fraction > 0.5  # the copies dominate the step...
    assert report.gpu_idle_fraction < 0.3  # ...and the card is busy with them, not waiting


# ----------------------------------------------------------------------------- loader tuning


def test_tuner_pins_memory_on_a_card(tmp_path, recwarn):
    with SimulatedGpu("T4", memory="1GiB"):
        tuner = DataLoaderTuner(max_seconds=3)
        quiet_trainer(tmp_path, [tuner], max_steps=3).fit(
            MLP(), DataLoader(SlowDataset(640, delay_s=0.0005), batch_size=16)
        )
    assert tuner.result is not None and tuner.result.pin_memory is True
    assert not [w for w in recwarn if "no accelerator is found" in str(w.message)]  # pinning is a no-op here


def test_tuner_leaves_a_dataset_already_on_the_card_alone(tmp_path):
    with SimulatedGpu("H100", memory="1GiB") as gpu:
        dataset = preloaded_dataset(512, 32)
        gpu.place(dataset.tensors)  # the simulated .cuda(): the samples live on the card
        loader = DataLoader(dataset, batch_size=16)
        tuner = DataLoaderTuner(max_seconds=3)
        with pytest.warns(UserWarning, match="its samples are already on cuda:0"):
            quiet_trainer(tmp_path, [tuner], max_steps=3).fit(MLP(), loader)
    assert tuner.result is None and "pin_memory=True fails on them" in tuner.message


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    ("profile", "expected"), [("H100", "bf16-mixed"), ("A100", "bf16-mixed"), ("V100", "16-mixed"), ("T4", "16-mixed")]
)
def test_amp_auto_picks_bf16_only_on_cards_with_native_bfloat16(tmp_path, profile, expected):
    model = make_model("mlp", num_samples=256, batch_size=16)
    with SimulatedGpu(profile, memory="256MiB"):
        fill = MemoryFill(global_batch_size=64, accumulation=False, activation_checkpointing=False)
        trainer = quiet_trainer(tmp_path, [fill], max_steps=2)
        trainer.fit(model)
    assert fill.plan.precision == expected
    assert fill.plan.changes[0] == f"precision: 32-true → {expected}"
    if expected == "16-mixed":
        assert any("no bfloat16" in reason for reason in fill.plan.reasons)


class Wide(LightningModule):
    """Parameters dominate: the optimizer's first step (SGD momentum, one copy of the weights) is the peak."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.layer = nn.Linear(1000, 1000)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 1000, generator=generator)), batch_size=self.batch_size)


class ScalerStates(Callback):
    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self.scaler = trainer.strategy.precision_plugin.scaler
        self.before = dict(self.scaler.state_dict())

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.at_train_start = dict(trainer.strategy.precision_plugin.scaler.state_dict())
        self.same_scaler = trainer.strategy.precision_plugin.scaler is self.scaler


def test_an_oom_inside_optimizer_step_leaves_the_gradient_scaler_usable(tmp_path):
    # forward and backward fit in 12 MB; the momentum buffer created inside optimizer.step() does not
    search = BatchSizeSearch(max_memory=12_000_000, margin=0)
    trainer = quiet_trainer(tmp_path, [search], max_steps=2, plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(NoBatchSizeFitsError):  # before the fix: "unscale_() has already been called"
        trainer.fit(Wide())


def test_trials_leave_the_scalers_state_as_it_was_and_the_chosen_batch_trains(tmp_path):
    states = ScalerStates()
    search = BatchSizeSearch(max_memory=15_000_000, margin=0)
    trainer = quiet_trainer(tmp_path, [search, states], max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu")])
    trainer.fit(Wide())
    assert any(not trial.fits for trial in search.result.trials)  # some trials ran out of memory
    assert states.same_scaler and states.at_train_start == states.before
    assert trainer.global_step == 3


def test_a_trial_goes_on_until_the_optimizer_really_stepped(tmp_path):
    """A scaler that finds inf skips optimizer.step(): the optimizer state would be missing from the peak."""

    class Overflowing(Wide):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * 1e30 if self.trainer.global_step < 2 else loss  # inf in float16: the scaler skips

    peaks = []
    for model in (Wide(), Overflowing()):
        search = BatchSizeSearch(max_memory=100_000_000, margin=0, max_trials=1, steps_per_trial=2)
        trainer = quiet_trainer(tmp_path, [search], max_steps=1, plugins=[MixedPrecision("16-mixed", "cpu")])
        trainer.fit(model)
        peaks.append(search.result.trials[0].peak_bytes)
    # the overflowing trial saw the momentum buffers alive in a step, as the plain one did
    assert peaks[1] >= peaks[0]


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("profile", PROFILES)
def test_search_on_a_card_finds_a_batch_that_trains_a_whole_shuffled_epoch(tmp_path, profile):
    memory, samples = "160MiB", 1024
    model = make_model("cnn", num_samples=samples, batch_size=8)
    with SimulatedGpu(profile, memory=memory):
        search = BatchSizeSearch(max_memory=None, margin=0.1)  # the card: free + reserved
        quiet_trainer(tmp_path, [search], max_steps=1).fit(model)
    found = search.result.batch_size
    assert found is not None and 8 < found < samples
    assert trains_a_shuffled_epoch(tmp_path, profile, memory, "cnn", found, samples)
    # a size above it did not fit in the trials: it ran out of the card's memory, or its reserved peak passed the
    # margin (the replayed prediction can start right below the limit, so no trial need run out of memory)
    assert any(not trial.fits and trial.batch_size > found for trial in search.result.trials)


def test_an_explicit_max_memory_caps_reserved_memory_in_training(tmp_path):
    cap = 96 * MIB
    model = make_model("cnn", num_samples=1024, batch_size=8)

    class ReservedDuringTraining(Callback):
        def on_train_start(self, trainer, pl_module):
            self.window = device_for(pl_module.device).peak_meter()
            self.window.start()

        def on_train_end(self, trainer, pl_module):
            self.window.stop()

    during = ReservedDuringTraining()
    with SimulatedGpu("A100", memory="1GiB") as gpu:  # a card far larger than the cap
        search = BatchSizeSearch(max_memory=cap, margin=0.1)
        quiet_trainer(tmp_path, [search, during], max_steps=4).fit(model)
        limit_after = gpu.allocator.limit_bytes
    assert during.window.peak_reserved_bytes <= cap
    assert limit_after == gpu.profile.total_bytes - gpu.profile.context_bytes  # the cap is lifted after fit


@pytest.mark.parametrize("profile", PROFILES)
def test_memory_fill_on_a_card_uses_its_precision_and_stays_in_the_budget(tmp_path, profile):
    budget = 64 * MIB
    model = make_model("transformer", num_samples=1024, batch_size=16)
    with SimulatedGpu(profile, memory="1GiB", cublas_workspace=0):
        fill = MemoryFill(global_batch_size=256, max_memory=budget, activation_checkpointing=False)
        window = {}

        class TrainingPeak(Callback):
            def on_train_start(self, trainer, pl_module):
                window["meter"] = device_for(pl_module.device).peak_meter()
                window["meter"].start()

            def on_train_end(self, trainer, pl_module):
                window["meter"].stop()

        quiet_trainer(tmp_path, [fill, TrainingPeak()], max_steps=3).fit(model)
    plan = fill.plan
    assert plan.precision == ("bf16-mixed" if profile == "H100" else "16-mixed")
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 256
    assert window["meter"].peak_reserved_bytes <= budget  # no step of the real training went past it


def test_the_readme_example_gpuopt_fits_a_simulated_t4(tmp_path):
    """README, "SimulatedGpu": a user's test of their own GpuOpt setup in CPU CI."""
    model = make_model("mlp", num_samples=512, batch_size=16)
    with SimulatedGpu("T4", memory="256MiB") as gpu:
        trainer = Trainer(
            accelerator="cpu",
            max_steps=5,
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=[GpuOpt("fill-memory", precision="auto")],
        )
        trainer.fit(model)
    plan = trainer.callbacks[0].report.memory_fill
    assert plan.precision == "16-mixed"
    assert gpu.peak_reserved_bytes <= 256 * MIB


def test_an_estimate_for_a_card_counts_its_blocks_and_cublas_without_allocating_there():
    """``gpuopt estimate --device cuda`` and MemoryFill's setup estimate a model for a card: the
    model is not moved, nothing is allocated on the card."""
    from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep

    model = make_model("mlp", num_samples=64, batch_size=32)
    batch = next(iter(model.train_dataloader()))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    loss = lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    on_host = StepEstimator(TrainingStep(model, batch, loss, batch_size=32)).estimate()
    with SimulatedGpu("H100", memory="1GiB") as gpu:
        on_card = StepEstimator(TrainingStep(model, batch, loss, batch_size=32, device="cuda")).estimate()
        probed = StepEstimator(TrainingStep(model, batch, loss, batch_size=32)).estimate()  # the module on the host
    assert gpu.peak_allocated_bytes == 0  # the estimates allocated nothing on the card
    # for a card, no host kernel's buffers (a card's kernels hold others: cuBLAS's and cuDNN's workspaces)
    assert probed.workspace_bytes == 0 and not any("kernel workspaces learned" in note for note in probed.notes)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    cublas = 2 * 32 * MIB  # the forward's and the autograd thread's cuBLAS workspaces
    assert on_card.untraced_bytes == cublas and any("cuBLAS" in note for note in on_card.notes)
    assert on_card.predicted_peak_bytes - cublas >= on_host.predicted_peak_bytes  # 512-byte blocks
    assert on_card.params_bytes % 512 == 0


def test_a_setup_estimate_for_a_cuda_run_casts_activations_as_the_run_will():
    """In ``setup`` the module is still on the host: a CUDA autocast does nothing to it, so the
    estimate counted float32 activations and switched checkpointing on where AMP alone fits. The
    run's own numbers: a real step in float16 autocast, measured at the allocator."""
    from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep, host_step_context
    from lightning_gpuopt.core.op_memory import LiveTensorTracker

    model = make_model("transformer", num_samples=64, batch_size=64)
    batch = next(iter(model.train_dataloader()))
    loss = lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    amp = host_step_context("16-mixed")
    with LiveTensorTracker(existing=(model, batch)) as truth:  # the step as the run will do it
        with amp():
            value = loss(batch)
        value.backward()
    model.zero_grad(set_to_none=True)
    del value
    cuda_autocast = lambda: torch.autocast("cuda", dtype=torch.float16)  # noqa: E731
    with pytest.warns(UserWarning):  # on host tensors a CUDA autocast is disabled: float32 throughout
        before = StepEstimator(TrainingStep(model, batch, loss, batch_size=64, step_context=cuda_autocast)).estimate()
    now = StepEstimator(TrainingStep(model, batch, loss, batch_size=64, step_context=amp)).estimate()
    assert abs(now.predicted_peak_bytes - truth.peak_bytes) <= 0.05 * truth.peak_bytes
    assert before.predicted_peak_bytes > 1.2 * truth.peak_bytes


# ----------------------------------------------------------------------------- what a card holds (issue 26)


class TwoLayerGru(LightningModule):
    """A 2-layer GRU (2.5 MiB of parameters) on 32-step sequences: on the host, float16/bfloat16 autocast
    casts the recurrent weights at every time step; a card's cuDNN casts them once a call."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.gru, self.head, self.batch_size = (
            nn.GRU(64, 256, num_layers=2, batch_first=True),
            nn.Linear(256, 10),
            batch_size,
        )

    def training_step(self, batch, batch_idx):
        out, _ = self.gru(batch[0])
        return nn.functional.cross_entropy(self.head(out[:, -1]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def test_mixed_precision_holds_no_more_than_full_precision_on_a_card(tmp_path):
    peaks = {}
    for precision in ("32-true", "16-mixed"):
        torch.manual_seed(0)
        with SimulatedGpu("T4") as gpu:
            quiet_trainer(tmp_path, [], max_steps=2, precision=precision).fit(TwoLayerGru())
        peaks[precision] = (gpu.peak_allocated_bytes, gpu.peak_reserved_bytes)
    assert peaks["16-mixed"][0] <= 1.05 * peaks["32-true"][0], peaks  # was 59 MiB against 25
    # what MemoryFill(max_memory="64MiB")'s trial asks of a micro-batch of 8 (margin 0.1); it was 58 MiB
    assert peaks["16-mixed"][1] <= 0.9 * 64 * MIB


class WithoutEstimate(BatchSizeSearch):
    """Searches from the user's batch size, as without an estimate: it extrapolates, misses, then bisects."""

    def search(self, trainer: Any, *args: Any, **kwargs: Any) -> Any:
        return super().search(trainer, *args, **{**kwargs, "prediction": (None, None, [])})


def test_a_trial_after_a_failed_larger_one_measures_what_a_fresh_card_does(tmp_path):
    """Trials put the weights back from host copies, which a card's ``copy_`` reads without holding them."""

    def trials(low: int, high: int, max_trials: int) -> list[tuple[int, bool, int]]:
        torch.manual_seed(0)
        network = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        model = ClassifierModule(network, torch.randn(4096, 64), batch_size=8)
        search = WithoutEstimate(
            min_batch_size=low, max_batch_size=high, max_trials=max_trials, steps_per_trial=1, verbose=False
        )
        with SimulatedGpu("H100", memory="48MiB", cublas_workspace=0):
            quiet_trainer(tmp_path, [search], max_steps=1).fit(model)
        return [(t.batch_size, t.fits, t.peak_bytes) for t in search.result.trials]

    searched = trials(1, 4096, max_trials=8)  # the user's 8 fits, larger ones fit, then miss
    after_a_miss = next(t for earlier, t in itertools.pairwise(searched) if not earlier[1] and t[1])
    assert trials(after_a_miss[0], after_a_miss[0], max_trials=1) == [after_a_miss]


class CacheAtTrainingStart(Callback):
    """The allocator's cached-but-unallocated bytes when the first real training batch starts."""

    def __init__(self, gpu: SimulatedGpu) -> None:
        self.gpu, self.cached = gpu, None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.cached is None:
            self.cached = self.gpu.reserved_bytes - self.gpu.allocated_bytes


def test_training_after_the_search_starts_with_no_segment_cached_by_the_trials(tmp_path):
    # the real H200's gpu_check (512 MiB cap, cnn): the step after the search ran out of memory with
    # 146.96 MiB reserved but unallocated, left cached by the trials; each trial started on an empty cache.
    # What stays cached: the free part of a 2 MiB small-pool segment that live parameters share.
    with SimulatedGpu("H100", memory="1GiB") as gpu:
        cache = CacheAtTrainingStart(gpu)
        search = BatchSizeSearch(max_memory=128 * MIB, margin=0, steps_per_trial=2, max_trials=6)
        quiet_trainer(tmp_path, [search, cache], max_steps=1).fit(make_model("cnn", num_samples=512, batch_size=8))
    assert len(search.result.trials) >= 2 and cache.cached < 2 * MIB  # before: 23,040,000 bytes
