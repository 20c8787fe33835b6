"""NVML without a GPU: the sampler and ``gpuopt doctor``'s NVML checks against FakeNvml.

The machine in most tests: GPU 0 (an A100 80GB), GPU 1 (an A100 40GB in MIG mode: NVML has no
utilisation for it) and one MIG instance on GPU 1. Every test checks that each successful
``nvmlInit`` was matched by exactly one ``nvmlShutdown``.
"""

import os

import pynvml
import pytest
import torch

from lightning_gpuopt.core import doctor
from lightning_gpuopt.core.nvml import (
    NvmlSampler,
    nvml_library,
    read_usage,
    same_device,
    using_nvml_library,
    visible_gpu_indices,
)
from lightning_gpuopt.testing._nvml import FakeNvml, FakeNvmlDevice

GIB = 1 << 30
GPU0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU1 = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
MIG = "MIG-cccccccc-1111-2222-3333-444444444444"
OTHER_PID = 4242
MIG_PID = 5151


def readings(*values):
    """A reading that returns ``values`` one call after the other, then repeats the last."""
    values = list(values)

    def read():
        return values.pop(0) if len(values) > 1 else values[0]

    return read


def machine(gpu0_error=None, gpu1_error=None, devices=None, **kwargs) -> FakeNvml:
    if devices is None:
        devices = [
            FakeNvmlDevice(
                "NVIDIA A100-SXM4-80GB",
                GPU0,
                80 * GIB,
                memory_used=readings(1 * GIB, 3 * GIB),
                utilization=readings(30, 70),
                error=gpu0_error,
                processes=[(os.getpid(), GIB), (OTHER_PID, 2 * GIB)],
            ),
            FakeNvmlDevice(
                "NVIDIA A100-SXM4-40GB",
                GPU1,
                40 * GIB,
                memory_used=readings(6 * GIB, 4 * GIB),
                utilization=None,
                error=gpu1_error,
            ),
            FakeNvmlDevice(
                "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                MIG,
                5 * GIB,
                memory_used=readings(2 * GIB, 1 * GIB),
                utilization=None,
                mig=True,
                parent=GPU1,
                processes=[(MIG_PID, GIB)],
            ),
        ]
    kwargs.setdefault("process_names", {OTHER_PID: "/usr/bin/python3", MIG_PID: "/opt/bin/trainer"})
    return FakeNvml(devices, **kwargs)


def assert_balanced(nvml: FakeNvml, inits: int) -> None:
    assert (nvml.calls["nvmlInit"], nvml.calls["nvmlShutdown"], nvml.initialised) == (inits, inits, 0)


@pytest.fixture(autouse=True)
def no_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def sample(nvml: FakeNvml, **kwargs):
    """Start a sampler (one sample), stop it (a second one); the thread's interval never elapses."""
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600, **kwargs)
        assert sampler.start()
        return sampler, sampler.stop()


# --------------------------------------------------------------------------- the library in use


def test_using_nvml_library_overrides_pynvml_and_nests():
    fake, other = machine(), machine()
    assert nvml_library() is pynvml
    with using_nvml_library(fake):
        assert nvml_library() is fake
        with using_nvml_library(None):  # as if nvidia-ml-py were not installed
            assert nvml_library() is None
            assert NvmlSampler().start() is False
        with using_nvml_library(other):
            assert nvml_library() is other
        assert nvml_library() is fake
    assert nvml_library() is pynvml


def test_fake_nvml_raises_pynvml_errors_and_hides_mig_instances_from_the_index():
    nvml = machine(gpu0_error="no-permission")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 2
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(GPU0))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)  # the MIG instance has no index
    mig = nvml.nvmlDeviceGetHandleByUUID(MIG)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetUtilizationRates(mig)
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 5 * GIB
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == GPU1
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-ffffffff")
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()  # NVML refuses a shutdown without an init
    assert nvml.initialised == 0


# --------------------------------------------------------------------------- the sampler


