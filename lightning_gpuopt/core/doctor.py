"""Environment checks for GPU training, each with a status and a fix (``gpuopt doctor``).

Pure torch + standard library (``pynvml`` and ``numpy`` are used when importable; no Lightning).
NVML is reached through :func:`lightning_gpuopt.core.nvml.nvml_library` (a fake can stand in for
it), and a GPU NVML refuses (``NoPermission``, ...) is reported by the NVML checks while the
other GPUs are still checked.
Every check is one small function that returns a :class:`Check`; a check never raises: an
error inside it becomes a "warn" (or, where the error itself is the finding, a "fail") whose value
names the error. A machine without a GPU gets statuses that say so, with the fix, not an exception.

The checks, in the order :func:`run_checks` runs them (``Check.name``):

* ``torch_build``: torch's version and the CUDA version it was built for; a CPU-only wheel on a
  machine whose driver shows GPUs is a "fail".
* ``cuda_driver``: the CUDA version the driver supports (NVML, through :mod:`.nvml`)
  against ``torch.version.cuda``: an older driver major is a "fail", an older minor a "warn".
* ``gpu_arch``: each GPU's compute capability against the kernels in the wheel
  (``cuda_arch_list()`` of :mod:`.device`): missing is a "fail", only PTX (JIT at start-up) a "warn".
* ``gpus``: the GPUs NVML shows, which of them ``CUDA_VISIBLE_DEVICES`` leaves visible, their
  memory and current utilisation; none at all is a "warn" (training runs on the CPU), a visible
  GPU already busy before training, or one NVML cannot read, is a "warn".
* ``gpu_processes``: other processes computing on the visible GPUs
  (NVML's compute processes) and the memory they hold; a GPU whose processes
  NVML cannot read is a "warn".
* ``matmul``: a short matmul benchmark; on a GPU fp32, tf32 and bf16 TFLOP/s against the card's
  dense datasheet peaks (:data:`CARD_PEAKS`; below :data:`MATMUL_WARN_FRACTION` is a "warn"); on
  the CPU fp32 (and bf16) GFLOP/s as "info".
* ``cpu_cores``: ``os.cpu_count()`` against the process's CPU affinity and the cgroup CPU quota.
* ``torch_threads``: torch's intra-op threads times the processes on this host (``LOCAL_WORLD_SIZE``)
  against the usable cores: more is oversubscription, a "warn".
* ``blas``: the BLAS library torch (``torch.__config__.show()``) and NumPy (``numpy.show_config``)
  were built with (MKL, OpenBLAS, ...).
* ``pinned_memory``: whether page-locked host memory can be allocated, and host-to-GPU copy speed
  pinned vs pageable (only with CUDA).
* ``shm``: the size of ``/dev/shm``, through which DataLoader workers hand batches over; below
  :data:`SHM_WARN_BYTES` is a "warn" with Docker's ``--shm-size`` fix.

Example::

    >>> torch_threads_check(threads=8, cores=4).status          # 8 threads on 4 cores
    'warn'
    >>> cuda_driver_check(build="12.4", driver=12080).status     # a newer driver runs older builds
    'ok'
    >>> card_peaks("NVIDIA H100 80GB HBM3").bf16                  # dense bf16 TFLOP/s of an H100 SXM
    989.4
    >>> worst_status([Check("a", "ok", ""), Check("b", "warn", "")])
    'warn'
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from lightning_gpuopt.core import device as device_layer
from lightning_gpuopt.core.loader import cgroup_cpu_quota, usable_cpu_count
from lightning_gpuopt.core.nvml import (
    NvmlDevice,
    compute_processes,
    driver_versions,
    error_text,
    memory_info,
    nvml_devices,
    nvml_session,
    process_name,
    utilisation_percent,
)

#: statuses from best to worst
STATUSES = ("ok", "info", "warn", "fail")

#: a ``/dev/shm`` smaller than this (or with less free) is a "warn"
SHM_WARN_BYTES = 2**30

#: a GPU matmul below this fraction of the card's dense datasheet peak is a "warn"
MATMUL_WARN_FRACTION = 0.4

#: a visible GPU busier than this (% utilisation) or fuller than this (memory fraction) before training is a "warn"
BUSY_UTILISATION = 20
BUSY_MEMORY_FRACTION = 0.10

_GIB = 2**30


@dataclass
class Check:
    """One finding: ``status`` is "ok", "info", "warn" or "fail"; ``fix`` says what to do about it.

    ``details`` holds the measured figures for machines (the JSON output), e.g. TFLOP/s per dtype.
    """

    name: str
    status: str
    value: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def worst_status(checks: list[Check]) -> str:
    """The worst status among ``checks`` ("ok" for none), in the order of :data:`STATUSES`."""
    return max((check.status for check in checks), key=STATUSES.index, default="ok")


def _guarded(name: str) -> Callable[[Callable[..., Check]], Callable[..., Check]]:
    """Turn an exception raised inside a check into a "warn" that names it."""

    def decorate(check: Callable[..., Check]) -> Callable[..., Check]:
        @functools.wraps(check)
        def run(*args: Any, **kwargs: Any) -> Check:
            try:
                return check(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - a check reports, it never raises
                return Check(
                    name,
                    "warn",
                    f"the check could not run: {type(error).__name__}: {error}",
                    "this is a gap in the diagnosis, not necessarily a problem; run the check's steps by hand",
                )

        return run

    return decorate


# ----------------------------------------------------------------------------- NVML


def _visible_gpu_count() -> int:
    """GPUs the driver shows that ``CUDA_VISIBLE_DEVICES`` leaves visible (0 without a driver)."""
    with nvml_session() as (lib, _):
        return 0 if lib is None else sum(gpu.visible for gpu in nvml_devices(lib))


# ----------------------------------------------------------------------------- torch build and driver


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def cuda_version_text(driver_version: int) -> str:
    """NVML's integer CUDA version as text.

    Example::

        >>> cuda_version_text(12040)
        '12.4'
    """
    return f"{driver_version // 1000}.{driver_version % 1000 // 10}"


def cuda_driver_check(build: Optional[str], driver: Optional[int], driver_release: str = "") -> Check:
    """Compare the CUDA version torch was built for (``"12.4"``) with the driver's (``12040``).

    Example::

        >>> cuda_driver_check(build="12.4", driver=11080).status, cuda_driver_check("12.4", 12020).status
        ('fail', 'warn')
    """
    name = "cuda_driver"
    release = f" (driver {driver_release})" if driver_release else ""
    torch_text = "a CPU-only build" if build is None else f"built for CUDA {build}"
    if driver is None:
        return Check(name, "info", f"no NVIDIA driver; torch is {torch_text}")
    supported = cuda_version_text(driver)
    details = {"driver_cuda": supported, "torch_cuda": build, "driver": driver_release or None}
    if build is None:
        return Check(
            name, "info", f"driver supports CUDA {supported}{release}; torch is a CPU-only build", details=details
        )
    value = f"driver supports CUDA {supported}{release}; torch built for CUDA {build}"
    fix = (
        f"install a driver that supports CUDA {build}, or a torch wheel built for CUDA <= {supported} "
        f"(pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)"
    )
    have, need = _version_tuple(supported), _version_tuple(build)
    if have >= need:
        return Check(name, "ok", value, details=details)
    if have[:1] == need[:1]:
        return Check(
            name,
            "warn",
            value + " (older minor: runs by minor-version compatibility, but PTX JIT and newer features can fail)",
            fix,
            details,
        )
    return Check(name, "fail", value + ": the driver is too old, CUDA cannot start", fix, details)


@_guarded("torch_build")
def check_torch_build() -> Check:
    """torch's version and CUDA build; a CPU-only wheel on a GPU machine is a "fail"."""
    build = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if build else None
    value = f"torch {torch.__version__}, CUDA build {build or 'none (CPU-only wheel)'}"
    value += f", cuDNN {cudnn}" if cudnn else ""
    details = {
        "torch": torch.__version__,
        "cuda": build,
        "cudnn": cudnn,
        "cuda_available": device_layer.cuda_hardware_available(),
    }
    gpus = _visible_gpu_count()
    if build is None and gpus:
        return Check(
            "torch_build",
            "fail",
            f"{value}, but the driver shows {gpus} visible GPU(s)",
            "install a CUDA wheel: pip install torch --index-url https://download.pytorch.org/whl/cu124 "
            "(pick the CUDA version the driver supports, see cuda_driver)",
            details,
        )
    if build is not None and not device_layer.cuda_hardware_available():
        if gpus:
            return Check(
                "torch_build",
                "fail",
                f"{value}, the driver shows {gpus} visible GPU(s) but CUDA is not available",
                "see cuda_driver (a driver too old for the build) and CUDA_VISIBLE_DEVICES",
                details,
            )
        return Check("torch_build", "info", f"{value}; no visible GPU, so it runs on the CPU", details=details)
    return Check("torch_build", "ok" if build else "info", value, details=details)


