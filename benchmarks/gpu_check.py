"""The calibration to run on a real card: what the card does against what the library assumes.

``make gpu-check OUT=dir`` runs every section on ``cuda:0`` (at most a few minutes on one H100) and writes
``dir/gpu_check.json`` (every figure) and ``dir/gpu_check.md`` (a section to paste into benchmarks/RESULTS.md):

* ``identity``: torch and CUDA versions, the card's name, capability, totals from torch and NVML, UUIDs as
  each spells them, cuBLAS workspace sizes (ours, torch's, the environment's), the CUDA context before and
  after a training step;
* ``workspaces``: allocated bytes after a matmul, a Linear forward and a backward, beyond their tensors
  (in cuBLAS workspaces: one per thread that runs matmuls);
* ``allocator_replay``: a fit's alloc/free trace (``torch.cuda.memory._record_memory_history``) replayed
  through the caching-allocator model: the first event where reserved bytes or segments differ;
* ``simulator``: 3 models x 3 batch sizes x 3 steps, peak allocated and reserved on the card against
  ``SimulatedGpu`` given the card's own total and context (pass: within 5% allocated, 10% reserved);
* ``meters``: the device layer's peak meter against ``max_memory_allocated``, over real training steps;
* ``largest_batch``: the largest batch under a 256 MiB and a 512 MiB cap, bisected by hand (plain fits,
  fresh state each try), by ``BatchSizeSearch`` on the card and by ``BatchSizeSearch`` on the simulated card;
* ``nvml``: whether NVML finds the card by torch's UUID and reads its utilisation while it works.

Without a CUDA card (or with ``--dry-run``) the card is ``SimulatedGpu("H100")`` and the JSON says
``"dry_run": true``: every section runs the same code, ``--quick`` (one model, one batch size, one small cap;
``--full`` for the whole plan, many CPU minutes); CI runs it as a test. A section that
fails records its error and the others still run; the exit status is 1 if any section failed.

Needs only torch, lightning, psutil and the repository on ``PYTHONPATH`` (``BatchSizeSearch`` also needs
torchinfo, ``nvml`` nvidia-ml-py; the Makefile says how to carry their wheels to a machine without an index).

Usage::

    make gpu-check OUT=/tmp/check            # on a GPU machine; without one, the quick dry run (about 20 s)
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out /tmp/check --sections identity,nvml
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models_memory import make_model

from lightning_gpuopt.core.allocator import CachingAllocatorModel
from lightning_gpuopt.core.device import Capabilities, device_for
from lightning_gpuopt.core.memory import is_out_of_memory_error
from lightning_gpuopt.core.nvml import NvmlSampler, nvml_devices, nvml_session, read_usage
from lightning_gpuopt.testing import SimulatedGpu
from lightning_gpuopt.testing._card import GpuProfile

MIB = 2**20
TOLERANCE = {"allocated": 0.05, "reserved": 0.10}  # the simulator against the card


@dataclass
class Plan:
    """What the run covers: the full calibration, or ``--quick`` (the same code paths, smaller)."""

    models: tuple[str, ...] = ("mlp", "cnn", "transformer")
    batch_sizes: tuple[int, ...] = (8, 32, 128)
    steps: int = 3
    caps: tuple[int, ...] = (256 * MIB, 512 * MIB)
    cap_model: str = "cnn"
    cap_samples: int = 4096  # the search stops at the dataset's size: above any batch the caps allow
    nvml_busy_s: float = 1.0
    deadline: float = math.inf  #: ``time.perf_counter()`` past which the remaining rows are skipped

    @classmethod
    def quick(cls) -> Plan:
        return cls(("mlp",), (8,), 2, (80 * MIB,), "cnn", 64, 0.3)  # two 32 MiB cuBLAS workspaces on an H100

    def out_of_time(self, row: dict[str, Any]) -> bool:
        """Whether the time budget is spent (then ``row`` says so)."""
        if time.perf_counter() > self.deadline:
            row["skipped"] = "the time budget (--budget-s) was spent"
        return "skipped" in row


@dataclass
class Peaks:
    allocated_start: int = 0
    reserved_start: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0


class RealCard:
    """``cuda:0``, measured with the caching allocator's own counters."""

    dry_run = False
    accelerator = "gpu"

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)
        torch.zeros(1, device=self.device)  # the context exists from here on
        props = torch.cuda.get_device_properties(self.device)
        self.name, self.capability = props.name, (props.major, props.minor)
        self.uuid = str(props.uuid)
        self.total = int(torch.cuda.mem_get_info(self.device)[1])
        self.properties_total = int(props.total_memory)

    def context(self) -> int:
        """Memory the process holds outside PyTorch's allocator (the CUDA context, cuBLAS/cuDNN handles)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free - torch.cuda.memory_reserved(self.device))

    def profile(self) -> GpuProfile:
        return GpuProfile(
            name=self.name, capability=self.capability, total_bytes=self.total, uuid=self.uuid,
            context_bytes=self.context(), mig="MIG" in self.name,
        )  # fmt: skip

    def place(self, obj: Any) -> Any:
        return obj.to(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def fresh(self) -> None:
        """Nothing of earlier work held: garbage collected, cuBLAS workspaces and cached blocks released."""
        gc.collect()
        torch.cuda.synchronize(self.device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def window(self, cap: Optional[int] = None) -> Iterator[Peaks]:
        """The peaks of the block (the process's counters, reset at its start); ``cap`` caps reserved memory."""
        fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / self.total), self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        peaks = Peaks(self.allocated(), self.reserved())
        try:
            yield peaks
        finally:
            torch.cuda.synchronize(self.device)
            peaks.peak_allocated = int(torch.cuda.max_memory_allocated(self.device))
            peaks.peak_reserved = int(torch.cuda.max_memory_reserved(self.device))
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def trace(self, work: Callable[[], Any]) -> list[dict[str, Any]]:
        """The allocator's events while ``work`` runs."""
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=1_000_000)
        try:
            work()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        traces = snapshot.get("device_traces", [])
        return [dict(e, frames=None) for e in (traces[self.device.index] if traces else [])]

    def suspended(self) -> contextlib.AbstractContextManager[None]:
        """A block where another (simulated) card may be used."""
        return contextlib.nullcontext()

    def close(self) -> None: ...


