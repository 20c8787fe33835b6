"""The dry run of ``make gpu-check`` (``benchmarks/gpu_check.py``): without a CUDA card every section runs on
a simulated H100 through the same code a real card runs, ``--quick`` (one model, one batch size, one small
cap). The simulated card checked against a simulator of itself must agree exactly; the JSON must hold
every section's figures and no error."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys

import pytest
from helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
MIB = 2**20


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def lightning_log_levels_kept():
    """The script quiets Lightning's loggers for its own process: put them back for the tests that follow."""
    names = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_dry_run_writes_every_section_and_the_simulator_agrees_with_itself(tmp_path):
    script = load_script()
    assert script.main(["--out", str(tmp_path), "--quick", "--dry-run"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert result["dry_run"] is True and set(sections) == set(script.SECTIONS)
    assert not [name for name, section in sections.items() if "error" in section]

    identity = sections["identity"]
    assert identity["name"] == "NVIDIA H100 80GB HBM3" and identity["capability"] == [9, 0]
    assert identity["uuid_nvml"].endswith(identity["uuid_torch"].removeprefix("GPU-"))
    assert identity["total_nvml"] >= identity["total_torch_mem_get_info"] > 0  # NVML counts what torch cannot use
    assert identity["context_after_step"] >= identity["context_before_step"] > 0

    # the first matmul takes the cuBLAS workspace (32 MiB from capability 9.0)
    assert sections["workspaces"]["matmul"] == 32 * MIB and sections["workspaces"]["workspace_blocks"] >= 1

    replay = sections["allocator_replay"]
    assert replay["alloc"] > 0 and replay["segment_alloc"] > 0 and replay["first_divergence"] is None
    assert replay["model_reserved_end"] == replay["card_reserved_end"] > 0

    (row,) = sections["simulator"]["rows"]
    assert row["card_allocated"] == row["simulated_allocated"] > 32 * MIB
    assert row["card_reserved"] == row["simulated_reserved"] >= row["card_allocated"]
    (meter,) = sections["meters"]["rows"]
    assert meter["meter"] == meter["max_memory_allocated"] > 0

    (cap,) = sections["largest_batch"]["rows"]
    assert cap["by_hand"] >= 1 and cap["search_card"] == cap["search_simulated"] >= 1
    assert sections["nvml"]["util_mean"] is not None and sections["nvml"]["samples"] > 0

    checks = {name: ok for name, ok, _figure in result["checks"]}
    assert checks["allocator replay: no divergence"] and checks["peak meter mlp = max_memory_allocated"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert (
        markdown.startswith("## gpu_check.py (dry run)")
        and "| simulator mlp b=8 peak allocated within 5% | yes |" in markdown
    )


def test_replay_reads_torchs_trace_and_reports_the_first_divergence():
    """A trace in ``torch.cuda.memory._snapshot()``'s shape: requests up to 1 MiB share a 2 MiB segment, a 5 MiB
    request takes a 20 MiB one, ``free_requested`` is not yet a free, ``empty_cache`` releases the free segments."""
    script = load_script()
    trace = [
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 * MIB, "stream": 0},
        {"action": "alloc", "addr": 0x1000, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 0x1400, "size": 3000, "stream": 0},
        {"action": "segment_alloc", "addr": 0x9000, "size": 20 * MIB, "stream": 0},
        {"action": "alloc", "addr": 0x9000, "size": 5 * MIB, "stream": 0},
        {"action": "free_requested", "addr": 0x9000, "size": 5 * MIB, "stream": 0},
        {"action": "free_completed", "addr": 0x9000, "size": 5 * MIB, "stream": 0},
        {"action": "segment_free", "addr": 0x9000, "size": 20 * MIB, "stream": 0},
        {"action": "alloc", "addr": 0x2000, "size": 512, "stream": 0},
    ]
    result = script.replay(trace, limit=80 * 2**30)
    assert result["first_divergence"] is None and result["alloc"] == 4 and result["free"] == 1
    assert result["model_reserved_end"] == result["card_reserved_end"] == 2 * MIB

    trace[3]["size"] = 6 * MIB  # a card that reserves a 5 MiB request in a 6 MiB segment
    first = script.replay(trace, limit=80 * 2**30)["first_divergence"]
    assert first["event"] == 4 and first["card_reserved"] == 8 * MIB and first["model_reserved"] == 22 * MIB
    # what the next card run needs to see why: the events around it and both sides' segments there
    assert [e["action"] for e in first["events_around"]][:5] == [e["action"] for e in trace[:5]]
    card_segments = first["card_segment_list"]
    assert [(s["addr"], s["size"]) for s in card_segments] == [(0x1000, 2 * MIB), (0x9000, 6 * MIB)]
    assert card_segments[1]["live_blocks"] == [0x9000] and card_segments[1]["live_bytes"] == 5 * MIB
    assert [(s["small"], s["size"], s["live_bytes"]) for s in first["model_segment_list"]] == [
        (True, 2 * MIB, 4096),
        (False, 20 * MIB, 5 * MIB),
    ]
