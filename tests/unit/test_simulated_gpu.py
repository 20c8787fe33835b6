"""The simulated CUDA card (``lightning_gpuopt.testing.SimulatedGpu``) and its caching-allocator model,
held against the torch profiler's allocator events and against known caching-allocator behaviour."""

from __future__ import annotations

import pytest
import torch
from helpers import profiler_peak_bytes, quiet_trainer
from lightning.pytorch.utilities.memory import is_oom_error
from torch import nn

from lightning_gpuopt.core.allocator import LARGE_BUFFER, SMALL_BUFFER, AllocatorOutOfMemory, CachingAllocatorModel
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.op_memory import LiveTensorTracker, storage_bytes
from lightning_gpuopt.testing import GPU_PROFILES, SimulatedGpu

MIB = 2**20


# ----------------------------------------------------------------------------- the allocator model


def test_a_freed_block_is_reused_without_reserving_more():
    allocator = CachingAllocatorModel(64 * MIB)
    first = allocator.malloc(300_000)
    reserved = allocator.reserved_bytes
    allocator.free(first)
    assert allocator.allocated_bytes == 0 and allocator.reserved_bytes == reserved  # cached, not returned
    allocator.malloc(250_000)
    assert allocator.reserved_bytes == reserved and allocator.stats.num_segments == 1


def test_reserved_memory_grows_by_segments():
    allocator = CachingAllocatorModel(1024 * MIB)
    allocator.malloc(100)  # small pool: a 2 MiB segment
    assert allocator.reserved_bytes == SMALL_BUFFER
    allocator.malloc(3 * MIB)  # large request under 10 MiB: a 20 MiB segment
    assert allocator.reserved_bytes == SMALL_BUFFER + LARGE_BUFFER
    allocator.malloc(3 * MIB)  # split from the same 20 MiB segment
    assert allocator.reserved_bytes == SMALL_BUFFER + LARGE_BUFFER
    allocator.malloc(15 * MIB + 1)  # 10 MiB and more: rounded up to 2 MiB
    assert allocator.reserved_bytes == SMALL_BUFFER + LARGE_BUFFER + 16 * MIB
    # the rest of that segment (under 1 MiB) is not split off a large block: the whole block is handed out
    assert allocator.allocated_bytes == 512 + 6 * MIB + 16 * MIB


def test_fragmentation_runs_out_of_memory_with_enough_free_bytes_in_total():
    allocator = CachingAllocatorModel(LARGE_BUFFER, total_bytes=LARGE_BUFFER)
    blocks = [allocator.malloc(3 * MIB) for _ in range(6)]  # 18 MiB out of one 20 MiB segment
    for block in blocks[::2]:
        allocator.free(block)  # 9 MiB free, in three 3 MiB holes, and 2 MiB at the end
    free_in_total = allocator.reserved_bytes - allocator.allocated_bytes
    assert free_in_total == 11 * MIB
    # torch names the segment it could not reserve (its alloc_size), not the request
    with pytest.raises(AllocatorOutOfMemory, match=r"CUDA out of memory\. Tried to allocate 20\.00 MiB") as error:
        allocator.malloc(5 * MIB)
    assert "11.00 MiB is reserved by PyTorch but unallocated" in str(error.value)
    assert allocator.stats.num_ooms == 1 and allocator.stats.num_alloc_retries == 1


def test_a_full_card_releases_cached_segments_before_giving_up():
    allocator = CachingAllocatorModel(40 * MIB)
    first, second = allocator.malloc(15 * MIB), allocator.malloc(15 * MIB)  # two 16 MiB segments
    allocator.free(first)
    allocator.malloc(20 * MIB)  # 32 + 20 > 40: the free 16 MiB segment goes back first
    assert allocator.reserved_bytes == 16 * MIB + 20 * MIB and allocator.stats.num_alloc_retries == 1
    assert second.allocated