class SimCard:
    """A :class:`SimulatedGpu` of ``profile``: the dry run's card, and the simulator the card is checked against."""

    dry_run = True
    accelerator = "cpu"

    def __init__(self, profile: GpuProfile) -> None:
        self._profile = profile
        self.name, self.capability, self.uuid = profile.name, profile.capability, profile.uuid
        self.total = self.properties_total = profile.total_bytes
        self.gpu = SimulatedGpu(profile).__enter__()

    def context(self) -> int:
        return self._profile.context_bytes

    def profile(self) -> GpuProfile:
        return self._profile

    def place(self, obj: Any) -> Any:
        self.gpu.place(obj)
        return obj

    def allocated(self) -> int:
        return self.gpu.allocated_bytes

    def reserved(self) -> int:
        return self.gpu.reserved_bytes

    def fresh(self) -> None:
        """A new card: what the last one held is gone."""
        gc.collect()
        self.gpu.__exit__(None, None, None)
        self.gpu = SimulatedGpu(self._profile).__enter__()

    @contextlib.contextmanager
    def window(self, cap: Optional[int] = None) -> Iterator[Peaks]:
        allocator = self.gpu.allocator
        limit = allocator.limit_bytes
        if cap is not None:
            allocator.limit_bytes = min(limit, cap)
        window = allocator.open_window()
        peaks = Peaks(self.allocated(), self.reserved())
        try:
            yield peaks
        finally:
            allocator.close_window(window)
            peaks.peak_allocated, peaks.peak_reserved = window.peak_allocated_bytes, window.peak_reserved_bytes
            allocator.limit_bytes = limit

    def trace(self, work: Callable[[], Any]) -> list[dict[str, Any]]:
        """The model's events while ``work`` runs, in the shape of ``torch.cuda.memory._snapshot()``'s trace."""
        allocator, events, depth = self.gpu.allocator, [], [0]
        malloc, free, empty_cache = allocator.malloc, allocator.free, allocator.empty_cache

        def segments(call: Callable[[], Any]) -> Any:
            """``call()``, and the segments it reserved or released as one event (calls within it: none)."""
            reserved, count = allocator.reserved_bytes, allocator.stats.num_segments
            depth[0] += 1
            try:
                out = call()
            finally:
                depth[0] -= 1
            if depth[0]:
                return out
            grown, segs = allocator.reserved_bytes - reserved, allocator.stats.num_segments - count
            if segs:
                events.append({"action": "segment_alloc" if segs > 0 else "segment_free", "size": abs(grown),
                               "segments": abs(segs), "addr": 0})  # fmt: skip
            return out

        def traced_malloc(num_bytes: int) -> Any:
            block = segments(lambda: malloc(num_bytes))
            events.append({"action": "alloc", "addr": id(block), "size": num_bytes})
            return block

        def traced_free(block: Any) -> None:
            if block.allocated:
                events.append({"action": "free_completed", "addr": id(block), "size": block.size})
            segments(lambda: free(block))

        allocator.malloc, allocator.free = traced_malloc, traced_free  # type: ignore[method-assign]
        allocator.empty_cache = lambda: segments(empty_cache)  # type: ignore[method-assign]
        try:
            work()
        finally:
            del allocator.malloc, allocator.free, allocator.empty_cache
        return events

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """A block where another simulated card may be entered (one at a time); then a fresh card."""
        self.close()
        try:
            yield
        finally:
            self.gpu = SimulatedGpu(self._profile).__enter__()

    def close(self) -> None:
        self.gpu.__exit__(None, None, None)


