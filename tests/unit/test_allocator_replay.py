"""The replay of a step's allocations through the caching allocator's model (``core/allocator.py``), and the
events a fake trace records for it; each expected peak is worked out from the allocator's rules."""

from __future__ import annotations

import torch

from lightning_gpuopt.core.allocator import AllocationTrace, largest_replayed_fit, replay
from lightning_gpuopt.core.op_memory import LiveTensorTracker
from lightning_gpuopt.core.search import search_largest_fit

MIB = 2**20
KB600 = 600_064  # 600,000 bytes rounded up to 512: three fit a 2 MiB small-pool segment


def test_small_requests_share_2_mib_segments_and_a_freed_hole_too_small_for_the_next_one_costs_a_segment():
    # four of 600 kB: three in the first segment, one in a second; free the first and third (their holes: 600 kB
    # and 600 kB + the 297 kB tail merged); each 1 MiB request then fits no hole: the second segment's rest, then a third
    trace = AllocationTrace((KB600,) * 4 + (MIB, MIB), (-1, -1, -1, -1, 0, 2, -1, -1))
    assert replay(trace, 64 * MIB) == 6 * MIB  # 3.2 MB allocated at the end, 6 MiB reserved
    assert replay(trace, 5 * MIB) is None  # a third segment does not fit: CUDA's out-of-memory error


def test_a_request_past_the_cap_first_releases_the_cached_segments():
    trace = AllocationTrace((12 * MIB, 14 * MIB), (-1, 0, -1))  # 12 MiB freed (cached), then 14 MiB
    assert replay(trace, 64 * MIB) == 26 * MIB
    assert replay(trace, 20 * MIB) == 14 * MIB  # the 12 MiB segment went back to the driver first
    assert replay(trace, 13 * MIB) is None


def test_a_kernels_workspace_is_freed_at_once_and_left_out_where_it_does_not_fit():
    trace = AllocationTrace((12 * MIB, 12 * MIB, 512), (-1, -2, -1))
    assert replay(trace, 64 * MIB) == 24 * MIB + 2 * MIB
    assert replay(trace, 16 * MIB) == 14 * MIB  # no room for the workspace: the kernel ran without it


def test_a_repeated_step_frees_what_its_previous_step_kept_in_place_and_makes_what_it_keeps_alone_once():
    # before the step: a gradient g; the step: a workspace w kept (made once), activation a, free g, g', free a
    trace = AllocationTrace((12 * MIB, 4 * MIB, 12 * MIB, 12 * MIB), (-1, -1, -1, 0, -1, 2), step=1)
    one = replay(trace, 256 * MIB)
    assert one == 12 * MIB + 20 * MIB  # g's segment; w and a share a 20 MiB one (a fits its 16 MiB rest); g' in g's
    assert replay(trace, 256 * MIB, steps=3) == one
    leaking = AllocationTrace((12 * MIB, 12 * MIB), (-1, -1), step=1)  # keeps one of its own each step
    assert replay(leaking, 256 * MIB, steps=3) == 12 * MIB + 12 * MIB  # kept in no one's place: made once


def test_a_trace_at_another_batch_puts_each_allocation_on_its_line_rounded_to_512_bytes():
    at_2, at_4 = AllocationTrace((1000, 4000), (-1, -1, 0)), AllocationTrace((1000, 8000), (-1, -1, 0))
    assert at_2.at(7, 2, at_4, 4) == AllocationTrace((1024, 14336), (-1, -1, 0))  # 4000 + 2000 * 5 = 14000


def test_the_largest_replayed_fit_counts_whole_segments_and_needs_two_traces_with_the_same_events():
    # a 512-byte persistent block (a 2 MiB small segment) and b MiB of activations (a segment of whole 2 MiB)
    traces = {b: AllocationTrace((512, b * MIB), (-1, -1)) for b in (10, 20)}
    assert largest_replayed_fit(traces, 64 * MIB, upper=1000) == 62
    assert largest_replayed_fit(traces, 64 * MIB, upper=40) == 40
    traces[20] = AllocationTrace((512, 20 * MIB, 512), (-1, -1, -1))  # data-dependent: the events differ
    assert largest_replayed_fit(traces, 64 * MIB, upper=1000) is None


def test_a_recording_tracker_lists_each_storages_allocation_and_free_in_order():
    x = torch.ones(1000)
    with LiveTensorTracker(existing=(x,), granularity=512, workspaces=False, record=True) as tracker:
        y = x * 2
        del y
        z = x + 1
    assert (tracker.sizes, tracker.events) == ([4096, 4096, 4096], [-1, -1, 1, -1])
    assert z.shape == x.shape
    with LiveTensorTracker(existing=(x,), workspaces=False) as plain:
        x * 2
    assert (plain.sizes, plain.events) == (None, [])


def test_a_search_near_the_limit_walks_from_a_prediction_that_fits_where_the_line_of_its_peaks_is_far_off():
    def fits(batch_size: int) -> tuple[bool, int]:  # fits up to 100; the peaks say half of what it holds
        return batch_size <= 100, 500_000 * batch_size

    search = dict(budget_bytes=100_000_000, start=98, max_batch_size=4096, tolerance=1 / 64, bytes_per_sample=500_000)
    near = search_largest_fit(fits, **search, near=True)
    assert near.batch_size == 100
    assert [t.batch_size for t in near.trials] == [98, 99, 102, 100, 101]  # steps of 1/64, 2/64, then the bracket
    far = search_largest_fit(fits, **search)
    assert far.batch_size == 100 and len(far.trials) > len(near.trials)  # 98, then 4x: 392 ...