@_guarded("cuda_driver")
def check_cuda_driver() -> Check:
    """The driver's CUDA version (NVML) against ``torch.version.cuda``."""
    with nvml_session() as (lib, _why):
        if lib is None:
            return cuda_driver_check(torch.version.cuda, None)
        return cuda_driver_check(
            torch.version.cuda,
            *driver_versions(lib),
        )


def arch_support(capability: tuple[int, int], arch_list: list[str]) -> str:
    """How the wheel runs on a GPU of ``capability``: "native" (a cubin for it or an earlier minor
    of its major), "ptx" (JIT-compiled from PTX at start-up) or "none".

    Example::

        >>> arch_support((8, 6), ["sm_80", "sm_90"]), arch_support((12, 0), ["sm_90", "compute_90"])
        ('native', 'ptx')
        >>> arch_support((12, 0), ["sm_80", "sm_90"])
        'none'
    """
    major, minor = capability
    native = ptx = False
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
        if match is None:
            continue
        kind, arch_major, arch_minor = match.group(1), int(match.group(2)), int(match.group(3))
        if kind == "sm" and arch_major == major and arch_minor <= minor and not arch.endswith(("a", "f")):
            native = True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            ptx = True
    return "native" if native else "ptx" if ptx else "none"


@_guarded("gpu_arch")
def check_gpu_architecture() -> Check:
    """Each CUDA device's compute capability against the kernels in the wheel."""
    if not device_layer.cuda_hardware_available():
        return Check("gpu_arch", "info", "no CUDA device")
    arch_list = device_layer.cuda_arch_list()
    found, worst = [], "native"
    for index in range(device_layer.cuda_device_count()):
        capability = device_layer.device_for(index).capabilities.compute_capability or (0, 0)
        support = arch_support(capability, arch_list)
        found.append(f"cuda:{index} sm_{capability[0]}{capability[1]} ({support})")
        worst = max(worst, support, key=["native", "ptx", "none"].index)
    value = f"{', '.join(found)}; wheel has {' '.join(arch_list)}"
    details = {"devices": found, "arch_list": arch_list}
    if worst == "none":
        return Check(
            "gpu_arch",
            "fail",
            value,
            "this torch wheel has no kernels for the GPU: install a newer "
            "torch built for its architecture (e.g. a cu128 wheel for Blackwell sm_100/sm_120)",
            details,
        )
    if worst == "ptx":
        return Check(
            "gpu_arch",
            "warn",
            value,
            "kernels are JIT-compiled from PTX at start-up (slow first steps); "
            "install a wheel with native kernels for the GPU",
            details,
        )
    return Check("gpu_arch", "ok", value, details=details)