def test_sampler_on_every_gpu_reports_what_nvml_reports():
    nvml = machine()
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600)
        assert sampler.start()
        assert sampler.take_window(0) == (30.0, 1 / 80)  # the first sample, by NVML index (the old API)
        usage = sampler.stop()
        assert sampler.stop() == usage  # safe twice, no second shutdown
    assert [(gpu.index, gpu.uuid, gpu.name, gpu.visible) for gpu in usage] == [
        (0, GPU0, "NVIDIA A100-SXM4-80GB", True),
        (1, GPU1, "NVIDIA A100-SXM4-40GB", True),
    ]
    gpu0, gpu1 = usage
    assert (gpu0.samples, gpu0.util_mean, gpu0.util_max) == (2, 50.0, 70.0)
    assert (gpu0.memory_used_max_bytes, gpu0.memory_total_bytes) == (3 * GIB, 80 * GIB)
    # GPU 1 is in MIG mode: no utilisation, but its memory is still read
    assert (gpu1.samples, gpu1.util_mean, gpu1.util_max) == (2, None, None)
    assert (gpu1.memory_used_max_bytes, gpu1.memory_total_bytes) == (6 * GIB, 40 * GIB)
    assert_balanced(nvml, 1)


def test_sampler_by_uuid_maps_torch_uuids_and_reads_mig_memory_without_utilisation():
    nvml = machine()
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600, uuids=[GPU0[4:], MIG[4:]])  # as torch prints them: no prefix
        assert sampler.start()
        assert sampler.take_window(MIG[4:]) == (None, 2 / 5)
        assert sampler.take_window(GPU0) == (30.0, 1 / 80)  # with the prefix too
        assert sampler.take_window("GPU-ffffffff") == (None, None)
        usage = sampler.stop()
    assert nvml.calls["nvmlDeviceGetHandleByUUID"] >= 2
    assert [(gpu.index, gpu.uuid, gpu.mig, gpu.samples) for gpu in usage] == [(0, GPU0, False, 2), (1, MIG, True, 2)]
    mig = usage[1]
    assert mig.name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb" and mig.error is None
    assert (mig.util_mean, mig.util_max, mig.memory_used_max_bytes, mig.memory_total_bytes) == (
        None,
        None,
        2 * GIB,
        5 * GIB,
    )
    assert_balanced(nvml, 1)


def test_sampler_reports_an_unknown_uuid_and_samples_the_others():
    nvml = machine()
    _, usage = sample(nvml, uuids=["ffffffff-0000", GPU1])
    assert [(gpu.uuid, gpu.samples) for gpu in usage] == [("ffffffff-0000", 0), (GPU1, 2)]
    assert "NotFound" in usage[0].error and usage[0].index is None
    assert_balanced(nvml, 1)


@pytest.mark.parametrize("error, name", [("no-permission", "NoPermission"), ("not-supported", "NotSupported")])
def test_one_failing_device_does_not_disable_the_others(error, name):
    nvml = machine(gpu0_error=error)
    _, usage = sample(nvml)
    assert [gpu.index for gpu in usage] == [0, 1]
    assert usage[0].samples == 0 and name in usage[0].error
    assert (usage[1].samples, usage[1].memory_used_max_bytes, usage[1].error) == (2, 6 * GIB, None)
    assert_balanced(nvml, 1)

    nvml = machine(gpu0_error=error)
    _, usage = sample(nvml, uuids=[GPU0, MIG])
    assert usage[0].samples == 0 and name in usage[0].error
    assert (usage[1].uuid, usage[1].samples, usage[1].memory_used_max_bytes) == (MIG, 2, 2 * GIB)
    assert_balanced(nvml, 1)


def test_a_device_failing_between_samples_keeps_its_figures_and_the_others_sampled():
    nvml = machine()
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600)
        assert sampler.start()
        nvml.devices[0].error = "no-permission"  # e.g. the GPU fell off the bus
        usage = sampler.stop()
    assert (usage[0].samples, usage[0].util_mean, usage[0].memory_used_max_bytes) == (1, 30.0, GIB)
    assert "NoPermission" in usage[0].error
    assert usage[1].samples == 2
    assert_balanced(nvml, 1)


def unknown_error():
    return pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)


