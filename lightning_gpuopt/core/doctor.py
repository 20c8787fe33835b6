"""``gpuopt doctor``: the environment checks of :data:`CHECKS`, each a :class:`Check` with a status and a fix.

NVML goes through :mod:`.nvml` (a fake can answer); what needs a real card hands its figures to a pure
``*_check`` function that judges them. :func:`run_check` turns an exception in a check into a "warn".
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from lightning_gpuopt.core import device as device_layer
from lightning_gpuopt.core import nvml
from lightning_gpuopt.core.loader import cgroup_cpu_quota, usable_cpu_count

STATUSES = ("ok", "info", "warn", "fail")  #: statuses from best to worst
SHM_WARN_BYTES = 2**30  #: a ``/dev/shm`` smaller than this (or with less free) is a "warn"
_MATMUL_WARN_FRACTION = 0.4  #: a GPU matmul below this fraction of the card's dense datasheet peak is a "warn"
#: a visible GPU busier than this (% utilisation) or fuller than this (memory fraction) before training is a "warn"
_BUSY_UTILISATION, _BUSY_MEMORY = 20, 0.10
_GIB = 2**30


@dataclass
class Check:
    """One finding: a ``status`` of :data:`STATUSES`, the ``value`` found, the ``fix``, measured ``details``."""

    name: str
    status: str
    value: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def torch_build_check(version: str, build: Optional[str], cudnn: Optional[int], available: bool, gpus: int) -> Check:
    """Judge torch's ``version``, CUDA ``build`` and cuDNN, CUDA being ``available``, and the visible ``gpus``."""
    value = f"torch {version}, CUDA build {build or 'none (CPU-only wheel)'}" + (f", cuDNN {cudnn}" if cudnn else "")
    details = {"torch": version, "cuda": build, "cudnn": cudnn, "cuda_available": available}
    if build is None and gpus:
        fix = "install a CUDA wheel: pip install torch --index-url https://download.pytorch.org/whl/cu124 (pick the CUDA version the driver supports, see cuda_driver)"
        return Check("torch_build", "fail", f"{value}, but the driver shows {gpus} visible GPU(s)", fix, details)
    if build is not None and not available and gpus:
        value += f", the driver shows {gpus} visible GPU(s) but CUDA is not available"
        fix = "see cuda_driver (a driver too old for the build) and CUDA_VISIBLE_DEVICES"
        return Check("torch_build", "fail", value, fix, details)
    if build is not None and not available:
        return Check("torch_build", "info", f"{value}; no visible GPU, so it runs on the CPU", details=details)
    return Check("torch_build", "ok" if build else "info", value, details=details)


def _torch_build() -> Check:
    build = torch.version.cuda
    with nvml.nvml_session() as (lib, _):
        gpus = 0 if lib is None else sum(gpu.visible for gpu in nvml.nvml_devices(lib)[0])
    cudnn = torch.backends.cudnn.version() if build else None
    return torch_build_check(torch.__version__, build, cudnn, device_layer.cuda_hardware_available(), gpus)


def cuda_driver_check(build: Optional[str], driver: Optional[int], driver_release: str = "") -> Check:
    """Compare the CUDA version torch was built for (``"12.4"``) with the driver's (NVML's ``12040``)."""
    if driver is None:
        torch_text = "a CPU-only build" if build is None else f"built for CUDA {build}"
        return Check("cuda_driver", "info", f"no NVIDIA driver; torch is {torch_text}")
    supported = f"{driver // 1000}.{driver % 1000 // 10}"
    value = f"driver supports CUDA {supported}" + (f" (driver {driver_release})" if driver_release else "")
    details = {"driver_cuda": supported, "torch_cuda": build, "driver": driver_release or None}
    if build is None:
        return Check("cuda_driver", "info", f"{value}; torch is a CPU-only build", details=details)
    value += f"; torch built for CUDA {build}"
    have, need = (tuple(int(part) for part in re.findall(r"\d+", text)[:2]) for text in (supported, build))
    if have >= need:
        return Check("cuda_driver", "ok", value, details=details)
    fix = f"install a driver that supports CUDA {build}, or a torch wheel built for CUDA <= {supported} (pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)"
    if have[:1] == need[:1]:
        value += " (older minor: runs by minor-version compatibility, but PTX JIT and newer features can fail)"
        return Check("cuda_driver", "warn", value, fix, details)
    return Check("cuda_driver", "fail", value + ": the driver is too old, CUDA cannot start", fix, details)


