"""Tests of lightning_gpuopt.core.memory and the host side of core.device / core.op_memory: MemoryBudget,
the live-storage tracker, the host's peak meter and capacity, parse_memory, OOM detection and cleanup
(CPU, real tensors and a real training step)."""

from __future__ import annotations

import doctest
import gc
import os
import weakref

import pytest
import torch
from lightning.pytorch.utilities.memory import is_oom_error

from lightning_gpuopt.core import memory
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.memory import MemoryBudget, call_catching_oom, is_out_of_memory_error, parse_memory
from lightning_gpuopt.core.op_memory import LiveTensorTracker, storage_bytes

FLOAT_BYTES = 4


def dispatch_stack_depth() -> int:
    return torch._C._len_torch_dispatch_stack()


def small_training_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (torch.randn(32, 64), torch.randint(0, 8, (32,)))
    return model, optimizer, batch


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    """One step in Lightning's order: forward, zero_grad(set_to_none), backward, optimizer step."""
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


# --------------------------------------------------------------------------- MemoryBudget


def test_budget_allows_up_to_the_cap_and_raises_past_it():
    cap = 4000
    with MemoryBudget(cap) as budget:
        exactly_the_cap = torch.zeros(cap // FLOAT_BYTES)
        assert budget.live_bytes == cap
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            torch.zeros(1)
        del exactly_the_cap
        assert budget.live_bytes == 0
        one_more = torch.zeros(cap // FLOAT_BYTES)  # fits again once the first tensor is freed
        assert one_more.numel() == cap // FLOAT_BYTES
    assert budget.peak_bytes == cap


def test_budget_error_is_recognised_by_lightning_and_by_us():
    with MemoryBudget("1KB"), pytest.raises(torch.OutOfMemoryError) as caught:
        torch.ones(1000)
    assert is_oom_error(caught.value)
    assert is_out_of_memory_error(caught.value)
    assert "1000" in str(caught.value)  # the cap in bytes is in the message


def test_budget_caps_a_whole_training_step_at_its_measured_peak():
    model, optimizer, batch = small_training_setup()
    training_step(model, optimizer, batch)  # gradients and optimizer state exist from now on
    with device_for("cpu").peak_meter(existing=(model, optimizer, batch)) as meter:
        training_step(model, optimizer, batch)
    peak = meter.peak_bytes
    assert peak > storage_bytes(model, optimizer, batch)

    with MemoryBudget(peak, existing=(model, optimizer, batch)) as budget:
        training_step(model, optimizer, batch)
    assert budget.peak_bytes == peak

    with pytest.raises(torch.OutOfMemoryError), MemoryBudget(peak - 1, existing=(model, optimizer, batch)):
        training_step(model, optimizer, batch)


def test_existing_tensors_count_until_freed_inside():
    model, optimizer, batch = small_training_setup()
    training_step(model, optimizer, batch)
    grads_bytes = storage_bytes([p.grad for p in model.parameters()])
    with LiveTensorTracker(existing=(model, optimizer)) as tracker:
        before = tracker.live_bytes
        assert before == storage_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert tracker.live_bytes == before - grads_bytes


def test_views_and_in_place_ops_allocate_nothing():
    existing = torch.zeros(100)
    with LiveTensorTracker() as tracker:
        fresh = torch.zeros(1000)
        views = [fresh[10:], fresh.view(10, 100), fresh[::2]]
        fresh.add_(1)
        existing.mul_(2)  # in place on an untracked tensor: not an allocation
        existing_view = existing[1:]
        assert tracker.live_bytes == 1000 * FLOAT_BYTES
        assert tracker.tracked_storages == 1
        del views, existing_view


def test_nested_budgets_each_apply_their_cap_and_leave_nothing_behind():
    with MemoryBudget(10_000) as outer:
        kept = torch.zeros(1000)  # 4000 bytes
        with MemoryBudget(2000) as inner:
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(1000)
            small = torch.zeros(100)
        assert inner.tracked_storages == 0 and inner.live_bytes == 0
        assert outer.live_bytes == 4400
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(2000)  # 4400 + 8000 passes the outer cap
        del small
    assert outer.tracked_storages == 0 and outer.live_bytes == 0
    assert dispatch_stack_depth() == 0
    assert kept.sum() == 0


def test_exception_inside_a_budget_pops_the_mode_and_frees_its_tensors():
    refs = []

    def work():
        with MemoryBudget("1MB") as budget:
            tensor = torch.ones(1000)
            refs.append(weakref.ref(tensor))
            raise ValueError("boom")
        return budget

    with pytest.raises(ValueError, match="boom"):
        work()
    gc.collect()
    assert dispatch_stack_depth() == 0
    assert refs[0]() is None
    # a fresh budget starts from zero
    with MemoryBudget("1MB") as budget:
        pass
    assert budget.peak_bytes == 0 and budget.tracked_storages == 0


def test_budget_fraction_and_device_filter():
    with MemoryBudget(0.5, device="cpu") as budget:
        torch.zeros(10)
    assert budget.max_bytes == int(0.5 * device_for("cpu").total_memory())
    with LiveTensorTracker(device="meta") as tracker:
        torch.zeros(1000)  # a CPU tensor: not on the tracked device
        meta = torch.zeros(1000, device="meta")
        assert tracker.live_bytes == 1000 * FLOAT_BYTES
        del meta


# --------------------------------------------------------------------------- peak meter, capacity


def test_peak_meter_measures_a_known_sequence_across_start_and_stop():
    meter = device_for("cpu").peak_meter()
    assert not meter.running and meter.stop() is None
    meter.start()
    assert meter.running
    first = torch.zeros(2000)
    second = torch.zeros(500)
    del first
    third = torch.zeros(1000)
    assert meter.stop() == 2500 * FLOAT_BYTES
    assert not meter.running and dispatch_stack_depth() == 0
    del second, third


def test_device_memory_figures_are_consistent():
    host = device_for("cpu")
    total, free = host.total_memory(), host.free_memory()
    assert 0 < free <= total
    model = torch.nn.Linear(256, 256)
    assert free <= host.usable_memory([model]) <= total


def _meminfo_available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))


