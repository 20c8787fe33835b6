"""DataWaitMonitor's findings: each known slow pattern, on a real Trainer, with the pattern
(found, with its numbers) and without it (no finding)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import MLP, preloaded_dataset, quiet_trainer, usable_cores_from_the_os
from lightning import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import DataWaitMonitor
from lightning_gpuopt.core.findings import FINDING_KINDS, Finding, oversubscription
from lightning_gpuopt.testing import SimulatedGpu


def make_trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 8, **kwargs})


def kinds(monitor: DataWaitMonitor) -> list[str]:
    return [finding.kind for finding in monitor.report.findings]


def fit(tmp_path, model, loader, **kwargs) -> DataWaitMonitor:
    monitor = DataWaitMonitor(warmup_steps=2)
    make_trainer(tmp_path, [monitor], **kwargs).fit(model, loader)
    return monitor


class WrappedInDataParallel(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.DataParallel(self.net)


class SmallConvNet(MLP):
    """A 2-D convolution net on 3x16x16 images; ``channels_last``: the weights and, in
    ``training_step``, the images in NHWC."""

    def __init__(self, channels_last: bool = False) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)
        )
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.channels_last:
            images = images.to(memory_format=torch.channels_last)
        return nn.functional.cross_entropy(self.net(images), labels)


def images(count: int = 128) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(count, 3, 16, 16, generator=generator)
    return TensorDataset(data, torch.randint(0, 2, (count,), generator=generator))


def test_every_finding_kind_is_documented_and_checked():
    with pytest.raises(ValueError, match="kind='slow-gpu' is not one of graph-kept"):
        Finding("slow-gpu", "m", "f")
    from lightning_gpuopt.core import findings

    for kind in FINDING_KINDS:
        assert f'``"{kind}"``' in findings.__doc__


# ----------------------------------------------------------------------------- data-parallel


def test_data_parallel_inside_the_module_is_found_and_named(tmp_path):
    monitor = fit(tmp_path, WrappedInDataParallel(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    (finding,) = [f for f in monitor.report.findings if f.kind == "data-parallel"]
    assert finding.where == "net"
    assert "Trainer(strategy='ddp'" in finding.fix
    assert finding.figures == {"wrappers": 1.0}


def test_a_plain_module_has_no_data_parallel_finding(tmp_path):
    monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    assert "data-parallel" not in kinds(monitor)


# ----------------------------------------------------------------------------- oversubscription


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_more_threads_than_cores_is_found_with_the_thread_count_that_fits(tmp_path, threads):
    from lightning_gpuopt.core.loader import usable_cpu_count

    cores = usable_cpu_count()
    assert cores == usable_cores_from_the_os()
    torch.set_num_threads(4 * cores)
    monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    (finding,) = [f for f in monitor.report.findings if f.kind == "oversubscribed"]
    assert finding.figures == {"threads": 4.0 * cores, "cores": float(cores), "suggested_threads": float(cores)}
    assert f"torch.set_num_threads({cores})" in finding.fix


def test_one_thread_per_core_is_not_oversubscribed(tmp_path, threads):
    from lightning_gpuopt.core.loader import usable_cpu_count

    torch.set_num_threads(usable_cpu_count())
    monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    assert "oversubscribed" not in kinds(monitor)


def test_threads_past_a_cgroup_cpu_quota_are_oversubscribed(tmp_path, threads, monkeypatch):
    """``docker run --cpus=1``: the quota is 1 core however many the affinity holds."""
    from lightning_gpuopt.core import loader

    monkeypatch.setattr(loader, "cgroup_cpu_quota", lambda: 1.0)  # the OS boundary: what cpu.max would say
    wanted = max(2, len(os.sched_getaffinity(0)))  # as many threads as the affinity holds (within it, 2 or more)
    torch.set_num_threads(wanted)
    monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    (finding,) = [f for f in monitor.report.findings if f.kind == "oversubscribed"]
    assert finding.figures == {"threads": float(wanted), "cores": 1.0, "suggested_threads": 1.0}
    assert "torch.set_num_threads(1)" in finding.fix


def test_oversubscription_counts_every_process_of_the_host():
    assert oversubscription(threads_per_process=4, processes=4, cores=16) is None
    finding = oversubscription(threads_per_process=8, processes=4, cores=16)
    assert finding.figures["threads"] == 32 and finding.figures["suggested_threads"] == 4


# ----------------------------------------------------------------------------- CUDA settings


@pytest.fixture
def float32_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(("profile", "found"), [("A100", True), ("H100", True), ("V100", False), ("T4", False)])
def test_tf32_off_is_found_on_cards_with_tf32_only(tmp_path, float32_matmul_precision, profile, found):
    torch.set_float32_matmul_precision("highest")
    with SimulatedGpu(profile, memory="1GiB"):
        monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    assert ("tf32-off" in kinds(monitor)) is found


def test_tf32_on_or_mixed_precision_is_no_finding(tmp_path, float32_matmul_precision):
    torch.set_float32_matmul_precision("high")
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    assert "tf32-off" not in kinds(monitor)
    torch.set_float32_matmul_precision("highest")
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16), precision="bf16-mixed")
    assert "tf32-off" not in kinds(monitor)


def test_a_host_run_has_no_cuda_findings(tmp_path, float32_matmul_precision):
    torch.set_float32_matmul_precision("highest")
    monitor = fit(tmp_path, SmallConvNet(), DataLoader(images(), batch_size=16), precision="bf16-mixed")
    assert not {"tf32-off", "cudnn-benchmark-off", "channels-last"} & set(kinds(monitor))


@pytest.fixture
def cudnn_benchmark():
    before = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = before


def test_cudnn_benchmark_off_with_fixed_shapes_is_found(tmp_path, cudnn_benchmark):
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, SmallConvNet(), DataLoader(images(), batch_size=16), benchmark=False)
    (finding,) = [f for f in monitor.report.findings if f.kind == "cudnn-benchmark-off"]
    assert finding.figures == {"convolutions": 1.0} and "Trainer(benchmark=True)" in finding.fix


def test_cudnn_benchmark_on_or_varying_shapes_or_no_convolution_is_no_finding(tmp_path, cudnn_benchmark):
    with SimulatedGpu("A100", memory="1GiB"):
        on = fit(tmp_path, SmallConvNet(), DataLoader(images(), batch_size=16), benchmark=True)
        # batches of 16, 24, 40 and 48 images: four shapes over the sampled steps
        sizes = iter([16, 24, 40, 48] * 8)
        varying = fit(
            tmp_path,
            SmallConvNet(),
            DataLoader(images(512), batch_sampler=_VaryingBatches(512, sizes)),
            benchmark=False,
        )
        no_conv = fit(tmp_path, MLP(), DataLoader(preloaded_dataset(256, 32), batch_size=16), benchmark=False)
    assert "cudnn-benchmark-off" not in kinds(on) + kinds(varying) + kinds(no_conv)


class _VaryingBatches:
    def __init__(self, count: int, sizes) -> None:
        self.count, self.sizes = count, list(sizes)

    def __iter__(self):
        start = 0
        for size in self.sizes:
            if start + size > self.count:
                return
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return sum(1 for _ in self)


def test_nchw_convolutions_under_mixed_precision_are_found_with_the_layer(tmp_path):
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, SmallConvNet(), DataLoader(images(), batch_size=16), precision="bf16-mixed")
    (finding,) = [f for f in monitor.report.findings if f.kind == "channels-last"]
    assert finding.where == "net.0"
    assert finding.figures == {"convolutions_nchw": 1.0, "input_nchw": 1.0}
    assert "memory_format=torch.channels_last" in finding.fix


def test_channels_last_model_and_inputs_or_full_precision_is_no_finding(tmp_path):
    with SimulatedGpu("A100", memory="1GiB"):
        converted = fit(
            tmp_path, SmallConvNet(channels_last=True), DataLoader(images(), batch_size=16), precision="bf16-mixed"
        )
        full = fit(tmp_path, SmallConvNet(), DataLoader(images(), batch_size=16))
    assert "channels-last" not in kinds(converted) + kinds(full)


def test_weights_in_nhwc_but_inputs_in_nchw_are_found(tmp_path):
    model = SmallConvNet()
    model.net = model.net.to(memory_format=torch.channels_last)  # training_step leaves the images NCHW
    with SimulatedGpu("A100", memory="1GiB"):
        monitor = fit(tmp_path, model, DataLoader(images(), batch_size=16), precision="16-mixed")
    (finding,) = [f for f in monitor.report.findings if f.kind == "channels-last"]
    assert finding.figures == {"convolutions_nchw": 0.0, "input_nchw": 1.0} and finding.where is None


# ----------------------------------------------------------------------------- the report


def test_findings_reach_the_table_the_json_report_and_the_metrics(tmp_path, threads):
    from lightning_gpuopt.core.loader import usable_cpu_count

    torch.set_num_threads(4 * usable_cpu_count())
    monitor = DataWaitMonitor(warmup_steps=2)
    trainer = make_trainer(tmp_path, [monitor])
    trainer.fit(WrappedInDataParallel(), DataLoader(preloaded_dataset(256, 32), batch_size=16))
    saved = json.loads(monitor.report_file.read_text())["data_wait"]["findings"]
    assert sorted(item["kind"] for item in saved) == ["data-parallel", "oversubscribed"]
    assert trainer.callback_metrics["gpuopt/findings"].item() == 2
    assert trainer.callback_metrics["gpuopt/finding/data_parallel/wrappers"].item() == 1
    from lightning_gpuopt.core.report import data_wait_table

    table = data_wait_table(monitor.report)
    assert "Slow patterns found (2):" in table and "data-parallel [net]" in table


def test_find_patterns_false_looks_for_nothing(tmp_path, threads):
    from lightning_gpuopt.core.loader import usable_cpu_count

    torch.set_num_threads(4 * usable_cpu_count())
    monitor = DataWaitMonitor(warmup_steps=2, find_patterns=False)
    make_trainer(tmp_path, [monitor]).fit(
        WrappedInDataParallel(), DataLoader(preloaded_dataset(256, 32), batch_size=16)
    )
    assert monitor.report.findings == []