def arch_support(capability: tuple[int, int], arch_list: list[str]) -> str:
    """How the wheel runs on a GPU of ``capability``: "native" (a cubin for it or an earlier minor
    of its major), "ptx" (JIT-compiled from PTX at start-up) or "none"."""
    native = ptx = False
    for arch in arch_list:
        if (match := re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)) is not None:
            kind, built = match.group(1), (int(match.group(2)), int(match.group(3)))
            family = built[0] == capability[0] and not arch.endswith(("a", "f"))
            native |= kind == "sm" and family and built <= capability
            ptx |= kind == "compute" and built <= capability
    return "native" if native else "ptx" if ptx else "none"


#: ``arch_support`` -> (status, fix), best first
_ARCH_VERDICTS = {
    "native": ("ok", ""),
    "ptx": ("warn", "kernels are JIT-compiled from PTX at start-up (slow first steps); install a wheel with native kernels for the GPU"),
    "none": ("fail", "this torch wheel has no kernels for the GPU: install a newer torch built for its architecture (e.g. a cu128 wheel for Blackwell sm_100/sm_120)"),
}  # fmt: skip


def gpu_arch_check(capabilities: list[tuple[int, int]], arch_list: list[str]) -> Check:
    """Judge the compute capability of each CUDA device (``cuda:i`` order) against the wheel's ``arch_list``."""
    supports = [arch_support(capability, arch_list) for capability in capabilities]
    found = [f"cuda:{i} sm_{cc[0]}{cc[1]} ({support})" for i, (cc, support) in enumerate(zip(capabilities, supports))]
    status, fix = _ARCH_VERDICTS[max(supports, key=list(_ARCH_VERDICTS).index, default="native")]
    value = f"{', '.join(found)}; wheel has {' '.join(arch_list)}"
    return Check("gpu_arch", status, value, fix, {"devices": found, "arch_list": arch_list})


def _gpu_arch() -> Check:
    if not device_layer.cuda_hardware_available():
        return Check("gpu_arch", "info", "no CUDA device")
    count = device_layer.cuda_device_count()
    capabilities = [device_layer.device_for(i).capabilities.compute_capability or (0, 0) for i in range(count)]
    return gpu_arch_check(capabilities, device_layer.cuda_arch_list())


_NO_GPU_FIX = "training runs on the CPU; on a GPU machine install the NVIDIA driver, run containers with `--gpus all`, and check CUDA_VISIBLE_DEVICES"


def _gpu_reading(lib: Any, gpu: nvml.NvmlDevice) -> tuple[str, dict[str, Any]]:
    """One GPU's line of the ``gpus`` check and its details; NVML's error on it is in ``error``, not raised."""
    hidden = "" if gpu.visible else " [hidden by CUDA_VISIBLE_DEVICES]"
    reading = {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "visible": gpu.visible}
    try:
        if gpu.error is None:
            util, used, total = nvml.read_usage(lib, gpu.handle)
            text = f"{gpu.index}: {gpu.name}, {used / _GIB:.1f}/{total / _GIB:.1f} GiB used, {'n/a' if util is None else util}% busy{hidden}"
            return text, reading | {"memory_used_bytes": used, "memory_total_bytes": total, "utilization_percent": util}
    except lib.NVMLError as error:
        gpu.error = nvml.error_text(error)
    text = f"{gpu.index}: {gpu.name or 'unknown GPU'}, not readable ({gpu.error}){hidden}"
    unread = dict.fromkeys(("memory_used_bytes", "memory_total_bytes", "utilization_percent"))
    return text, reading | unread | {"error": gpu.error}


