"""The CUDA paths, checked on a real GPU: events, NVML, the monitor's GPU figures, the memory
estimate against ``max_memory_allocated``, and the tuner's pinned memory.

Skipped without CUDA (CI has none). On a GPU machine: ``make test-gpu`` (about a minute; it prints the
figures each test measured as a table for benchmarks/RESULTS.md, see ``conftest.py``). Each behaviour here has a
twin on a simulated card in ``tests/integration/test_gpu_simulated.py``, which CI runs.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import MLP, SlowDataset, preloaded_batches, quiet_trainer
from lightning import Callback, Trainer
from models_memory import make_model
from torch.utils.data import DataLoader

from lightning_gpuopt import DataLoaderTuner, DataWaitMonitor, MemoryEstimator
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.nvml import NvmlSampler
from lightning_gpuopt.core.timing import CudaStepTimer, StepStart

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def busy_kernels(device: torch.device, size: int = 2048, repeats: int = 20) -> None:
    x = torch.randn(size, size, device=device)
    for _ in range(repeats):
        x = torch.tanh(x @ x / size)


def gpu_trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"accelerator": "gpu", **kwargs})


def test_cuda_step_timer_sees_the_host_pause_between_steps_as_idle(figures):
    device = torch.device("cuda", torch.cuda.current_device())
    timer, pause_s, steps = CudaStepTimer(device_for(device).new_event), 0.02, 10
    busy_kernels(device)  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize()
    for step in range(steps):
        timer.step_start(StepStart(measured=True, clean_gap=step > 0))
        busy_kernels(device)
        timer.step_end()
        torch.cuda.synchronize()  # the host waits for the GPU, then pauses: the GPU idles
        time.sleep(pause_s)
    totals = timer.finish()
    figures(idle_s=totals.idle_s, expected_idle_s=(steps - 1) * pause_s, busy_s=totals.busy_s)
    assert totals.steps == steps and totals.busy_s > 0
    assert totals.idle_s == pytest.approx((steps - 1) * pause_s, rel=0.3)


def test_nvml_sampler_sees_this_gpu_working(figures):
    device = torch.device("cuda", torch.cuda.current_device())
    uuid = device_for(device).uuid
    sampler = NvmlSampler(interval_s=0.1, uuids=[uuid])
    assert sampler.start()
    deadline = time.perf_counter() + 1.5
    while time.perf_counter() < deadline:
        busy_kernels(device)
    torch.cuda.synchronize()
    usage = sampler.stop()
    own = next(gpu for gpu in usage if gpu.uuid.endswith(uuid.split("-", 1)[-1]))
    figures(torch_uuid=uuid, nvml_uuid=own.uuid, samples=own.samples, util_mean=own.util_mean)
    assert own.samples >= 10 and own.util_mean > 20 and own.memory_used_max_bytes > 0


def test_monitor_on_gpu_input_bound_with_an_idle_gpu_and_compute_bound_with_a_busy_one(tmp_path, figures):
    slow = DataWaitMonitor(warmup_steps=2)
    gpu_trainer(tmp_path, [slow], max_steps=30).fit(MLP(), DataLoader(SlowDataset(960, delay_s=0.001), batch_size=16))
    figures(slow=slow.report.verdict, idle=slow.report.gpu_idle_fraction, util=slow.report.totals.gpu_util_mean)
    assert slow.report.verdict == "input-bound", slow.report.verdict_reason
    assert slow.report.gpu_idle_fraction > 0.5 and slow.report.totals.gpu_util_mean is not None
    assert any(advice.startswith("pin_memory=False → True") for advice in slow.report.recommendations)

    # ~5 TFLOP a step (4096 x 1024 -> 8192 x 4 layers, forward and backward): tens of ms on any GPU,
    # far above Lightning's per-step host overhead
    busy = DataWaitMonitor(warmup_steps=3)
    model = MLP(features=1024, hidden=8192, layers=4)
    gpu_trainer(tmp_path, [busy], max_steps=30).fit(
        model, DataLoader(preloaded_batches(30, 4096, 1024), batch_size=None)
    )
    figures(busy=busy.report.verdict, idle=busy.report.gpu_idle_fraction, util=busy.report.totals.gpu_util_mean)
    assert busy.report.verdict == "compute-bound", busy.report.verdict_reason
    assert busy.report.gpu_idle_fraction < 0.15


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_memory_estimate_within_fifteen_percent_of_max_memory_allocated(tmp_path, name, figures):
    model = make_model(name, num_samples=4 * 64)
    estimator = MemoryEstimator(measure_steps=3)
    gpu_trainer(tmp_path, [estimator], max_steps=4).fit(model, model.loader(64))
    estimate = estimator.estimate
    figures(
        predicted=estimate.predicted_peak_bytes, measured=estimate.measured_peak_bytes,
        error=estimate.estimate_error, max_memory_allocated=torch.cuda.max_memory_allocated(),
    )  # fmt: skip
    assert estimate.method == "traced" and estimate.measured_peak_bytes > 0
    assert abs(estimate.estimate_error) <= 0.15, estimate


def test_tuner_pins_memory_on_cuda(tmp_path, figures):
    tuner = DataLoaderTuner(max_seconds=3)
    gpu_trainer(tmp_path, [tuner], max_steps=3).fit(MLP(), DataLoader(SlowDataset(640, delay_s=0.0005), batch_size=16))
    figures(num_workers=tuner.result.num_workers, pin_memory=tuner.result.pin_memory)
    assert tuner.result.pin_memory is True and tuner.result.num_workers > 0


def test_memory_fill_on_cuda_picks_mixed_precision_and_stays_in_the_budget(tmp_path, figures):
    from lightning_gpuopt import MemoryFill

    budget = 200 * 2**20  # far below the card: the real allocator decides what fits
    model = make_model("transformer", num_samples=4096, batch_size=16)
    fill = MemoryFill(global_batch_size=1024, max_memory=budget)

    class PeakOfTraining(Callback):  # trials above the budget may have run: measure training alone
        def on_train_start(self, trainer, pl_module):
            torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, pl_module):
            self.peak = torch.cuda.max_memory_allocated()

    peak = PeakOfTraining()
    gpu_trainer(tmp_path, [fill, peak], max_steps=3).fit(model)
    plan = fill.plan
    figures(
        precision=plan.precision, micro_batch=plan.micro_batch_size, accumulate=plan.accumulate_grad_batches,
        trial_peak=plan.measured_peak_bytes, training_peak=peak.peak, budget=budget,
    )  # fmt: skip
    assert plan.precision == ("bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed")
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 1024 and plan.accumulate_grad_batches > 1
    assert plan.measured_peak_bytes <= budget * 0.9
    assert peak.peak <= budget  # no step of the real training went past it


def test_peak_meters_read_the_allocators_counters_backward_thread_included():
    """A meter resets the card's peak counters as it starts (documented in ``core/device.py``); an outer meter
    keeps the peak from before an inner one's reset. Autograd's allocations run on its own thread."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(device)
    x = torch.randn(512, 1024, device=device)
    card = device_for(device)
    with card.peak_meter() as outer:
        big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        del big
        with card.peak_meter() as inner:
            model(x).sum().backward()
            torch.cuda.synchronize()
        assert inner.peak_bytes == torch.cuda.max_memory_allocated()  # the same counter, since the reset
    assert outer.peak_bytes >= 256 * 2**20 > inner.peak_bytes  # the outer meter kept it across the reset
    assert inner.peak_reserved_bytes >= inner.peak_bytes and inner.alloc_retries == 0


def test_an_explicit_max_memory_is_enforced_on_reserved_memory(tmp_path, figures):
    from lightning_gpuopt import BatchSizeSearch

    cap = 256 * 2**20
    model = make_model("cnn", num_samples=2048, batch_size=8)

    class Reserved(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.reserved = max(getattr(self, "reserved", 0), torch.cuda.memory_reserved())

    reserved = Reserved()
    search = BatchSizeSearch(max_memory=cap)
    gpu_trainer(tmp_path, [search, reserved], max_steps=5).fit(model)
    figures(batch_size=search.result.batch_size, reserved_peak=reserved.reserved, cap=cap)
    assert reserved.reserved <= cap