def _cgroup_limit() -> float:
    """The cgroup memory limit read here, not through the library: v2 ``memory.max``, else v1."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        return float("inf") if text == "max" else int(text)
    return float("inf")


def test_host_memory_is_the_kernels_figure_capped_by_the_cgroup_limit():
    # independently of psutil: the kernel's physical pages (sysinfo), and /proc/meminfo's MemAvailable
    # read just before and just after ours, each capped by the cgroup memory limit (v2 memory.max, else v1 memory.limit_in_bytes)
    limit = _cgroup_limit()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_for("cpu").total_memory() == min(physical, limit)
    before = _meminfo_available_bytes()
    free = device_for("cpu").free_memory()
    after = _meminfo_available_bytes()
    slack = physical // 20  # other processes on the machine allocate and free between the reads
    assert min(before, after, limit) - slack <= free <= min(max(before, after) + slack, limit)


# --------------------------------------------------------------------------- parse_memory


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("300MB", 300 * 10**6),
        ("300 mb", 300 * 10**6),
        ("20GiB", 20 * 2**30),
        ("1.5KiB", 1536),
        ("2kB", 2000),
        ("1TB", 10**12),
        ("512B", 512),
    ],
)
def test_parse_memory_accepts_bytes_and_units(value, expected):
    assert parse_memory(value) == expected


def test_parse_memory_fraction_of_the_device():
    assert parse_memory(0.25, "cpu") == int(0.25 * device_for("cpu").total_memory())
    assert parse_memory(1.0, "cpu") == device_for("cpu").total_memory()


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (0, "not positive"),
        (-5, "not positive"),
        (True, "bool"),
        (1.5, "outside (0, 1]"),
        (0.0, "outside (0, 1]"),
        ("lots", "not a memory size"),
        ("10 XB", "not a memory size"),
        ("", "not a memory size"),
        ("0MB", "zero bytes"),
        (None, "NoneType"),
        ([1], "list"),
    ],
)
def test_parse_memory_rejects_with_a_clear_message(value, fragment):
    with pytest.raises(ValueError) as caught:
        parse_memory(value, "cpu", name="max_memory")
    message = str(caught.value)
    assert "`max_memory`" in message and repr(value) in message and fragment in message
    assert '"20GiB"' in message  # says what would work


def test_parse_memory_fraction_needs_a_device():
    with pytest.raises(ValueError, match="no device was given"):
        parse_memory(0.9)


# --------------------------------------------------------------------------- OOM detection and cleanup


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        ),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes."
        ),
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
        MemoryError(),
    ],
)
def test_out_of_memory_errors_are_recognised(error):
    assert is_out_of_memory_error(error)


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch"), ValueError("out of memory"), KeyboardInterrupt()])
def test_other_errors_are_not_out_of_memory(error):
    assert not is_out_of_memory_error(error)


def test_call_catching_oom_frees_the_failed_calls_tensors():
    refs = []

    def step():
        with MemoryBudget(10_000):
            activations = [torch.ones(1000)]
            refs.append(weakref.ref(activations[0]))
            activations.append(torch.ones(2000))  # passes the cap

    outcome = call_catching_oom(step)
    assert outcome.out_of_memory and "CUDA out of memory" in outcome.error_message
    assert refs[0]() is None  # freed: the traceback holding the frame is gone
    assert dispatch_stack_depth() == 0

    assert call_catching_oom(lambda: 42).value == 42
    with pytest.raises(KeyError):
        call_catching_oom(lambda: {}["missing"])


def _collected_generations(fn):
    """The generations the garbage collector collected while ``fn`` ran (automatic collections included)."""
    generations = []

    def record(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        fn()
    finally:
        gc.callbacks.remove(record)
    return generations


def test_a_failed_call_on_a_card_collects_every_generation_only_when_its_tensors_outlive_the_young_ones():
    from lightning_gpuopt.testing import SimulatedGpu

    seed = torch.ones(1 << 20)  # 4 MiB on the card once placed

    def step(old_cycle):
        activations = seed * 2
        if old_cycle:  # a cycle holding the tensor, moved to the oldest generation before the step fails
            holder = {"tensor": activations}
            holder["self"] = holder
            gc.collect()
        seed.repeat(32)  # 128 MiB: past the card

    with SimulatedGpu("H100", memory="64MiB") as gpu:
        gpu.place(seed)
        baseline = gpu.allocated_bytes
        outcomes = []
        young = _collected_generations(lambda: outcomes.append(call_catching_oom(step, False)))
        assert outcomes[-1].out_of_memory and gpu.allocated_bytes == baseline
        assert 2 not in young  # the failed step's own garbage is young: no full collection
        old = _collected_generations(lambda: outcomes.append(call_catching_oom(step, True)))
        assert outcomes[-1].out_of_memory and gpu.allocated_bytes == baseline  # freed by a full one
        assert old.count(2) == 2  # the step's own, and the one its held tensor asked for


def test_module_examples_run():
    assert doctest.testmod(memory, optionflags=doctest.ELLIPSIS).failed == 0


def test_objects_set_aside_keep_a_full_collection_to_what_the_block_made_and_leave_a_users_freeze_alone():
    from lightning_gpuopt.core.device import objects_set_aside

    class Node:
        pass

    def node_cycle():
        node = Node()
        node.self = node
        return weakref.ref(node)

    old = node_cycle()  # garbage from before the block: left to the collection after it
    assert gc.get_freeze_count() == 0
    with objects_set_aside():
        assert gc.get_freeze_count() > 0
        new = node_cycle()  # garbage the block made
        gc.collect()
        assert new() is None and old() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None

    gc.freeze()  # the user's own freeze (e.g. before forking workers) stays as it is
    try:
        frozen = gc.get_freeze_count()
        with objects_set_aside():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