def _gpus() -> Check:
    with nvml.nvml_session() as (lib, why):
        rows = None if lib is None else [_gpu_reading(lib, gpu) for gpu in nvml.nvml_devices(lib)[0]]
    if rows is None:
        if device_layer.cuda_hardware_available():
            names = [device_layer.device_for(i).name for i in range(device_layer.cuda_device_count())]
            return Check("gpus", "info", f"{', '.join(names)} (NVML unavailable: {why})")
        return Check("gpus", "warn", f"no GPU visible: {why}", _NO_GPU_FIX, {"count": 0})
    value, gpus = "; ".join(text for text, _ in rows) or "the driver shows no GPU", [gpu for _, gpu in rows]
    visible = [gpu for gpu in gpus if gpu["visible"]]
    if not visible:
        value += f"; none visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        return Check("gpus", "warn", value, _NO_GPU_FIX, {"gpus": gpus})
    hot = [g for g in visible if (g["utilization_percent"] or 0) > _BUSY_UTILISATION]
    full = [g for g in visible if (g["memory_used_bytes"] or 0) > _BUSY_MEMORY * (g["memory_total_bytes"] or 0)]
    busy = ", ".join(str(g["index"]) for g in visible if g in hot or g in full)
    unreadable = ", ".join(str(gpu["index"]) for gpu in visible if gpu.get("error"))
    busy_fix = f"GPU(s) {busy} are busy before training starts: another job shares them (see gpu_processes); pick a free one with CUDA_VISIBLE_DEVICES"
    unreadable_fix = f"NVML could not read GPU(s) {unreadable}: NoPermission means this user may not query the device (run as a user in the video group, or ask the admin), other errors: check nvidia-smi and the driver's logs"
    fix = "; ".join(text for text, found in ((busy_fix, busy), (unreadable_fix, unreadable)) if found)
    return Check("gpus", "warn" if fix else "ok", value, fix, {"gpus": gpus})


def _gpu_processes() -> Check:
    others: list[dict[str, Any]] = []
    unreadable: list[str] = []
    with nvml.nvml_session() as (lib, why):
        if lib is None:
            return Check("gpu_processes", "info", f"no GPU ({why})")
        for gpu in (gpu for gpu in nvml.nvml_devices(lib)[0] if gpu.visible):
            try:
                processes = [] if gpu.error else nvml.compute_processes(lib, gpu.handle)
                others += [{"gpu": gpu.index, **process} for process in processes if process["pid"] != os.getpid()]
            except lib.NVMLError as error:
                gpu.error = nvml.error_text(error)
            if gpu.error is not None:
                unreadable.append(f"GPU {gpu.index}: {gpu.error}")
    if not others and not unreadable:
        return Check("gpu_processes", "ok", "no other process computes on the visible GPUs")
    held = (f" holds {p['memory_bytes'] / _GIB:.1f} GiB" if p["memory_bytes"] is not None else "" for p in others)
    parts = [f"GPU {p['gpu']}: pid {p['pid']} ({p['name']}){text}" for p, text in zip(others, held)]
    parts = parts or ["no other process on the readable GPUs"]
    shared_fix = "these processes share the GPU's memory and compute with training: stop them or pick another GPU with CUDA_VISIBLE_DEVICES"
    gap_fix = "run `nvidia-smi` as a user allowed to see the GPUs' processes (or as root)"
    fix = "; ".join(text for text, found in ((shared_fix, others), (gap_fix, unreadable)) if found)
    parts += [f"processes not readable on {'; '.join(unreadable)}"] if unreadable else []
    details = {"processes": others, "unreadable": unreadable} if unreadable else {"processes": others}
    return Check("gpu_processes", "warn", "; ".join(parts), fix, details)


class CardPeaks(NamedTuple):
    """Dense (no sparsity) peak matmul TFLOP/s of a card from its datasheet; ``None``: not supported."""

    card: str
    fp32: float
    tf32: Optional[float]
    bf16: Optional[float]


#: (pattern on the card's name, peaks), the first match wins: NVIDIA's datasheets (tensor-core figures with sparsity
#: halved) and whitepapers (RTX); not Lightning's `get_available_flops`, which has sparse H200/H100 NVL rows
_CARD_PEAKS: list[tuple[str, CardPeaks]] = [
    (r"H200 NVL", CardPeaks("H200 NVL", 60.0, 417.5, 835.5)),     (r"H200", CardPeaks("H200 SXM", 67.0, 494.7, 989.4)),
    (r"H100 NVL", CardPeaks("H100 NVL", 60.0, 417.5, 835.5)),     (r"H100 PCIe", CardPeaks("H100 PCIe", 51.0, 378.0, 756.0)),
    (r"H100", CardPeaks("H100 SXM", 67.0, 494.7, 989.4)),         (r"A100", CardPeaks("A100", 19.5, 156.0, 312.0)),
    (r"L40S", CardPeaks("L40S", 91.6, 183.0, 362.0)),             (r"\bL4\b", CardPeaks("L4", 30.3, 60.0, 121.0)),
    (r"\bA10\b", CardPeaks("A10", 31.2, 62.5, 125.0)),            (r"V100.*PCIE", CardPeaks("V100 PCIe", 14.0, None, None)),
    (r"V100", CardPeaks("V100 SXM2", 15.7, None, None)),          (r"RTX 4090", CardPeaks("RTX 4090", 82.6, 82.6, 165.2)),
    (r"RTX 3090", CardPeaks("RTX 3090", 35.6, 35.6, 71.0)),       (r"\bT4\b", CardPeaks("T4", 8.1, None, None)),
]  # fmt: skip