# ----------------------------------------------------------------------------- GPUs and their processes


_NO_GPU_FIX = (
    "training runs on the CPU; on a GPU machine install the NVIDIA driver, run containers with "
    "`--gpus all`, and check CUDA_VISIBLE_DEVICES"
)


_UNREADABLE_FIX = (
    "NVML could not read GPU(s) {gpus}: NoPermission means this user may not query the device "
    "(run as a user in the video group, or ask the admin), other errors: check nvidia-smi and "
    "the driver's logs"
)


def _gpu_row(lib: Any, gpu: NvmlDevice) -> tuple[str, dict[str, Any]]:
    """The text and the details of one GPU; an NVML error on it is reported in both, not raised."""
    hidden = "" if gpu.visible else " [hidden by CUDA_VISIBLE_DEVICES]"
    detail: dict[str, Any] = {
        "index": gpu.index,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "visible": gpu.visible,
        "memory_used_bytes": None,
        "memory_total_bytes": None,
        "utilization_percent": None,
    }
    error = gpu.error
    if gpu.handle is not None and error is None:
        try:
            memory = memory_info(lib, gpu.handle)
        except lib.NVMLError as failure:
            error = error_text(failure)
        else:
            util = utilisation_percent(lib, gpu.handle)
            detail.update(
                memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total), utilization_percent=util
            )
            return (
                f"{gpu.index}: {gpu.name}, {memory.used / _GIB:.1f}/{memory.total / _GIB:.1f} GiB used, "
                f"{'n/a' if util is None else util}% busy{hidden}"
            ), detail
    detail["error"] = error
    return f"{gpu.index}: {gpu.name or 'unknown GPU'}, not readable ({error}){hidden}", detail


def _is_busy(detail: dict[str, Any]) -> bool:
    used, total = detail["memory_used_bytes"], detail["memory_total_bytes"]
    memory_full = used is not None and total and used > BUSY_MEMORY_FRACTION * total
    return bool(detail["visible"] and ((detail["utilization_percent"] or 0) > BUSY_UTILISATION or memory_full))