def test_windows_measure_their_own_peak_without_resetting_the_process_peak():
    allocator = CachingAllocatorModel(64 * MIB)
    big = allocator.malloc(8 * MIB)
    allocator.free(big)
    window = allocator.open_window()
    small = allocator.malloc(1 * MIB)
    allocator.close_window(window)
    assert window.peak_allocated_bytes == 1 * MIB
    assert allocator.stats.peak_allocated_bytes == 8 * MIB  # what max_memory_allocated() would still say
    allocator.free(small)


# ----------------------------------------------------------------------------- the card against the profiler


def mlp():
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)), torch.randn(64, 512)


def cnn():
    network = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return network, torch.randn(32, 3, 32, 32)


def transformer():  # heads of 33 floats: not 16-byte aligned, so the card runs SDPA's math path, as the host does
    layer = nn.TransformerEncoderLayer(132, 4, 256, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(16, 64, 132)


@pytest.mark.parametrize("build", [mlp, cnn, transformer], ids=["mlp", "cnn-batchnorm", "transformer"])
def test_allocated_peak_of_a_step_is_its_storages_on_the_path_cuda_takes(build):
    """A card holds the step's storages in 512-byte blocks, with Adam on CUDA's multi-tensor path; the host
    profiler's events (the same path forced on the host) also count its kernels' own buffers."""

    def run(foreach):
        torch.manual_seed(0)
        network, x = build()
        optimizer = torch.optim.Adam(network.parameters(), foreach=foreach)

        def step():
            network(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # optimizer state exists from here on, as in any later step
        return network, x, optimizer, step

    network, x, optimizer, step = run(foreach=True)
    truth = profiler_peak_bytes(step, existing=(network, optimizer, x))
    with LiveTensorTracker(existing=(network, optimizer, x), granularity=512, workspaces=False) as storages:
        step()
    network, x, optimizer, step = run(foreach=None)  # torch's default: on a card, the multi-tensor path
    with SimulatedGpu("H100", cublas_workspace=0) as gpu:
        gpu.place(network, optimizer, x)
        with gpu.device.peak_meter() as meter:
            step()
    assert storages.peak_bytes <= meter.peak_bytes <= truth * 1.01 + 64 * 512
    assert meter.peak_reserved_bytes >= meter.peak_bytes
    assert optimizer.param_groups[0]["foreach"] is None  # the user's optimizer as it was


def test_an_allocation_past_the_card_raises_cudas_out_of_memory_and_takes_nothing():
    with SimulatedGpu("T4", memory="32MiB") as gpu:
        x = torch.ones(1000)
        gpu.place(x)
        held = gpu.allocated_bytes
        with pytest.raises(torch.OutOfMemoryError) as error:
            x.repeat(20_000)  # 80 MB
        assert is_oom_error(error.value)
        assert str(error.value).startswith(
            "CUDA out of memory. Tried to allocate 78.00 MiB. GPU 0 has a total capacity of 32.00 MiB"
        )
        assert gpu.allocated_bytes == held and gpu.allocator.stats.num_ooms == 1


def test_host_data_stays_off_the_card_and_what_the_model_touches_is_on_it():
    network, x = mlp()
    with SimulatedGpu("A100", memory="1GiB", cublas_workspace=0) as gpu:
        dataset = torch.randn(10_000, 512)  # a dataset built in host memory
        assert gpu.allocated_bytes == 0 and not gpu.device.holds(dataset)
        out = network(x)  # parameters, buffers and the batch move to the card at the first forward
        assert gpu.device.holds(out) and gpu.device.holds(x) and gpu.device.holds(network[0].weight)
        assert gpu.allocated_bytes >= storage_bytes(network, x, out)
        backup = network[0].weight.detach().to("cpu", copy=True)  # an explicit copy to the host
        assert not gpu.device.holds(backup)
        allocated = gpu.allocated_bytes
        with torch.no_grad():  # a copy from the host into the card (a weight put back): CUDA allocates nothing
            network[0].weight.copy_(backup)
        assert not gpu.device.holds(backup) and gpu.allocated_bytes == allocated


@pytest.mark.parametrize("name", sorted(GPU_PROFILES))
def test_every_profile_reports_its_identity_and_capabilities(name):
    profile_ = GPU_PROFILES[name]
    with SimulatedGpu(name) as gpu:
        card = device_for("cpu")
        assert card is gpu.device and card.is_cuda and card.type == "cuda"
        assert card.total_memory() == profile_.total_bytes
        assert card.free_memory() == profile_.total_bytes - profile_.context_bytes
        caps = card.capabilities
        assert caps.native_bf16 == (profile_.capability >= (8, 0)) and caps.mig == name.startswith("A100-MIG")
        assert card.uuid == profile_.uuid[4:] and card.describe() == f"cuda:0 ({profile_.name})"  # torch's bare hex
    assert not device_for("cpu").is_cuda  # gone with the block


def test_bad_arguments_name_the_argument_and_what_works():
    with pytest.raises(ValueError, match="`profile`='K80' is not a known card; expected one of 'H100'"):
        SimulatedGpu("K80")
    with pytest.raises(ValueError, match="`memory`='lots'"):
        SimulatedGpu("T4", memory="lots")
    with pytest.raises(ValueError, match="`nvml_error`='broken'"):
        SimulatedGpu("T4", nvml_error="broken")
    with SimulatedGpu("T4"), pytest.raises(RuntimeError, match="already entered"):
        SimulatedGpu("H100").__enter__()


def test_leaving_the_card_by_an_exception_puts_everything_back():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from lightning_gpuopt.core.nvml import nvml_library

    before = nvml_library()
    network, x = mlp()
    with pytest.raises(ValueError, match="user code failed"), SimulatedGpu("T4", memory="64MiB") as first:
        network(x)
        raise ValueError("user code failed")
    assert not device_for("cpu").is_cuda and not _get_current_dispatch_mode_stack()
    assert nvml_library() is before
    held, ops = first.allocated_bytes, first.device.busy_s
    with SimulatedGpu("H100", memory="64MiB", cublas_workspace=0) as second:
        network(x)  # a new card: the model moves to it at its first forward there
    network(x)  # outside every card
    assert first.allocated_bytes == held and first.device.busy_s == ops  # the first card's hooks are gone
    assert second.allocated_bytes >= storage_bytes(network, x)


def test_a_card_whose_nvml_refuses_still_trains_and_reports_no_utilisation(tmp_path):
    from helpers import MLP, preloaded_batches
    from torch.utils.data import DataLoader

    from lightning_gpuopt import DataWaitMonitor

    monitor = DataWaitMonitor(warmup_steps=1)
    with SimulatedGpu("A100", memory="256MiB", nvml_error="no-permission") as gpu:
        quiet_trainer(tmp_path, [monitor], max_steps=6).fit(
            MLP(), DataLoader(preloaded_batches(6, 16, 32), batch_size=None)
        )
    assert gpu.nvml.initialised == 0
    assert monitor.report.totals.steps == 5 and monitor.report.totals.gpu_util_mean is None
    assert monitor.report.gpu_idle_fraction is not None  # the card's events still time it


# ----------------------------------------------------------------------------- what a real card holds (issue 26)


def test_equal_free_blocks_go_lowest_address_first_and_a_new_segment_takes_the_lowest_gap():
    allocator = CachingAllocatorModel(64 * MIB)
    first, second = allocator.malloc(15 * MIB), allocator.malloc(15 * MIB)  # 16 MiB segments at 0 and 16 MiB
    allocator.free(first)
    allocator.empty_cache()  # the segment at address 0 goes back to the driver
    third = allocator.malloc(15 * MIB)  # a new segment, mapped at the lowest free addresses: 0
    allocator.free(second)
    allocator.free(third)
    assert (third.segment, second.segment) == (0, 16 * MIB)
    assert allocator.malloc(15 * MIB) is third  # torch orders equal sizes by address (the model used to by age)


def test_expandable_segments_map_pages_at_the_end_of_one_segment_per_pool(monkeypatch):
    allocator = CachingAllocatorModel(1024 * MIB, expandable=True)
    allocator.malloc(3 * MIB)  # one 20 MiB page of the large pool's segment
    allocator.malloc(30 * MIB)  # 17 MiB free at its end: one more page, not a second (30 MiB) segment
    assert (allocator.reserved_bytes, allocator.stats.num_segments) == (40 * MIB, 1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    with SimulatedGpu("T4", memory="256MiB") as gpu:
        assert gpu.allocator.expandable
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert not SimulatedGpu("T4").allocator.expandable


def test_out_of_memory_names_sizes_as_torch_formats_them_and_the_fraction_cap():
    allocator = CachingAllocatorModel(3 * MIB, total_bytes=8 * MIB)  # a memory fraction caps it below the card
    allocator.malloc(100)
    with pytest.raises(AllocatorOutOfMemory) as error:
        allocator.malloc(2 * MIB)  # a 20 MiB segment past the cap
    assert str(error.value).startswith(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 8.00 MiB of which 6.00 MiB "
        "is free. Including non-PyTorch memory, this process has 2.00 MiB memory in use. 3.00 MiB allowed; Of the "
        "allocated memory 512 bytes is allocated by PyTorch, and 2.00 MiB is reserved by PyTorch but unallocated."
    )


def test_profiles_total_what_torch_reports_and_nvml_its_own_figure():
    from lightning_gpuopt.core.allocator import format_size
    from lightning_gpuopt.core.nvml import read_usage

    totals = {name: format_size(GPU_PROFILES[name].total_bytes) for name in ("H100", "T4", "A100")}
    assert totals == {"H100": "79.11 GiB", "T4": "14.75 GiB", "A100": "39.39 GiB"}
    assert GPU_PROFILES["H100"].nvml_total_bytes == 81559 * MIB
    with SimulatedGpu("T4") as gpu:
        gpu.nvml.nvmlInit()
        handle = gpu.nvml.nvmlDeviceGetHandleByIndex(0)
        v1 = gpu.nvml.nvmlDeviceGetMemoryInfo(handle)
        _, used, total = read_usage(gpu.nvml, handle)
    assert total == 15360 * MIB and used == gpu.profile.context_bytes  # the driver's reserved 256 MiB apart
    assert v1.used == used + 256 * MIB  # the v1 struct counts it as used


def linear_step(gpu, width=1024):
    network = nn.Linear(width, width)
    x = torch.randn(8, width)
    gpu.place(network, x)
    before = gpu.allocated_bytes
    out = network(x)
    forward = gpu.allocated_bytes - before - storage_bytes(out, granularity=512)
    out.sum().backward()
    return forward, gpu.allocated_bytes - before - storage_bytes(
        out, network.weight.grad, network.bias.grad, granularity=512
    )


def test_cublas_keeps_one_workspace_per_thread_the_autograd_thread_from_the_first_backward(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with SimulatedGpu("T4", memory="1GiB") as gpu:
        forward, backward = linear_step(gpu)
    assert (forward, backward) == (8519680, 2 * 8519680)  # torch's default before Hopper: :4096:2:16:8
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what Lightning sets for deterministic=True
    with SimulatedGpu("T4", memory="1GiB") as gpu:
        assert linear_step(gpu) == (32 * MIB, 64 * MIB)
        allocated = gpu.allocated_bytes
        gpu.device.empty_cache()  # torch.cuda.empty_cache() keeps the workspaces
        assert gpu.allocated_bytes == allocated
        gpu.device.empty_cache(workspaces=True)  # torch._C._cuda_clearCublasWorkspaces() frees both
        assert gpu.allocated_bytes == allocated - 64 * MIB
        assert linear_step(gpu) == (32 * MIB, 64 * MIB)  # the next matmuls allocate them anew


def test_a_convolution_takes_a_transient_workspace_where_it_fits_and_runs_without_where_not():
    conv, x = nn.Conv2d(16, 16, 3, padding=1), torch.randn(32, 16, 64, 64)  # 8 MiB of input
    with SimulatedGpu("T4", memory="1GiB", cublas_workspace=0) as gpu:
        gpu.place(conv, x)
        with gpu.device.peak_meter() as meter:
            out = conv(x)
        assert meter.peak_bytes >= gpu.allocated_bytes + x.numel() * 4  # output and workspace at once
    with SimulatedGpu("T4", memory="22MiB", context_memory=0, cublas_workspace=0) as gpu:
        gpu.place(conv, x)  # a small segment (the weights) and a large one, 8 MiB of it the input
        out = conv(x)  # 8 MiB of output, no room for a workspace: cuDNN picks an algorithm without one
        assert gpu.device.holds(out)


def test_foreach_optimizer_temporaries_about_the_parameters_at_the_step():
    network = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    optimizer = torch.optim.Adam(network.parameters())
    network(torch.randn(4, 256)).sum().backward()
    optimizer.step()  # the state exists
    network(torch.randn(4, 256)).sum().backward()
    params = storage_bytes(*network.parameters(), granularity=512)
    with SimulatedGpu("H100", cublas_workspace=0) as gpu:
        gpu.place(network, optimizer)
        before = gpu.allocated_bytes
        with gpu.device.peak_meter() as meter:
            optimizer.step()
    assert meter.peak_bytes - before >= params  # the single-tensor path holds one parameter's worth
    assert optimizer.param_groups[0]["foreach"] is None
    with SimulatedGpu("H100", memory="11MiB", context_memory=0, cublas_workspace=0) as gpu:
        gpu.place(network, optimizer)
        with pytest.raises(torch.OutOfMemoryError):
            optimizer.step()  # the temporaries do not fit
    assert optimizer.param_groups[0]["foreach"] is None  # the user's optimizer as it was


def test_attention_is_charged_as_the_cards_fused_kernel_not_the_host_math_path():
    """sm90 runs SDPA as memory-efficient attention: output + float32 logsumexp, never the L x L matrix (8 MiB)."""
    torch.manual_seed(0)
    with SimulatedGpu("H100") as gpu:
        q, k, v = (torch.randn(2, 4, 512, 16, requires_grad=True) for _ in range(3))
        gpu.place(q, k, v)
        base = gpu.allocated_bytes
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        assert gpu.allocated_bytes - base == 2 * 4 * 512 * 16 * 4 + 2 * 4 * 512 * 4  # output + logsumexp
        out.sum().backward()
        assert gpu.peak_allocated_bytes - base < 2**21  # the 8 MiB attention matrix never reached the card
        assert q.grad is not None and k.grad is not None and v.grad is not None


def test_a_loader_without_workers_builds_its_batches_on_the_host_and_the_card_counts_them_at_the_forward():
    network, _ = mlp()
    iterator_class = torch.utils.data.dataloader._SingleProcessDataLoaderIter
    fetch, modes = iterator_class._next_data, []

    class CardData(torch.utils.data.Dataset):  # a dataset kept on the card
        def __init__(self, gpu):
            self.data = torch.randn(64, 512)
            gpu.place(self.data)

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            modes.append(torch.utils._python_dispatch._get_current_dispatch_mode())
            return self.data[index]

    with SimulatedGpu("A100", memory="1GiB", cublas_workspace=0) as gpu:
        gpu.place(network)
        iterator = iter(torch.utils.data.DataLoader(CardData(gpu), batch_size=32))
        held = gpu.allocated_bytes
        batch = next(iterator)
        assert modes == [None] * 32 and gpu.allocated_bytes == held  # no op of the fetch reached the card
        with gpu.device.peak_meter() as meter:
            network(batch)
        assert gpu.device.holds(batch) and meter.peak_bytes >= batch.numel() * 4  # counted as it enters the model
    assert iterator_class._next_data is fetch