def quiet_fit(card: Any, model: Any, *, steps: int, callbacks: tuple = (), loader: Any = None) -> Any:
    """A plain Lightning fit of ``steps`` steps on ``card`` (no logger, checkpoints or progress bar)."""
    import lightning as L

    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            accelerator=card.accelerator, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=list(callbacks),
        )  # fmt: skip
        trainer.fit(model, loader)
    return trainer


def manual_steps(card: Any, name: str, batch_size: int, steps: int) -> None:
    """``steps`` plain training steps (forward, backward, Adam) of model ``name`` on the card."""
    model = make_model(name, num_samples=batch_size, batch_size=batch_size)
    network = card.place(model.network)
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-3)
    x, y = (card.place(t) for t in next(iter(model.loader(batch_size))))
    for _ in range(steps):
        model.loss(network(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _call(function: Optional[Callable[[], Any]]) -> Any:
    """``function()``, or why not (absent from this torch, or failed)."""
    try:
        return "absent from this torch" if function is None else function()
    except Exception as error:  # noqa: BLE001 -- reported, not raised
        return f"{type(error).__name__}: {error}"


def relative(value: Optional[int], truth: Optional[int]) -> Optional[float]:
    return None if value is None or not truth else (value - truth) / truth


# ------------------------------------------------------------------------------------------------- sections


def identity(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    context_before = card.context()
    card.fresh()
    quiet_fit(card, make_model("mlp", num_samples=16, batch_size=8), steps=1)
    capabilities = Capabilities.of_cuda(card.name, card.capability)
    workspace_size = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "name": card.name,
        "capability": list(card.capability),
        "total_torch_mem_get_info": card.total,
        "total_torch_properties": card.properties_total,
        "uuid_torch": card.uuid,
        "cublas_workspace_ours": capabilities.cublas_workspace_bytes,
        "cublas_workspace_torch": _call(workspace_size) if card.accelerator == "gpu" else None,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "context_before_step": context_before,
        "context_after_step": card.context(),
        "device_layer_describe": device_for("cuda").describe(),
    }
    with nvml_session() as (lib, why):
        if lib is None:
            figures["nvml"] = why
        else:
            devices, _ = nvml_devices(lib, [card.uuid])
            if devices and devices[0].handle is not None:
                _, used, total = read_usage(lib, devices[0].handle)
                figures.update(uuid_nvml=devices[0].uuid, total_nvml=total, used_nvml=used)
                figures["total_nvml_minus_torch"] = total - card.total
            else:
                figures["nvml"] = devices[0].error if devices else "no device"
    return figures


def workspaces(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    """Allocated bytes each operation leaves beyond its tensors, from a fresh card."""
    card.fresh()
    size, figures = 1024, {}
    x = card.place(torch.randn(size, size))
    before = card.allocated()
    y = x @ x
    figures["matmul"] = card.allocated() - before - y.untyped_storage().nbytes()
    linear = card.place(torch.nn.Linear(size, size))
    before = card.allocated()
    out = linear(x)
    figures["linear_forward"] = card.allocated() - before - out.untyped_storage().nbytes()
    before = card.allocated()
    out.sum().backward()  # runs on the autograd thread on a card
    grads = sum(p.grad.untyped_storage().nbytes() for p in linear.parameters() if p.grad is not None)
    figures["backward"] = card.allocated() - before - grads
    unit = Capabilities.of_cuda(card.name, card.capability).cublas_workspace_bytes
    held = figures["matmul"] + figures["linear_forward"] + figures["backward"]
    figures.update(cublas_workspace_ours=unit, workspace_blocks=round(held / unit, 2) if unit else None)
    del x, y, out, linear
    return figures


def replay(events: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """The events through a fresh allocator model; the first where reserved bytes or segments differ."""
    model, blocks = CachingAllocatorModel(limit), {}
    real_reserved = real_segments = 0
    card_segments: dict[int, int] = {}  # address -> bytes, and the card's live blocks: to say where the two differ
    card_live: dict[int, int] = {}
    counts = {"alloc": 0, "free": 0, "segment_alloc": 0, "segment_free": 0}
    first: Optional[dict[str, Any]] = None
    previous = ""
    for index, event in enumerate(events):
        action, addr = event["action"], event.get("addr", 0)
        if action == "segment_alloc":
            card_segments[addr] = event["size"]
        elif action == "segment_free":
            card_segments.pop(addr, None)
        elif action == "alloc":
            card_live[addr] = event["size"]
        elif action == "free_completed":
            card_live.pop(addr, None)
        if action in ("segment_alloc", "segment_map"):
            real_reserved += event["size"]
            real_segments += event.get("segments", 1) if action == "segment_alloc" else 0
            counts["segment_alloc"] += 1
        elif action in ("segment_free", "segment_unmap"):
            if previous not in ("segment_free", "segment_unmap"):
                model.empty_cache()  # the real allocator released its free segments
            real_reserved -= event["size"]
            real_segments -= event.get("segments", 1) if action == "segment_free" else 0
            counts["segment_free"] += 1
        elif action == "alloc":
            blocks[event["addr"]] = model.malloc(event["size"])
            counts["alloc"] += 1
        elif action == "free_completed" and event["addr"] in blocks:
            model.free(blocks.pop(event["addr"]))
            counts["free"] += 1
        previous = action
        diverged = model.reserved_bytes != real_reserved or model.stats.num_segments != real_segments
        if action in ("alloc", "free_completed") and first is None and diverged:
            first = {
                "event": index, "action": action, "size": event["size"],
                "card_reserved": real_reserved, "model_reserved": model.reserved_bytes,
                "card_segments": real_segments, "model_segments": model.stats.num_segments,
                "events_around": [{k: e.get(k) for k in ("action", "addr", "size", "stream")}
                                  for e in events[max(0, index - 20) : index + 20]],
                "events_around_start": max(0, index - 20),
                "card_segment_list": [
                    {"addr": a, "size": n, "live_blocks": [b for b in sorted(card_live) if a <= b < a + n],
                     "live_bytes": sum(size for b, size in card_live.items() if a <= b < a + n)}
                    for a, n in sorted(card_segments.items())],
                "model_segment_list": model_segments(model),
            }  # fmt: skip
    return {
        "events": len(events), **counts, "first_divergence": first,
        "card_reserved_end": real_reserved, "model_reserved_end": model.reserved_bytes,
        "card_segments_end": real_segments, "model_segments_end": model.stats.num_segments,
    }  # fmt: skip


def model_segments(model: CachingAllocatorModel) -> list[dict[str, Any]]:
    """Each segment of the model: its address, pool, bytes and its blocks as (offset, size, allocated)."""
    rows = []
    for address, block in sorted(model._segments.items()):
        parts: list[tuple[int, int, bool]] = []
        while block is not None:
            parts.append((block.offset, block.size, block.allocated))
            block = block.next
        rows.append({"addr": address, "small": parts and model._segments[address].small,
                     "size": sum(p[1] for p in parts), "live_bytes": sum(p[1] for p in parts if p[2]),
                     "blocks": parts})  # fmt: skip
    return rows


def allocator_replay(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    card.fresh()
    start = card.reserved()
    name, batch = plan.models[-1], plan.batch_sizes[-1]
    model = make_model(name, num_samples=batch * plan.steps, batch_size=batch)
    events = card.trace(lambda: quiet_fit(card, model, steps=plan.steps))
    result = {"model": name, "batch_size": batch, "reserved_at_start": start, **replay(events, card.total)}
    checks.append(("allocator replay: no divergence", result["first_divergence"] is None, result["first_divergence"]))
    return result


def simulator(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    rows = []
    profile = card.profile()
    for name in plan.models:
        for batch in plan.batch_sizes:
            row: dict[str, Any] = {"model": name, "batch_size": batch, "steps": plan.steps}
            rows.append(row)
            if plan.out_of_time(row):
                continue
            for side in ("card", "simulated"):
                with contextlib.nullcontext() if side == "card" else card.suspended():
                    target = card if side == "card" else SimCard(profile)
                    try:
                        target.fresh()
                        model = make_model(name, num_samples=batch * plan.steps, batch_size=batch)
                        with target.window() as peaks:
                            quiet_fit(target, model, steps=plan.steps)
                        row[f"{side}_allocated"], row[f"{side}_reserved"] = peaks.peak_allocated, peaks.peak_reserved
                    finally:
                        if target is not card:
                            target.close()
            for kind, tolerance in TOLERANCE.items():
                error = relative(row[f"simulated_{kind}"], row[f"card_{kind}"])
                row[f"{kind}_error"] = error
                passed = error is not None and abs(error) <= tolerance
                checks.append((f"simulator {name} b={batch} peak {kind} within {tolerance:.0%}", passed, error))
    return {"profile": {"total": profile.total_bytes, "context": profile.context_bytes}, "rows": rows}


def meters(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    rows = []
    for name in plan.models:
        batch = plan.batch_sizes[len(plan.batch_sizes) // 2]
        card.fresh()
        with card.window() as peaks, device_for("cuda").peak_meter() as meter:
            manual_steps(card, name, batch, plan.steps)
        row = {"model": name, "batch_size": batch, "max_memory_allocated": peaks.peak_allocated,
               "meter": meter.peak_bytes, "meter_reserved": meter.peak_reserved_bytes,
               "max_memory_reserved": peaks.peak_reserved}  # fmt: skip
        row["error"] = relative(meter.peak_bytes, peaks.peak_allocated)
        checks.append((f"peak meter {name} = max_memory_allocated", row["error"] == 0, row["error"]))
        reserved_error = relative(meter.peak_reserved_bytes, peaks.peak_reserved)
        checks.append((f"peak meter {name} reserved = max_memory_reserved", reserved_error == 0, reserved_error))
        rows.append(row)
    return {"rows": rows}


def _fits_by_hand(card: Any, name: str, batch: int, cap: int, steps: int) -> bool:
    card.fresh()
    try:
        with card.window(cap):
            quiet_fit(card, make_model(name, num_samples=batch * steps, batch_size=batch), steps=steps)
        return True
    except Exception as error:  # Lightning re-raises the step's error as it is
        if not is_out_of_memory_error(error):
            raise
        return False
    finally:
        card.fresh()


def largest_by_hand(card: Any, name: str, cap: int, steps: int, most: int) -> tuple[int, int]:
    """The largest batch (at most ``most``) whose plain fit runs under ``cap``, doubled then bisected; and the tries."""
    tries, low, high = 0, 0, 1
    while high <= most:
        tries += 1
        if not _fits_by_hand(card, name, high, cap, steps):
            break
        low, high = high, high * 2
    high = min(high, most + 1)
    while high - low > 1:
        middle, tries = (low + high) // 2, tries + 1
        low, high = (middle, high) if _fits_by_hand(card, name, middle, cap, steps) else (low, middle)
    return low, tries


def searched(card: Any, name: str, cap: int, plan: Plan, margin: Any = 0.0) -> dict[str, Any]:
    from lightning_gpuopt import BatchSizeSearch

    card.fresh()
    search = BatchSizeSearch(max_memory=cap, margin=margin, steps_per_trial=2, max_trials=20, verbose=False)
    quiet_fit(card, make_model(name, num_samples=plan.cap_samples, batch_size=8), steps=1, callbacks=(search,))
    result = search.result
    return {"batch_size": result.batch_size, "trials": len(result.trials)}


def largest_batch(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    rows = []
    for cap in plan.caps:
        row: dict[str, Any] = {"model": plan.cap_model, "cap": cap}
        rows.append(row)
        if plan.out_of_time(row):
            continue
        row["by_hand"], row["by_hand_tries"] = largest_by_hand(card, plan.cap_model, cap, 2, plan.cap_samples)
        found = searched(card, plan.cap_model, cap, plan)
        row["search_card"], row["search_card_trials"] = found["batch_size"], found["trials"]
        with card.suspended():
            simulated = SimCard(card.profile())
            try:
                found = searched(simulated, plan.cap_model, cap, plan)
            finally:
                simulated.close()
        row["search_simulated"], row["search_simulated_trials"] = found["batch_size"], found["trials"]
        for side in ("search_card", "search_simulated"):
            error = relative(row[side], row["by_hand"])
            row[f"{side}_error"] = error
            checks.append((f"{side} under {cap // MIB} MiB within 5% of by hand", error is not None and abs(error) <= 0.05, error))  # fmt: skip
        defaults_row(card, plan, cap, row, checks)
    return {
        "rows": rows,
        "note": "BatchSizeSearch with margin=0: a size fits when its trial ran under the cap; 'defaults': "
        "BatchSizeSearch() as shipped (margin='auto'), then a whole epoch of cap_samples trained at its size on a fresh card",
    }


def defaults_row(card: Any, plan: Plan, cap: int, row: dict[str, Any], checks: list) -> None:
    """The default search's size on the card: at least 95% of by hand, and a whole epoch trains at it."""
    found = searched(card, plan.cap_model, cap, plan, margin="auto")["batch_size"]
    epoch_steps = max(1, plan.cap_samples // found)
    row["defaults"], row["defaults_epoch_steps"] = found, epoch_steps
    row["defaults_trains_epoch"] = _fits_by_hand(card, plan.cap_model, found, cap, epoch_steps)
    share = found / row["by_hand"] if row["by_hand"] else None
    checks.append((f"defaults under {cap // MIB} MiB >= 0.95 of by hand", share is not None and share >= 0.95, share))
    checks.append(
        (f"defaults under {cap // MIB} MiB train an epoch ({epoch_steps} steps)", row["defaults_trains_epoch"], found)
    )


def nvml(card: Any, plan: Plan, checks: list) -> dict[str, Any]:
    figures: dict[str, Any] = {"uuid_torch": card.uuid}
    with nvml_session() as (lib, why):
        if lib is None:
            checks.append(("NVML readable", False, why))
            return {**figures, "readable": False, "why": why}
        devices, _ = nvml_devices(lib, [card.uuid])
        found = devices[0] if devices else None
        figures.update(uuid_nvml=found.uuid if found else None, nvml_error=found.error if found else "no device")
        checks.append(
            (
                "NVML finds the card by torch's UUID",
                found is not None and found.handle is not None,
                found and found.uuid,
            )
        )
    sampler = NvmlSampler(interval_s=0.1, uuids=[card.uuid])
    started = sampler.start()
    size = 1024 if card.accelerator == "gpu" else 128  # a simulated card's ops run on the host
    x = card.place(torch.randn(size, size))
    deadline = time.perf_counter() + plan.nvml_busy_s
    while time.perf_counter() < deadline:
        x = torch.tanh(x @ x / size)
    usage = sampler.stop()
    own = usage[0] if usage else None
    utilization = own.util_mean if own else None
    figures.update(sampler_started=started, samples=own.samples if own else 0, util_mean=utilization,
                   util_max=own.util_max if own else None, used_max=own.memory_used_max_bytes if own else None)  # fmt: skip
    checks.append(("NVML utilisation readable by torch's UUID", utilization is not None, utilization))
    return figures


# cheap and telling first: the largest batch (most fits) last
SECTIONS = {f.__name__: f for f in (identity, workspaces, nvml, meters, allocator_replay, simulator, largest_batch)}


def markdown(result: dict[str, Any]) -> str:
    """The run as a section for benchmarks/RESULTS.md."""
    ident = result["sections"].get("identity", {})
    lines = [
        f"## gpu_check.py{' (dry run)' if result['dry_run'] else ''} — {result['when']}",
        "",
        f"- card: {ident.get('name')} (capability {ident.get('capability')}), torch {ident.get('torch')}, "
        f"CUDA {ident.get('cuda')}; {result['seconds']:.0f} s",
        f"- command: `{result['command']}`",
        "",
        "| check | pass | figure |",
        "|---|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} | {_plain(figure)} |" for name, ok, figure in result["checks"]),
    ]
    for name, section in result["sections"].items():
        if "error" in section:
            lines.append(f"\n- section {name} failed: {section['error'].splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument(
        "--quick", action="store_true", help="one model, one batch size, one small cap (a dry run's default)"
    )
    parser.add_argument("--full", action="store_true", help="the full plan also in a dry run (many CPU minutes)")
    parser.add_argument("--dry-run", action="store_true", help="the simulated H100 even where a card exists")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip the rows left after this many seconds")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    quick = args.quick or (dry and not args.full)
    plan = Plan.quick() if quick else Plan()
    plan.deadline = time.perf_counter() + args.budget_s
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)  # each fit's "GPU available" lines
    torch.manual_seed(0)
    started = time.perf_counter()
    card: Any = SimCard(SimulatedGpu("H100").profile) if dry else RealCard()
    sections: dict[str, Any] = {}
    checks: list[tuple[str, bool, Any]] = []
    result = {"dry_run": dry, "quick": quick, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "checks": checks, "sections": sections}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.sections.split(","):
            began = time.perf_counter()
            try:
                sections[name] = SECTIONS[name](card, plan, checks)
            except Exception:  # noqa: BLE001 -- a failed section is reported; the others still run
                sections[name] = {"error": traceback.format_exc(limit=8)}
            sections[name]["seconds"] = round(time.perf_counter() - began, 2)
            print(f"gpu_check: {name} ({sections[name]['seconds']} s){' FAILED' if 'error' in sections[name] else ''}")
            result["seconds"] = round(time.perf_counter() - started, 1)
            # after every section: a run stopped by a timeout keeps what it measured
            (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=_plain) + "\n")
            (out / "gpu_check.md").write_text(markdown(result))
    finally:
        card.close()
    print(markdown(result))
    return 1 if any("error" in section for section in sections.values()) else 0


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    return value if value is None or isinstance(value, (int, str, bool, list, dict)) else str(value)


if __name__ == "__main__":
    sys.exit(main())