@_guarded("gpus")
def check_gpus() -> Check:
    """The GPUs NVML shows, their visibility, memory and utilisation now; a GPU NVML cannot read
    is reported (a "warn" when visible) and the others are still checked."""
    with nvml_session() as (lib, why):
        if lib is None:
            if device_layer.cuda_hardware_available():
                names = [device_layer.device_for(i).name for i in range(device_layer.cuda_device_count())]
                return Check("gpus", "info", f"{', '.join(names)} (NVML unavailable: {why})")
            return Check("gpus", "warn", f"no GPU visible: {why}", _NO_GPU_FIX, {"count": 0})
        rows, details = [], []
        for gpu in nvml_devices(lib):
            row, detail = _gpu_row(lib, gpu)
            rows.append(row)
            details.append(detail)
    value = "; ".join(rows) or "the driver shows no GPU"
    if not any(gpu["visible"] for gpu in details):
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        return Check(
            "gpus", "warn", f"{value}; none visible (CUDA_VISIBLE_DEVICES={env!r})", _NO_GPU_FIX, {"gpus": details}
        )
    busy = [str(gpu["index"]) for gpu in details if _is_busy(gpu)]
    unreadable = [str(gpu["index"]) for gpu in details if gpu["visible"] and gpu.get("error")]
    fixes = []
    if busy:
        fixes.append(
            f"GPU(s) {', '.join(busy)} are busy before training starts: another job shares them (see "
            "gpu_processes); pick a free one with CUDA_VISIBLE_DEVICES"
        )
    if unreadable:
        fixes.append(_UNREADABLE_FIX.format(gpus=", ".join(unreadable)))
    if fixes:
        return Check("gpus", "warn", value, "; ".join(fixes), {"gpus": details})
    return Check("gpus", "ok", value, details={"gpus": details})


def _gpu_processes(lib: Any, gpu: NvmlDevice) -> list[dict[str, Any]]:
    """Other processes computing on ``gpu`` (its MIG instances' included); NVML's errors propagate."""
    others = []
    for process in compute_processes(lib, gpu.handle):
        if process.pid == os.getpid():
            continue
        used = getattr(process, "usedGpuMemory", None)
        others.append(
            {
                "gpu": gpu.index,
                "pid": int(process.pid),
                "name": process_name(lib, process.pid),
                "memory_bytes": None if used is None else int(used),
            }
        )
    return others


@_guarded("gpu_processes")
def check_gpu_processes() -> Check:
    """Other processes computing on the visible GPUs, and the memory they hold; a GPU NVML cannot
    read is named (a "warn") and the others are still checked."""
    with nvml_session() as (lib, why):
        if lib is None:
            return Check("gpu_processes", "info", f"no GPU ({why})")
        others, unreadable = [], []
        for gpu in (gpu for gpu in nvml_devices(lib) if gpu.visible):
            try:
                if gpu.error is None:
                    others.extend(_gpu_processes(lib, gpu))
            except lib.NVMLError as error:
                gpu.error = error_text(error)
            if gpu.error is not None:
                unreadable.append(f"GPU {gpu.index}: {gpu.error}")
    gap = f"processes not readable on {'; '.join(unreadable)}"
    gap_fix = "run `nvidia-smi` as a user allowed to see the GPUs' processes (or as root)"
    if not others:
        if unreadable:
            return Check(
                "gpu_processes",
                "warn",
                f"no other process on the readable GPUs; {gap}",
                gap_fix,
                {"processes": [], "unreadable": unreadable},
            )
        return Check("gpu_processes", "ok", "no other process computes on the visible GPUs")
    text = "; ".join(
        f"GPU {p['gpu']}: pid {p['pid']} ({p['name']})"
        + ("" if p["memory_bytes"] is None else f" holds {p['memory_bytes'] / _GIB:.1f} GiB")
        for p in others
    )
    fix = (
        "these processes share the GPU's memory and compute with training: stop them or pick another GPU with "
        "CUDA_VISIBLE_DEVICES"
    )
    details: dict[str, Any] = {"processes": others}
    if unreadable:
        text, fix, details["unreadable"] = f"{text}; {gap}", f"{fix}; {gap_fix}", unreadable
    return Check("gpu_processes", "warn", text, fix, details)


# ----------------------------------------------------------------------------- matmul benchmark


@dataclass(frozen=True)
class CardPeaks:
    """Dense (no sparsity) peak matmul TFLOP/s of a card from its datasheet; ``None``: not supported."""

    card: str
    fp32: float
    tf32: Optional[float]
    bf16: Optional[float]


