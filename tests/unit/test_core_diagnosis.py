"""Verdict rules, recommendations, idle GPUs, stragglers and NVML's absence, from given figures."""

from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.core.diagnosis import (
    RunSettings,
    Thresholds,
    classify,
    data_wait_report,
    diagnose,
    find_idle_gpus,
    find_straggler,
    workers_to_keep_up,
)
from lightning_gpuopt.core.nvml import GpuUsage, NvmlSampler, visible_gpu_indices
from lightning_gpuopt.core.timing import StepTotals


def shares(wait: float, gpu_idle=None, other: float = 0.01, step: float = 0.1, loader_cpu=0.0) -> StepTotals:
    """A step of ``step`` seconds: ``wait`` of it waiting for data, ``other`` host work, the rest compute."""
    wall = step
    idle = 0.0 if gpu_idle is None else gpu_idle * wall
    return StepTotals(
        steps=1,
        wall_s=wall,
        data_wait_s=wait * wall,
        data_wait_cpu_s=loader_cpu * wait * wall,
        compute_s=(1 - wait - other) * wall,
        gpu_busy_s=0.0 if gpu_idle is None else wall - idle,
        gpu_idle_s=idle,
    )


@pytest.mark.parametrize(
    "figures, verdict",
    [
        (shares(0.6), "input-bound"),
        (shares(0.02), "compute-bound"),
        (shares(0.1), "balanced"),
        (shares(0.02, other=0.4), "host-bound"),
        (shares(0.6, gpu_idle=0.5), "input-bound"),
        (shares(0.6, gpu_idle=0.02), "compute-bound"),  # the wait overlaps GPU work: it costs nothing
        (shares(0.02, gpu_idle=0.4), "host-bound"),
    ],
)
def test_verdict_rules(figures, verdict):
    assert classify(figures, Thresholds())[0] == verdict


def test_workers_needed_follow_the_measured_ratio():
    # 30 ms of wait against 10 ms of the rest: the main process takes 30 ms per batch -> 3 workers
    assert workers_to_keep_up(shares(0.75, step=0.04), 0) == 3
    # 2 workers and still 20 ms wait of 30: each worker needs 2 x 30 = 60 ms per batch -> 6
    assert workers_to_keep_up(shares(2 / 3, step=0.03), 2) == 6


def test_worker_advice_is_capped_by_cores_unless_loading_waits_on_io():
    run = RunSettings(device_type="cpu", num_workers=0, usable_cpus=2)
    cpu_heavy = diagnose(shares(0.9, loader_cpu=0.95), run, Thresholds()).recommendations
    io_bound = diagnose(shares(0.9, loader_cpu=0.03), run, Thresholds()).recommendations
    assert cpu_heavy[0].startswith("num_workers=0 → 2 (~10 would keep up; 2 usable CPU cores)")
    assert io_bound[0].startswith("num_workers=0 → 8 (~10 would keep up; loading waits on I/O")


def test_a_wait_spent_receiving_from_workers_does_not_ask_for_more_workers():
    run = RunSettings(device_type="cpu", num_workers=8, usable_cpus=2, batch_size=32)
    receiving = diagnose(shares(0.35, loader_cpu=0.46, step=0.0025), run, Thresholds()).recommendations
    assert receiving[0].startswith("num_workers=8: the step waits 0.9 ms of 2.5 ms for its batch, and the main process")
    assert "batch_size=32 → 64" in receiving[0] and "try num_workers" not in receiving[0]
    waiting = diagnose(shares(0.35, loader_cpu=0.05, step=0.0025), run, Thresholds()).recommendations
    assert "try num_workers=16" in waiting[0]


def test_gpu_advice_names_pin_memory_and_precision():
    run = RunSettings(device_type="cuda", num_workers=4, pin_memory=False, usable_cpus=16, precision="32-true")
    input_bound = diagnose(shares(0.5, gpu_idle=0.45), run, Thresholds()).recommendations
    assert any(advice.startswith("pin_memory=False → True") for advice in input_bound)
    compute_bound = diagnose(shares(0.01, gpu_idle=0.01), run, Thresholds()).recommendations
    assert any(advice.startswith("precision='32-true' → 'bf16-mixed'") for advice in compute_bound)


def usage(index: int, util, visible: bool = True) -> GpuUsage:
    return GpuUsage(index, "GPU", f"GPU-{index}", visible, 10, util, util, 0, 80 << 30)