@pytest.mark.parametrize(
    "failures, devices, started, inits",
    [
        ({}, None, True, 1),
        ({"nvmlInit": pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)}, None, False, 0),
        ({"nvmlInit": OSError("libnvidia-ml.so.1: cannot open shared object file")}, None, False, 0),
        ({"nvmlDeviceGetCount": unknown_error()}, None, False, 1),
        ({"nvmlDeviceGetCount": RuntimeError("a bug")}, None, RuntimeError, 1),
        ({"nvmlDeviceGetHandleByIndex": unknown_error()}, None, False, 1),
        ({"nvmlDeviceGetName": KeyboardInterrupt()}, None, KeyboardInterrupt, 1),
        ({}, [], False, 1),  # a driver without GPUs
        ({"nvmlShutdown": unknown_error()}, None, True, 1),
    ],
    ids=[
        "ok",
        "init-fails",
        "no-library",
        "count-fails",
        "count-raises",
        "every-handle-fails",
        "interrupted",
        "no-gpu",
        "shutdown-fails",
    ],
)
def test_every_successful_init_is_shut_down_once(failures, devices, started, inits):
    failures = dict(failures)
    nvml = machine(devices=devices, failures=failures)
    shutdown_failure = failures.pop("nvmlShutdown", None)
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600)
        if isinstance(started, type):
            with pytest.raises(started):
                sampler.start()
        else:
            assert sampler.start() is started
        if shutdown_failure is not None:
            nvml.failures["nvmlShutdown"] = shutdown_failure
        sampler.stop()
        sampler.stop()
    expected_initialised = 1 if shutdown_failure is not None else 0  # a failed shutdown is not retried
    assert (nvml.calls["nvmlInit"], nvml.calls["nvmlShutdown"], nvml.initialised) == (1, inits, expected_initialised)
    assert sampler.usage() == [] or started is True


def test_a_sampler_started_twice_inits_once_and_restarts_after_stop():
    nvml = machine()
    with using_nvml_library(nvml):
        sampler = NvmlSampler(interval_s=3600)
        assert sampler.start() and sampler.start()
        assert nvml.calls["nvmlInit"] == 1
        sampler.stop()
        assert sampler.start()
        sampler.stop()
    assert_balanced(nvml, 2)


# --------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize(
    "env, expected",
    [
        (None, [0, 1]),
        ("1,0", [1, 0]),
        ("1,5,0", [1]),  # CUDA stops at the first invalid entry
        (GPU1, [1]),
        (GPU1[4:], [1]),  # without the prefix
        ("GPU-bbbb,GPU-aaaa", [1, 0]),  # unique prefixes
        (MIG, [1]),  # a MIG instance: its GPU's index
        (f"{MIG},0", [1, 0]),
        (f"MIG-{GPU1}/1/0", [1]),  # the legacy MIG-GPU-<uuid>/<gi>/<ci> form
        ("MIG-ffffffff-0000,0", []),  # an unknown MIG instance stops the list
        ("", []),
    ],
)
def test_cuda_visible_devices_maps_indices_gpu_uuids_and_mig_uuids(env, expected):
    assert visible_gpu_indices([GPU0, GPU1], env, mig_parents={MIG: GPU1}) == expected


@pytest.mark.parametrize(
    "env, visible", [(MIG, [False, True, True]), (f"MIG-{GPU1}/1/0", [False, True, True]), ("0", [True, False, False])]
)
def test_sampler_resolves_mig_uuids_in_cuda_visible_devices(monkeypatch, env, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    nvml = machine()
    sampler, usage = sample(nvml, uuids=[GPU0, GPU1, MIG])
    assert [gpu.visible for gpu in usage] == visible
    assert sampler.visible_indices == [index for index, seen in enumerate(visible[:2]) if seen]
    assert_balanced(nvml, 1)


# --------------------------------------------------------------------------- gpuopt doctor


def run_doctor_check(nvml, name):
    with using_nvml_library(nvml):
        result = doctor.run_check(name)
    failed_inits = int("nvmlInit" in nvml.failures)
    assert nvml.initialised == 0 and nvml.calls["nvmlShutdown"] == nvml.calls["nvmlInit"] - failed_inits
    return result


def test_doctor_gpus_reads_every_gpu_and_mig_mode_has_no_utilisation():
    nvml = machine()
    check = run_doctor_check(nvml, "gpus")
    gpus = check.details["gpus"]
    assert [(gpu["index"], gpu["uuid"], gpu["visible"]) for gpu in gpus] == [(0, GPU0, True), (1, GPU1, True)]
    assert (gpus[0]["memory_used_bytes"], gpus[0]["memory_total_bytes"], gpus[0]["utilization_percent"]) == (
        GIB,
        80 * GIB,
        30,
    )
    assert (gpus[1]["memory_used_bytes"], gpus[1]["utilization_percent"]) == (6 * GIB, None)
    assert check.status == "warn" and "0: NVIDIA A100-SXM4-80GB, 1.0/80.0 GiB used, 30% busy" in check.value
    assert "1: NVIDIA A100-SXM4-40GB, 6.0/40.0 GiB used, n/a% busy" in check.value


@pytest.mark.parametrize("error", ["no-permission", "not-supported"])
def test_doctor_gpus_reports_a_failing_gpu_and_checks_the_others(error):
    check = run_doctor_check(machine(gpu0_error=error), "gpus")
    assert "could not run" not in check.value
    failing, working = check.details["gpus"]
    assert failing["index"] == 0 and failing["error"] and failing["memory_used_bytes"] is None
    assert (working["index"], working["memory_used_bytes"], working["memory_total_bytes"]) == (1, 6 * GIB, 40 * GIB)
    assert check.status == "warn" and "GPU(s) 0" in check.fix


def test_doctor_gpus_with_a_mig_instance_in_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG)
    check = run_doctor_check(machine(), "gpus")
    assert [gpu["visible"] for gpu in check.details["gpus"]] == [False, True]
    assert "0: NVIDIA A100-SXM4-80GB, 1.0/80.0 GiB used, 30% busy [hidden by CUDA_VISIBLE_DEVICES]" in check.value