def card_peaks(device_name: str) -> Optional[CardPeaks]:
    """The datasheet peaks of a GPU by its name, ``None`` for a card not in the table."""
    return next((peaks for pattern, peaks in _CARD_PEAKS if re.search(pattern, device_name, re.IGNORECASE)), None)


def gpu_matmul_check(name: str, tflops: dict[str, float], size: int) -> Check:
    """Judge the TFLOP/s per dtype of ``size x size`` matmuls on ``cuda:0``, a card called ``name``."""
    peaks = card_peaks(name)
    parts, low = [], []
    for kind, achieved in tflops.items():
        peak = None if peaks is None else getattr(peaks, kind)
        parts.append(f"{kind} {achieved:.1f} TFLOP/s" + (f" ({achieved / peak:.0%} of {peak:g})" if peak else ""))
        if peak and achieved < _MATMUL_WARN_FRACTION * peak:
            low.append(kind)
    datasheet = "unknown card, no datasheet figures" if peaks is None else f"datasheet: {peaks.card}, dense"
    value = f"cuda:0 {name} ({datasheet}): {', '.join(parts)}; {size}x{size}"
    peak_tflops = None if peaks is None else {kind: getattr(peaks, kind) for kind in tflops}
    details = dict(device=name, card=peaks and peaks.card, size=size, tflops=tflops, peak_tflops=peak_tflops)
    fix = f"{', '.join(low)} below {_MATMUL_WARN_FRACTION:.0%} of the datasheet peak: check clocks, power and throttle reasons (nvidia-smi -q -d PERFORMANCE,CLOCK), other processes on the GPU, a MIG slice; a cold GPU reads low in short runs, so rerun with more seconds"
    return Check("matmul", "info" if peaks is None else "warn" if low else "ok", value, fix if low else "", details)