def test_three_idle_gpus_beside_a_working_one_are_flagged():
    gpus = [usage(0, 56.0), usage(1, 0.0), usage(2, 0.0), usage(3, 0.0)]
    assert find_idle_gpus(gpus, Thresholds()) == [1, 2, 3]
    advice = diagnose(shares(0.01), RunSettings(device_type="cuda", num_devices=1), Thresholds(), gpus).recommendations
    assert any(
        text.startswith("devices=1 → 4: GPUs 1, 2, 3 are visible but idle while GPU 0 at 56%") for text in advice
    )
    # all idle (nothing works) or hidden GPUs: nothing to flag
    assert find_idle_gpus([usage(0, 1.0), usage(1, 0.0)], Thresholds()) == []
    assert find_idle_gpus([usage(0, 90.0), usage(1, 0.0, visible=False)], Thresholds()) == []


def test_straggler_needs_a_real_gap():
    thresholds = Thresholds()
    assert find_straggler([0.010, 0.011, 0.030, 0.010], thresholds, step_time_s=0.05) == 2
    assert find_straggler([0.010, 0.0115], thresholds, step_time_s=0.05) is None  # 15% slower: within limits
    assert find_straggler([0.0001, 0.0003], thresholds, step_time_s=0.05) is None  # 3x, but 0.2 ms of 50 ms
    assert find_straggler([0.01], thresholds, step_time_s=0.05) is None


def test_report_aggregates_ranks_into_means_and_global_throughput():
    def rank(wait: float) -> StepTotals:
        return StepTotals(steps=10, samples=80, wall_s=1.0, data_wait_s=wait, compute_s=0.5, forward_s=0.1)

    report = data_wait_report([rank(0.1), rank(0.4)], RunSettings(device_type="cpu", num_workers=0), Thresholds())
    assert [figures.data_wait_s for figures in report.ranks] == [0.1, 0.4]
    assert report.totals.data_wait_s == pytest.approx(0.25)
    assert report.totals.samples_per_second == pytest.approx(160.0)
    assert report.rank_spread["data_wait_per_step_s"].max == pytest.approx(0.04)
    assert report.diagnosis.straggler_rank == 1
    assert any(advice.startswith("rank 1 is a straggler") for advice in report.recommendations)
    # a rank that measured no step is left out of the means, and the straggler keeps its own rank number
    report = data_wait_report(
        [StepTotals(), rank(0.1), rank(0.4)], RunSettings(device_type="cpu", num_workers=0), Thresholds()
    )
    assert report.totals.data_wait_s == pytest.approx(0.25) and report.world_size == 3
    assert report.diagnosis.straggler_rank == 2
    assert any(advice.startswith("rank 2 is a straggler") for advice in report.recommendations)


def test_no_measured_step_is_balanced_with_no_advice():
    report = data_wait_report([StepTotals()], RunSettings(device_type="cpu"), Thresholds())
    assert (report.verdict, report.verdict_reason, report.recommendations) == (
        "balanced",
        "no training step was measured",
        [],
    )
    assert report.data_wait_fraction is None and report.rank_spread == {}


@pytest.mark.parametrize(
    "env, expected",
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        ("1,7,2", [1]),  # CUDA stops at the first invalid entry
        ("GPU-cc", [2]),
        ("", []),
    ],
)
def test_cuda_visible_devices_maps_to_nvml_indices(monkeypatch, env, expected):
    uuids = ["GPU-aa11", "GPU-bb22", "GPU-cc33", "GPU-dd44"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_indices(uuids, env) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="an NVIDIA driver is present")
def test_nvml_sampler_is_silently_absent_without_a_driver():
    sampler = NvmlSampler(interval_s=0.05)
    assert sampler.start() is False
    assert sampler.take_window(0) == (None, None)
    assert sampler.stop() == [] and sampler.stop() == []


@pytest.mark.parametrize("kwargs", [{"data_wait_high": 0}, {"data_wait_low": 0.5}, {"busy_gpu_util": 1.0}])
def test_thresholds_validate(kwargs):
    with pytest.raises(ValueError):
        Thresholds(**kwargs)


def test_oversubscription_warns_only_when_lowering_threads_helps():
    from lightning_gpuopt.core.loader import oversubscription

    assert oversubscription(2, 8, 0.13, cores=2) == (
        "oversubscription: torch runs 2 intra-op threads for the model and the 8 loader workers keep ~1.0 cores"
        " busy, 3.0 > 2 usable cores; call torch.set_num_threads(1) so neither stalls the other."
    )
    assert oversubscription(1, 8, 0.13, cores=2) is None  # already one thread: nothing to lower
    assert oversubscription(8, 2, 1.0, cores=16) is None  # fits
    assert oversubscription(4, 0, None, cores=2) is None  # no workers