# Dense peaks from NVIDIA's datasheets (they print tensor-core figures "with sparsity"; dense is half):
# A100 SXM4/PCIe datasheet: FP32 19.5, TF32 156, BF16 312.
# H100 datasheet: SXM FP32 67, TF32 989* -> 494.7, BF16 1,979* -> 989.4;
#   PCIe FP32 51, TF32 756* -> 378, BF16 1,513* -> 756; NVL FP32 60, TF32 835* -> 417.5, BF16 1,671* -> 835.5.
# H200 datasheet: SXM as H100 SXM (67 / 989* / 1,979*); NVL as H100 NVL (60 / 835* / 1,671*).
# L4 datasheet: FP32 30.3, TF32 120* -> 60, BF16 242* -> 121.
# L40S datasheet: FP32 91.6, TF32 366* -> 183, BF16 733* -> 362.
# A10 datasheet: FP32 31.2, TF32 125* -> 62.5, BF16 250* -> 125.
# V100 datasheet: SXM2 FP32 15.7, PCIe 14; no TF32, no BF16 tensor cores (FP16 only).
# Ada whitepaper (RTX 4090): FP32 82.6, TF32 82.6, BF16 with FP32 accumulate 165.2.
# Ampere GA102 whitepaper (RTX 3090): FP32 35.6, TF32 35.6, BF16 with FP32 accumulate 71.
# T4 datasheet: FP32 8.1; no TF32, no BF16 (FP16 65).
# Not Lightning's `lightning.fabric.utilities.throughput.get_available_flops`: it reads the card through
# torch.cuda itself (so neither our device layer nor a simulated card can answer it), does not match a card
# named "NVIDIA H200" (None, checked with Lightning 2.6.6), and its H200 and H100 NVL rows are sparse or
# two-card figures (TF32 990 and 989.4 TFLOPS against the dense 494.7 and 417.5 a matmul can reach).
#: (pattern on the card's name, peaks); the first match wins
CARD_PEAKS: list[tuple[str, CardPeaks]] = [
    (r"H200 NVL", CardPeaks("H200 NVL", 60.0, 417.5, 835.5)),
    (r"H200", CardPeaks("H200 SXM", 67.0, 494.7, 989.4)),
    (r"H100 NVL", CardPeaks("H100 NVL", 60.0, 417.5, 835.5)),
    (r"H100 PCIe", CardPeaks("H100 PCIe", 51.0, 378.0, 756.0)),
    (r"H100", CardPeaks("H100 SXM", 67.0, 494.7, 989.4)),
    (r"A100", CardPeaks("A100", 19.5, 156.0, 312.0)),
    (r"L40S", CardPeaks("L40S", 91.6, 183.0, 362.0)),
    (r"\bL4\b", CardPeaks("L4", 30.3, 60.0, 121.0)),
    (r"\bA10\b", CardPeaks("A10", 31.2, 62.5, 125.0)),
    (r"V100.*PCIE", CardPeaks("V100 PCIe", 14.0, None, None)),
    (r"V100", CardPeaks("V100 SXM2", 15.7, None, None)),
    (r"RTX 4090", CardPeaks("RTX 4090", 82.6, 82.6, 165.2)),
    (r"RTX 3090", CardPeaks("RTX 3090", 35.6, 35.6, 71.0)),
    (r"\bT4\b", CardPeaks("T4", 8.1, None, None)),
]


def card_peaks(device_name: str) -> Optional[CardPeaks]:
    """The datasheet peaks of a GPU by its name, ``None`` for a card not in :data:`CARD_PEAKS`.

    Example::

        >>> card_peaks("NVIDIA A100-SXM4-80GB").tf32, card_peaks("NVIDIA A10").card, card_peaks("Radeon")
        (156.0, 'A10', None)
    """
    for pattern, peaks in CARD_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return peaks
    return None


def _synchronize(device: torch.device) -> None:
    device_layer.device_for(device).synchronize()


@contextlib.contextmanager
def _float32_matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def matmul_flops(size: int, dtype: torch.dtype, device: torch.device | str, seconds: float) -> float:
    """Achieved FLOP/s of ``size x size`` matmuls over about ``seconds`` (one warm-up excluded).

    Example::

        >>> matmul_flops(64, torch.float32, "cpu", seconds=0.01) > 0
        True
    """
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.matmul(a, b)  # warm-up: kernel choice, clocks
    _synchronize(device)
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    _synchronize(device)
    one = max(time.perf_counter() - start, 1e-6)
    repeats = max(1, min(10_000, int(seconds / one)))
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    return 2.0 * size**3 * repeats / elapsed