def test_doctor_processes_lists_other_processes_on_every_readable_gpu():
    check = run_doctor_check(machine(), "gpu_processes")
    assert check.status == "warn"
    assert check.details["processes"] == [
        {"gpu": 0, "pid": OTHER_PID, "name": "python3", "memory_bytes": 2 * GIB},
        {"gpu": 1, "pid": MIG_PID, "name": "trainer", "memory_bytes": GIB},  # on GPU 1's MIG instance
    ]

    check = run_doctor_check(machine(gpu0_error="no-permission"), "gpu_processes")
    assert check.details["processes"] == [{"gpu": 1, "pid": MIG_PID, "name": "trainer", "memory_bytes": GIB}]
    assert "GPU 0" in check.value and "NoPermission" in check.value

    check = run_doctor_check(machine(devices=[FakeNvmlDevice("NVIDIA T4", GPU0, 16 * GIB)]), "gpu_processes")
    assert check.status == "ok"


def test_doctor_driver_check_reads_nvml_and_says_when_nvml_is_missing():
    check = run_doctor_check(machine(cuda_driver_version=12080, driver_version="570.86.10"), "cuda_driver")
    assert "driver supports CUDA 12.8 (driver 570.86.10)" in check.value
    assert check.details["driver_cuda"] == "12.8" and check.details["driver"] == "570.86.10"

    with using_nvml_library(None):
        assert doctor.run_check("cuda_driver").value.startswith("no NVIDIA driver")
        if not doctor.torch.cuda.is_available():
            gpus = doctor.run_check("gpus")
            assert gpus.status == "warn" and "nvidia-ml-py (pynvml) is not installed" in gpus.value

    failing = machine(failures={"nvmlInit": pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)})
    check = run_doctor_check(failing, "gpu_processes")
    assert check.status == "info" and "Driver Not Loaded" in check.value


# --------------------------------------------------------------------------- the doctor's judgements of what only a card shows


@pytest.mark.parametrize(
    "build, available, gpus, status, says",
    [
        (
            None,
            False,
            2,
            "fail",
            "torch 2.5.1, CUDA build none (CPU-only wheel), but the driver shows 2 visible GPU(s)",
        ),
        ("12.4", False, 1, "fail", "cuDNN 90100, the driver shows 1 visible GPU(s) but CUDA is not available"),
        ("12.4", False, 0, "info", "cuDNN 90100; no visible GPU, so it runs on the CPU"),
        ("12.4", True, 1, "ok", "torch 2.5.1, CUDA build 12.4, cuDNN 90100"),
        (None, False, 0, "info", "torch 2.5.1, CUDA build none (CPU-only wheel)"),
    ],
)
def test_torch_build_against_the_gpus_the_driver_shows(build, available, gpus, status, says):
    check = doctor.torch_build_check("2.5.1", build, 90100 if build else None, available, gpus)
    assert (check.status, check.details["cuda_available"]) == (status, available) and says in check.value
    assert bool(check.fix) == (status == "fail")