def _timed(card: device_layer.Device, repeats: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds ``repeats`` calls take once the device is idle, to the end of their work on it."""
    card.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call(*args, **kwargs)
    card.synchronize()
    return time.perf_counter() - start


def _matmul_flops(kind: str, size: int, device: torch.device | str, seconds: float) -> float:
    """Achieved FLOP/s of ``size x size`` matmuls in ``kind`` (fp32, tf32 or bf16) over about ``seconds``."""
    card, precision = device_layer.device_for(device), torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if kind == "tf32" else "highest")
    try:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in "ab")
        out = torch.matmul(a, b)  # warm-up: kernel choice, clocks
        repeats = max(1, min(10_000, int(seconds / max(_timed(card, 1, torch.matmul, a, b, out=out), 1e-6))))
        return 2.0 * size**3 * repeats / _timed(card, repeats, torch.matmul, a, b, out=out)
    finally:
        torch.set_float32_matmul_precision(precision)


def _matmul(seconds: float = 2.0) -> Check:
    """TFLOP/s against the card's datasheet on a GPU, GFLOP/s on the CPU, over about ``seconds``; 0 skips it."""
    if seconds <= 0:
        return Check("matmul", "info", "skipped")
    if device_layer.cuda_hardware_available():
        size = 8192 if seconds >= 1 else 4096
        try:
            card = device_layer.device_for(0)
            kinds = ["fp32", "tf32", "bf16"] if card.capabilities.tf32 else ["fp32"]
            tflops = {kind: _matmul_flops(kind, size, card.torch_device, seconds / len(kinds)) / 1e12 for kind in kinds}
            return gpu_matmul_check(card.name, tflops, size)
        except RuntimeError as error:  # e.g. "no kernel image is available", OOM: the finding itself
            fix = "see gpu_arch and gpus (memory held by other processes)"
            return Check("matmul", "fail", f"a matmul on cuda:0 failed: {nvml.error_text(error)}", fix)
    size = 1024 if seconds >= 1 else 512
    gflops: dict[str, Optional[float]] = {"fp32": _matmul_flops("fp32", size, "cpu", seconds / 2) / 1e9, "bf16": None}
    with contextlib.suppress(RuntimeError):
        gflops["bf16"] = _matmul_flops("bf16", size, "cpu", seconds / 2) / 1e9
    parts = ", ".join(f"{kind} {value:.1f} GFLOP/s" for kind, value in gflops.items() if value is not None)
    threads = torch.get_num_threads()
    value = f"CPU, no GPU: {parts} with {threads} thread(s); {size}x{size}"
    return Check("matmul", "info", value, details={"device": "cpu", "size": size, "gflops": gflops, "threads": threads})


def cpu_cores_check(count: int, affinity: int, quota: Optional[float]) -> Check:
    """Compare the machine's cores, the process's affinity and the cgroup quota."""
    details = {"cpu_count": count, "affinity": affinity, "cgroup_quota": quota}
    if quota is not None and quota < affinity:
        cores = max(1, math.floor(quota))
        fix = f"size torch threads (OMP_NUM_THREADS={cores}) and num_workers (<= {max(1, cores - 1)}) to the quota, not to os.cpu_count(), or raise the container's CPU limit: beyond it the process is throttled"
        value = f"{count} cores, {affinity} in the affinity, but a cgroup quota of {quota:g} cores"
        return Check("cpu_cores", "warn", value, fix, details)
    if affinity < count:
        value = f"{affinity} of {count} cores in this process's CPU affinity"
        fix = f"size torch threads and num_workers to {affinity} (len(os.sched_getaffinity(0))), not to os.cpu_count()"
        return Check("cpu_cores", "info", value, fix, details)
    return Check("cpu_cores", "ok", f"{count} cores", details=details)


def torch_threads_check(threads: int, cores: int, processes: int = 1) -> Check:
    """Intra-op threads times processes on the host against the usable cores."""
    total, per_process = threads * processes, max(1, cores // processes)
    who = (f"{processes} process(es) x " if processes > 1 else "") + f"{threads} intra-op thread(s)"
    details = dict(threads=threads, cores=cores, processes=processes, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    if total > cores:
        fix = f"torch.set_num_threads({per_process}) (or OMP_NUM_THREADS={per_process}) in each process"
        return Check("torch_threads", "warn", f"oversubscribed: {who} = {total} on {cores} core(s)", fix, details)
    if total * 2 <= cores:
        fix = f"if CPU ops bound the step: torch.set_num_threads({per_process})"
        return Check("torch_threads", "info", f"{who} on {cores} core(s): CPU ops use {total} of them", fix, details)
    return Check("torch_threads", "ok", f"{who} on {cores} core(s)", details=details)


def _torch_threads() -> Check:
    """Torch threads x the launcher's processes on this host (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``)."""
    counts = (os.environ.get(name, "").split("(")[0] for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"))
    processes = next((int(text) for text in counts if text.isdigit() and int(text) > 0), 1)
    return torch_threads_check(torch.get_num_threads(), usable_cpu_count(), processes)


_BLAS_NAMES = {"mkl": "MKL", "open": "OpenBLAS", "openblas": "OpenBLAS", "accelerate": "Accelerate", "flexi": "FlexiBLAS", "blis": "BLIS", "atlas": "ATLAS", "nvpl": "NVPL", "armpl": "ArmPL"}  # fmt: skip


def torch_blas(config: str) -> str:
    """The BLAS library named in ``torch.__config__.show()``'s build settings.
    >>> torch_blas("Build settings: BLAS_INFO=open, USE_MKL=OFF"), torch_blas("USE_MKL=ON"), torch_blas("nothing")
    ('OpenBLAS', 'MKL', 'none')
    """
    if match := re.search(r"BLAS_INFO=(\w+)", config):
        return _BLAS_NAMES.get(match.group(1).lower(), match.group(1))
    return "MKL" if "USE_MKL=ON" in config else "none"


def _blas() -> Check:
    torch_lib, numpy_lib = torch_blas(torch.__config__.show()), None
    with contextlib.suppress(ImportError, TypeError, KeyError):  # NumPy >= 1.26 returns its configuration
        import numpy

        numpy_blas = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
        numpy_lib = f"{numpy_blas['name']} {numpy_blas.get('version', '')}".strip() if numpy_blas.get("name") else None
    value = f"torch: {torch_lib}; numpy: {numpy_lib or 'not installed or unknown'}"
    details = {"torch": torch_lib, "numpy": numpy_lib}
    if torch_lib == "none":
        fix = "torch was built without a BLAS: CPU matmuls are slow; install the official wheel"
        return Check("blas", "warn", value, fix, details)
    if numpy_lib and torch_lib.lower() not in numpy_lib.lower():
        fix = "when torch and numpy both compute on the CPU (e.g. in DataLoader workers), cap both: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS"
        return Check("blas", "info", value + " (two BLAS libraries, each with its own thread pool)", fix, details)
    return Check("blas", "ok", value, details=details)


def pinned_memory_check(num_bytes: int, seconds: float, pinned_gbps: float, pageable_gbps: float) -> Check:
    """Report ``num_bytes`` of pinned host memory allocated in ``seconds`` and host-to-GPU copy speeds."""
    value = f"{num_bytes // 2**20} MiB pinned in {seconds * 1e3:.1f} ms; host-to-GPU copies: pinned {pinned_gbps:.1f} GB/s, pageable {pageable_gbps:.1f} GB/s"
    details = {"pinned_gbps": pinned_gbps, "pageable_gbps": pageable_gbps, "allocate_seconds": seconds}
    return Check("pinned_memory", "ok", value, details=details)


def _pinned_memory(num_bytes: int = 64 * 2**20) -> Check:
    if not device_layer.cuda_hardware_available():
        return Check("pinned_memory", "info", "no CUDA: DataLoader(pin_memory=True) has no GPU copy to speed up")
    try:
        start = time.perf_counter()
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        seconds = time.perf_counter() - start
    except RuntimeError as error:
        fix = "raise the locked-memory limit (ulimit -l unlimited; docker --ulimit memlock=-1) or use DataLoader(pin_memory=False)"
        return Check("pinned_memory", "fail", f"pinned memory could not be allocated: {error}", fix)
    target, speeds = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0"), []
    card = device_layer.device_for(target.device)
    for source in (pinned, torch.empty(num_bytes, dtype=torch.uint8)):  # pinned, then pageable
        target.copy_(source, non_blocking=True)  # warm-up
        speeds.append(3 * num_bytes / _timed(card, 3, target.copy_, source, non_blocking=True) / 1e9)
    return pinned_memory_check(num_bytes, seconds, *speeds)


def shared_memory_check(total_bytes: Optional[int], free_bytes: Optional[int], path: str = "/dev/shm") -> Check:
    """Judge the size of the shared-memory filesystem DataLoader workers hand batches through."""
    if total_bytes is None or free_bytes is None:
        fix = f"DataLoader workers hand batches over through {path}: mount a tmpfs there, or use num_workers=0"
        return Check("shm", "warn", f"no {path}", fix)
    value = f"{path}: {total_bytes / _GIB:.2f} GiB, {free_bytes / _GIB:.2f} GiB free"
    details = {"path": path, "total_bytes": total_bytes, "free_bytes": free_bytes}
    larger = "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm"
    if total_bytes < SHM_WARN_BYTES:
        fix = "DataLoader workers hand batches over through it and die with 'bus error' or 'No space left on device' when it fills: "
        return Check("shm", "warn", value + " (small)", fix + larger, details)
    if free_bytes < SHM_WARN_BYTES:
        fix = "free it (stale torch_* files of crashed workers) or make it larger: " + larger
        return Check("shm", "warn", value + " (nearly full)", fix, details)
    return Check("shm", "ok", value, details=details)


def _shm(path: str = "/dev/shm") -> Check:
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return shared_memory_check(None, None, path)
    return shared_memory_check(stat.f_frsize * stat.f_blocks, stat.f_frsize * stat.f_bavail, path)


#: every check by name, in order (the GPU processes before the benchmark puts this process on the GPU)
CHECKS: dict[str, Callable[..., Check]] = {
    "torch_build": _torch_build, "cuda_driver": lambda: cuda_driver_check(torch.version.cuda, *nvml.driver_versions()),
    "gpu_arch": _gpu_arch, "gpus": _gpus, "gpu_processes": _gpu_processes, "matmul": _matmul,
    "cpu_cores": lambda: cpu_cores_check(os.cpu_count() or 1, usable_cpu_count(within_quota=False), cgroup_cpu_quota()),
    "torch_threads": _torch_threads, "blas": _blas, "pinned_memory": _pinned_memory, "shm": _shm,
}  # fmt: skip


def run_check(name: str, *args: Any) -> Check:
    """Run the check ``name`` of :data:`CHECKS`; an exception inside it becomes a "warn" that names it."""
    check = CHECKS[name]
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - a check reports, it never raises
        fix = "this is a gap in the diagnosis, not necessarily a problem; run the check's steps by hand"
        return Check(name, "warn", f"the check could not run: {nvml.error_text(error)}", fix)