def _gpu_matmul_check(seconds: float, size: int) -> Check:
    card = device_layer.device_for(0)
    device = card.torch_device
    name = card.name
    peaks = card_peaks(name)
    kinds = ["fp32"]
    if card.capabilities.tf32:
        kinds += ["tf32", "bf16"]
    achieved: dict[str, float] = {}
    for kind in kinds:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        with _float32_matmul_precision("high" if kind == "tf32" else "highest"):
            achieved[kind] = matmul_flops(size, dtype, device, seconds / len(kinds)) / 1e12
    parts, low = [], []
    for kind, tflops in achieved.items():
        peak = None if peaks is None else getattr(peaks, kind)
        if peak:
            parts.append(f"{kind} {tflops:.1f} TFLOP/s ({tflops / peak:.0%} of {peak:g})")
            if tflops < MATMUL_WARN_FRACTION * peak:
                low.append(kind)
        else:
            parts.append(f"{kind} {tflops:.1f} TFLOP/s")
    datasheet = "unknown card, no datasheet figures" if peaks is None else f"datasheet: {peaks.card}, dense"
    value = f"cuda:0 {name} ({datasheet}): {', '.join(parts)}; {size}x{size}"
    details = {
        "device": name,
        "card": None if peaks is None else peaks.card,
        "size": size,
        "tflops": achieved,
        "peak_tflops": None if peaks is None else {kind: getattr(peaks, kind) for kind in achieved},
    }
    if peaks is None:
        return Check("matmul", "info", value, details=details)
    if low:
        return Check(
            "matmul",
            "warn",
            value,
            f"{', '.join(low)} below {MATMUL_WARN_FRACTION:.0%} of the datasheet "
            "peak: check clocks, power and throttle reasons (nvidia-smi -q -d PERFORMANCE,CLOCK), other "
            "processes on the GPU, a MIG slice; a cold GPU reads low in short runs, so rerun with more "
            "seconds",
            details,
        )
    return Check("matmul", "ok", value, details=details)


def _cpu_matmul_check(seconds: float, size: int) -> Check:
    achieved: dict[str, Optional[float]] = {"fp32": None, "bf16": None}
    with _float32_matmul_precision("highest"):
        achieved["fp32"] = matmul_flops(size, torch.float32, "cpu", seconds / 2) / 1e9
    with contextlib.suppress(RuntimeError):
        achieved["bf16"] = matmul_flops(size, torch.bfloat16, "cpu", seconds / 2) / 1e9
    parts = [f"{kind} {gflops:.1f} GFLOP/s" for kind, gflops in achieved.items() if gflops is not None]
    value = f"CPU, no GPU: {', '.join(parts)} with {torch.get_num_threads()} thread(s); {size}x{size}"
    details = {"device": "cpu", "size": size, "gflops": achieved, "threads": torch.get_num_threads()}
    return Check("matmul", "info", value, details=details)


@_guarded("matmul")
def check_matmul(seconds: float = 2.0) -> Check:
    """A short matmul benchmark: TFLOP/s vs the card's datasheet on a GPU, GFLOP/s on the CPU.

    ``seconds`` is the time over all dtypes (a warm-up and one timing run more per dtype);
    0 skips the benchmark.
    """
    if seconds <= 0:
        return Check("matmul", "info", "skipped")
    if device_layer.cuda_hardware_available():
        try:
            return _gpu_matmul_check(seconds, size=8192 if seconds >= 1 else 4096)
        except RuntimeError as error:  # e.g. "no kernel image is available", OOM: the finding itself
            return Check(
                "matmul",
                "fail",
                f"a matmul on cuda:0 failed: {type(error).__name__}: {error}",
                "see gpu_arch and gpus (memory held by other processes)",
            )
    return _cpu_matmul_check(seconds, size=1024 if seconds >= 1 else 512)


# ----------------------------------------------------------------------------- CPU


def cpu_cores_check(count: int, affinity: int, quota: Optional[float]) -> Check:
    """Compare the machine's cores, the process's affinity and the cgroup quota.

    Example::

        >>> cpu_cores_check(count=64, affinity=64, quota=4.0).status
        'warn'
        >>> cpu_cores_check(count=64, affinity=8, quota=None).value
        "8 of 64 cores in this process's CPU affinity"
    """
    details = {"cpu_count": count, "affinity": affinity, "cgroup_quota": quota}
    if quota is not None and quota < affinity:
        return Check(
            "cpu_cores",
            "warn",
            f"{count} cores, {affinity} in the affinity, but a cgroup quota of {quota:g} cores",
            f"size torch threads (OMP_NUM_THREADS={max(1, math.floor(quota))}) and "
            f"num_workers (<= {max(1, math.floor(quota) - 1)}) to the quota, not to os.cpu_count(), "
            "or raise the container's CPU limit: beyond it the process is throttled",
            details,
        )
    if affinity < count:
        return Check(
            "cpu_cores",
            "info",
            f"{affinity} of {count} cores in this process's CPU affinity",
            f"size torch threads and num_workers to {affinity} (len(os.sched_getaffinity(0))), not to os.cpu_count()",
            details,
        )
    return Check("cpu_cores", "ok", f"{count} cores", details=details)