def test_gpu_arch_names_each_device_and_judges_the_worst():
    check = doctor.gpu_arch_check([(9, 0), (12, 0)], ["sm_90", "compute_90"])
    assert check.value == "cuda:0 sm_90 (native), cuda:1 sm_120 (ptx); wheel has sm_90 compute_90"
    assert check.status == "warn" and "JIT-compiled from PTX" in check.fix
    assert doctor.gpu_arch_check([(8, 6)], ["sm_80"]).status == "ok"
    none = doctor.gpu_arch_check([(7, 5)], ["sm_80"])
    assert (
        none.status == "fail"
        and "no kernels for the GPU" in none.fix
        and none.details["devices"] == ["cuda:0 sm_75 (none)"]
    )


def test_gpu_matmul_against_the_cards_datasheet():
    check = doctor.gpu_matmul_check("NVIDIA A100-SXM4-80GB", {"fp32": 18.0, "tf32": 40.0}, size=8192)
    assert check.value == (
        "cuda:0 NVIDIA A100-SXM4-80GB (datasheet: A100, dense): fp32 18.0 TFLOP/s (92% of 19.5), "
        "tf32 40.0 TFLOP/s (26% of 156); 8192x8192"
    )
    assert check.status == "warn" and check.fix.startswith("tf32 below 40% of the datasheet peak")
    assert check.details == {
        "device": "NVIDIA A100-SXM4-80GB",
        "card": "A100",
        "size": 8192,
        "tflops": {"fp32": 18.0, "tf32": 40.0},
        "peak_tflops": {"fp32": 19.5, "tf32": 156.0},
    }
    fast = doctor.gpu_matmul_check("NVIDIA H100 80GB HBM3", {"fp32": 50.0, "tf32": 400.0, "bf16": 700.0}, 8192)
    assert (fast.status, fast.fix) == ("ok", "")
    unknown = doctor.gpu_matmul_check("NVIDIA RTX PRO 6000", {"fp32": 50.0}, 4096)
    assert unknown.status == "info" and "(unknown card, no datasheet figures): fp32 50.0 TFLOP/s;" in unknown.value
    assert unknown.details["card"] is None and unknown.details["peak_tflops"] is None


def test_pinned_memory_report():
    check = doctor.pinned_memory_check(64 * 2**20, 0.0042, pinned_gbps=24.6, pageable_gbps=11.2)
    assert check.value == "64 MiB pinned in 4.2 ms; host-to-GPU copies: pinned 24.6 GB/s, pageable 11.2 GB/s"
    assert (check.status, check.details["allocate_seconds"]) == ("ok", 0.0042)


def test_a_card_that_cannot_run_a_matmul_or_pin_memory_is_a_failure(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(doctor.device_layer, "cuda_hardware_available", lambda: True)
    monkeypatch.setattr(doctor.device_layer, "device_for", no_kernel)
    matmul = doctor.run_check("matmul", 0.1)
    assert matmul.status == "fail" and matmul.value.startswith("a matmul on cuda:0 failed: RuntimeError: CUDA error")
    if not torch.cuda.is_available():  # a CPU-only torch cannot pin memory
        pinned = doctor.run_check("pinned_memory")
        assert pinned.status == "fail" and "ulimit -l unlimited" in pinned.fix


def test_torch_and_nvml_spellings_of_a_uuid_name_one_device():
    """torch's ``get_device_properties(i).uuid`` is bare hex; NVML's carries ``GPU-``/``MIG-``."""
    assert same_device(GPU0, GPU0[4:]) and same_device(GPU0[4:].upper(), GPU0)
    assert not same_device(GPU0, GPU1[4:]) and not same_device(MIG, GPU0) and not same_device(None, GPU0[4:])
    assert not same_device("", "")


def test_memory_used_leaves_out_the_drivers_reserved_memory():
    nvml = FakeNvml([FakeNvmlDevice("NVIDIA H100 80GB HBM3", GPU0, 81559 * 2**20, GIB, memory_reserved=551 * 2**20)])
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert read_usage(nvml, handle)[1:] == (GIB, 81559 * 2**20)  # the v2 struct's used
    assert nvml.nvmlDeviceGetMemoryInfo(handle).used == GIB + 551 * 2**20  # v1's counts the reserve