@_guarded("cpu_cores")
def check_cpu_cores() -> Check:
    """``os.cpu_count()`` against the CPU affinity and the cgroup quota."""
    return cpu_cores_check(os.cpu_count() or 1, usable_cpu_count(within_quota=False), cgroup_cpu_quota())


def local_processes() -> int:
    """Training processes on this host, from the launcher's environment (``LOCAL_WORLD_SIZE`` of
    torchrun/Lightning, ``SLURM_NTASKS_PER_NODE``); 1 without one."""
    for variable in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        text = os.environ.get(variable, "").split("(")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def torch_threads_check(threads: int, cores: int, processes: int = 1) -> Check:
    """Intra-op threads times processes on the host against the usable cores.

    Example::

        >>> torch_threads_check(threads=4, cores=16, processes=8).fix
        'torch.set_num_threads(2) (or OMP_NUM_THREADS=2) in each process'
        >>> torch_threads_check(threads=4, cores=4).status
        'ok'
    """
    total = threads * processes
    per_process = max(1, cores // processes)
    who = f"{threads} intra-op thread(s)"
    if processes > 1:
        who = f"{processes} process(es) x {who}"
    details = {
        "threads": threads,
        "cores": cores,
        "processes": processes,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if total > cores:
        return Check(
            "torch_threads",
            "warn",
            f"oversubscribed: {who} = {total} on {cores} core(s)",
            f"torch.set_num_threads({per_process}) (or OMP_NUM_THREADS={per_process}) in each process",
            details,
        )
    if total * 2 <= cores:
        return Check(
            "torch_threads",
            "info",
            f"{who} on {cores} core(s): CPU ops use {total} of them",
            f"if CPU ops bound the step: torch.set_num_threads({per_process})",
            details,
        )
    return Check("torch_threads", "ok", f"{who} on {cores} core(s)", details=details)


@_guarded("torch_threads")
def check_torch_threads() -> Check:
    """``torch.get_num_threads()`` x local processes against the usable cores: the affinity within the
    cgroup quota (:func:`~lightning_gpuopt.core.loader.usable_cpu_count`)."""
    return torch_threads_check(torch.get_num_threads(), usable_cpu_count(), local_processes())


# ----------------------------------------------------------------------------- BLAS

_BLAS_NAMES = {
    "mkl": "MKL",
    "open": "OpenBLAS",
    "openblas": "OpenBLAS",
    "accelerate": "Accelerate",
    "flexi": "FlexiBLAS",
    "blis": "BLIS",
    "atlas": "ATLAS",
    "nvpl": "NVPL",
    "armpl": "ArmPL",
}


def torch_blas(config: str) -> str:
    """The BLAS library named in ``torch.__config__.show()``'s build settings.

    Example::

        >>> torch_blas("  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, USE_MKL=ON, ")
        'MKL'
        >>> torch_blas("Build settings: BLAS_INFO=open, USE_MKL=OFF"), torch_blas("nothing")
        ('OpenBLAS', 'none')
    """
    match = re.search(r"BLAS_INFO=(\w+)", config)
    if match:
        return _BLAS_NAMES.get(match.group(1).lower(), match.group(1))
    if re.search(r"USE_MKL=ON", config):
        return "MKL"
    return "none"


def numpy_blas() -> Optional[str]:
    """The BLAS NumPy was built with (``"scipy-openblas 0.3.27"``); ``None`` without NumPy or the info."""
    try:
        import numpy
    except ImportError:
        return None
    try:
        config = numpy.show_config(mode="dicts")  # NumPy >= 1.26: returns, does not print
    except TypeError:
        return None
    blas = (config or {}).get("Build Dependencies", {}).get("blas", {})
    if not blas.get("name"):
        return None
    return f"{blas['name']} {blas.get('version', '')}".strip()


@_guarded("blas")
def check_blas() -> Check:
    """The BLAS libraries of torch and NumPy."""
    torch_lib = torch_blas(torch.__config__.show())
    numpy_lib = numpy_blas()
    value = f"torch: {torch_lib}; numpy: {numpy_lib or 'not installed or unknown'}"
    details = {"torch": torch_lib, "numpy": numpy_lib}
    if torch_lib == "none":
        return Check(
            "blas",
            "warn",
            value,
            "torch was built without a BLAS: CPU matmuls are slow; install the official wheel",
            details,
        )
    if numpy_lib and torch_lib.lower() not in numpy_lib.lower():
        return Check(
            "blas",
            "info",
            value + " (two BLAS libraries, each with its own thread pool)",
            "when torch and numpy both compute on the CPU (e.g. in DataLoader workers), cap both: "
            "OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS",
            details,
        )
    return Check("blas", "ok", value, details=details)


# ----------------------------------------------------------------------------- host memory


def _copy_gbps(source: torch.Tensor, device: torch.device) -> float:
    target = torch.empty(source.shape, dtype=source.dtype, device=device)
    card = device_layer.device_for(device)
    target.copy_(source, non_blocking=True)
    card.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        target.copy_(source, non_blocking=True)
    card.synchronize()
    return 3 * source.numel() * source.element_size() / (time.perf_counter() - start) / 1e9


@_guarded("pinned_memory")
def check_pinned_memory(num_bytes: int = 64 * 2**20) -> Check:
    """Allocate ``num_bytes`` of pinned host memory and compare host-to-GPU copies pinned vs pageable."""
    if not device_layer.cuda_hardware_available():
        return Check("pinned_memory", "info", "no CUDA: DataLoader(pin_memory=True) has no GPU copy to speed up")
    try:
        start = time.perf_counter()
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        seconds = time.perf_counter() - start
    except RuntimeError as error:
        return Check(
            "pinned_memory",
            "fail",
            f"pinned memory could not be allocated: {error}",
            "raise the locked-memory limit (ulimit -l unlimited; docker --ulimit memlock=-1) or use "
            "DataLoader(pin_memory=False)",
        )
    device = torch.device("cuda", 0)
    pinned_speed = _copy_gbps(pinned, device)
    pageable_speed = _copy_gbps(torch.empty(num_bytes, dtype=torch.uint8), device)
    value = (
        f"{num_bytes // 2**20} MiB pinned in {seconds * 1e3:.1f} ms; host-to-GPU copies: pinned "
        f"{pinned_speed:.1f} GB/s, pageable {pageable_speed:.1f} GB/s"
    )
    details = {"pinned_gbps": pinned_speed, "pageable_gbps": pageable_speed, "allocate_seconds": seconds}
    return Check("pinned_memory", "ok", value, details=details)


def shared_memory_check(total_bytes: Optional[int], free_bytes: Optional[int], path: str = "/dev/shm") -> Check:
    """Judge the size of the shared-memory filesystem DataLoader workers hand batches through.

    Example::

        >>> shared_memory_check(64 * 2**20, 64 * 2**20).status       # Docker's default 64 MiB
        'warn'
        >>> shared_memory_check(None, None).value
        'no /dev/shm'
    """
    if total_bytes is None or free_bytes is None:
        return Check(
            "shm",
            "warn",
            f"no {path}",
            f"DataLoader workers hand batches over through {path}: mount a tmpfs there, or use num_workers=0",
        )
    value = f"{path}: {total_bytes / _GIB:.2f} GiB, {free_bytes / _GIB:.2f} GiB free"
    details = {"path": path, "total_bytes": total_bytes, "free_bytes": free_bytes}
    fix = (
        "DataLoader workers hand batches over through it and die with 'bus error' or 'No space left on device' "
        "when it fills: docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory "
        "mounted at /dev/shm"
    )
    if total_bytes < SHM_WARN_BYTES:
        return Check("shm", "warn", value + " (small)", fix, details)
    if free_bytes < SHM_WARN_BYTES:
        return Check(
            "shm",
            "warn",
            value + " (nearly full)",
            "free it (stale torch_* files of crashed workers) or make it larger: " + fix.split(": ", 1)[1],
            details,
        )
    return Check("shm", "ok", value, details=details)


@_guarded("shm")
def check_shared_memory(path: str = "/dev/shm") -> Check:
    """The size and free space of ``path`` (``os.statvfs``)."""
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return shared_memory_check(None, None, path)
    return shared_memory_check(stat.f_frsize * stat.f_blocks, stat.f_frsize * stat.f_bavail, path)


# ----------------------------------------------------------------------------- all of them


def run_checks(matmul_seconds: float = 2.0) -> list[Check]:
    """Run every check in order; ``matmul_seconds`` bounds the benchmark (0 skips it).

    The GPU process check runs before the benchmark, which puts this process on the GPU.
    """
    return [
        check_torch_build(),
        check_cuda_driver(),
        check_gpu_architecture(),
        check_gpus(),
        check_gpu_processes(),
        check_matmul(matmul_seconds),
        check_cpu_cores(),
        check_torch_threads(),
        check_blas(),
        check_pinned_memory(),
        check_shared_memory(),
    ]
