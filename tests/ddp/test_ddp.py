"""Every callback under DDP: 2 CPU processes (gloo) launched the way users launch them.

One launch of ``ddp_script.py`` runs every scenario in turn (a process start and a process group for
all of them, as a user's script that fits several times); each test reads its scenario's files.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import rank_json, run_ddp, usable_cores_from_the_os

from lightning_gpuopt import DataWaitReport
from lightning_gpuopt.core.report import REPORT_FILENAME, from_dict, read_json

pytestmark = pytest.mark.xdist_group("ddp")  # the tests on one worker
MODES = ("monitor", "tune", "memory", "search", "fill", "oom", "simulated", "nothing-fits")


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """The launch, once per test session: its output sits in the session's folder (shared by xdist's workers,
    behind a lock), so a worker or a fixture set up again reads it instead of launching again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, done = root / "ddp-launch", root / "ddp-launch.json"
    with open(root / "ddp-launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            result = run_ddp(out, ",".join(MODES), timeout=900)
            done.write_text(json.dumps({"stdout": result.stdout, "stderr": result.stderr}))
    saved = json.loads(done.read_text())
    return subprocess.CompletedProcess([], 0, saved["stdout"], saved["stderr"]), out


def test_ddp_two_processes_rank_zero_reports_both_ranks_and_names_the_straggler(launched):
    result, out = launched
    tmp_path = out / "monitor"

    report = from_dict(DataWaitReport, json.loads((tmp_path / "gpuopt_report.json").read_text())["data_wait"])
    assert report.world_size == 2
    assert len(report.ranks) == 2  # in rank order
    assert all(figures.steps == 20 - 2 for figures in report.ranks)
    fast, slow = report.ranks
    # rank 1 sleeps 4 ms per sample, rank 0 1 ms: 8-sample batches. Against what each rank's samples
    # really took (a loaded machine oversleeps), plus at most 2 ms a step of collation and overhead; steps not
    # sampled are the gap less the sampled steps' mean rest (a stall in a sampled gap lowers them a little)
    truth = [json.loads((tmp_path / f"rank{rank}.json").read_text())["loading_per_step_s"] for rank in (0, 1)]
    assert truth[1] >= 0.032 and truth[0] >= 0.008
    for rank, figures in enumerate(report.ranks):
        assert 0.9 * truth[rank] <= figures.data_wait_per_step_s <= truth[rank] * 1.1 + 0.002
    spread = report.rank_spread["data_wait_per_step_s"]
    assert spread.min == fast.data_wait_per_step_s and spread.max == slow.data_wait_per_step_s
    assert report.diagnosis.straggler_rank == 1
    assert any(advice.startswith("rank 1 is a straggler") for advice in report.recommendations)
    assert report.totals.samples == 2 * 18 * 8  # the whole job's samples

    # both ranks concluded the same
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        del rank["loading_per_step_s"]
    assert ranks[0] == ranks[1]
    assert ranks[0]["straggler_rank"] == 1 and ranks[0]["world_size"] == 2
    assert "rank 1 is a straggler" in result.stdout + result.stderr  # rank 0 logged the table


def test_ddp_tuner_ranks_use_rank_zeros_choice_with_the_distributed_sampler(launched):
    ranks = [json.loads((launched[1] / "tune" / f"tune{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["chosen"] == ranks[1]["chosen"]
    for rank in ranks:
        assert rank["used"] == rank["chosen"][:1] + rank["chosen"][1:]  # what each rank's fit used
        assert rank["used"][0] > 0  # sleeping loader: workers help
        assert rank["usable_cpus"] == max(1, usable_cores_from_the_os() // 2)  # the cores shared by 2 ranks
        assert rank["sampler"] == "DistributedSampler"  # Lightning still injected it into the rebuilt loader


def test_ddp_batch_size_search_ranks_agree_on_the_smaller_fit(launched, tmp_path):
    from helpers import fits_independently
    from models_memory import make_model

    from lightning_gpuopt.core.memory import parse_memory
    from lightning_gpuopt.core.op_memory import storage_bytes

    ranks = [json.loads((launched[1] / "search" / f"search{rank}.json").read_text()) for rank in (0, 1)]
    size = ranks[0]["result"]["batch_size"]
    assert ranks[1]["result"]["batch_size"] == size and [r["used"] for r in ranks] == [size, size]
    assert [t["batch_size"] for t in ranks[0]["result"]["trials"]] == [
        t["batch_size"] for t in ranks[1]["result"]["trials"]
    ]
    assert all(r["global_step"] == 2 for r in ranks) and len(ranks[0]["result"]["trials"]) <= 8
    # independent check: a single process with rank 1's cap, less DDP's gradient buckets (a copy of
    # the gradients, which the trials count as a baseline), fits `size` but not the next size the search
    # claims does not fit (`size + 1` when "bracketed"; its smallest miss, at most 1/64 above, when "within
    # tolerance"), while rank 0's larger cap would have fitted that size: the smaller budget decided, on both ranks
    result = ranks[0]["result"]
    miss = min(t["batch_size"] for t in result["trials"] if not t["fits"])
    above = size + 1 if result["stop_reason"] == "bracketed" else miss
    assert result["stop_reason"] in ("bracketed", "within tolerance") and miss - size <= max(1, size / 64)
    buckets = storage_bytes(list(make_model("mlp").parameters()))
    small, large = (int(parse_memory(budget) * 0.9) - buckets for budget in ("16MB", "20MB"))
    assert fits_independently(tmp_path, "mlp", size, small, samples=2048)
    assert not fits_independently(tmp_path, "mlp", above, small, samples=2048)
    assert fits_independently(tmp_path, "mlp", above, large, samples=2048)


def test_ddp_memory_fill_ranks_agree_on_one_plan(launched):
    plans = [json.loads((launched[1] / "fill" / f"fill{rank}.json").read_text()) for rank in (0, 1)]
    first = plans[0]["plan"]
    # rank 1's budget needs checkpointing for micro-batches of 8; rank 0's does not: both checkpoint
    assert first["checkpointing"] and first["checkpointed_classes"] == ["TransformerEncoderLayer"]
    for seen in plans:
        plan = seen["plan"]
        assert {
            k: plan[k] for k in ("micro_batch_size", "accumulate_grad_batches", "checkpointing", "largest_fit")
        } == {k: first[k] for k in ("micro_batch_size", "accumulate_grad_batches", "checkpointing", "largest_fit")}
        assert plan["global_batch_size"] == 64 == plan["micro_batch_size"] * plan["accumulate_grad_batches"] * 2
        assert seen["used"] == [plan["micro_batch_size"], plan["accumulate_grad_batches"], True]
        assert seen["global_step"] == 2
    assert first["micro_batch_size"] < 32  # the tight rank's budget set it


def test_ddp_on_simulated_cards_ranks_agree_on_the_tighter_card(launched):
    ranks = [json.loads((launched[1] / "simulated" / f"simulated{rank}.json").read_text()) for rank in (0, 1)]
    plans = [rank["plan"] for rank in ranks]
    keys = ("precision", "micro_batch_size", "accumulate_grad_batches", "largest_fit")
    assert {k: plans[0][k] for k in keys} == {k: plans[1][k] for k in keys}
    assert plans[0]["precision"] == "bf16-mixed"  # an A100: native bfloat16
    assert plans[0]["micro_batch_size"] * plans[0]["accumulate_grad_batches"] * 2 == 512
    assert plans[0]["accumulate_grad_batches"] > 1  # rank 1's 48 MiB card decided; rank 0's fits 256 whole
    assert all(rank["global_step"] == 2 for rank in ranks)
    assert all(rank["peak_reserved"] <= rank["card"] for rank in ranks)  # no card ran out


def test_ddp_nothing_fits_names_each_ranks_own_budget_and_cap(launched):
    import re

    from ddp_script import NOTHING_FITS_BUDGETS

    from lightning_gpuopt.core.memory import parse_memory

    result, tmp_path = launched[0], launched[1] / "nothing-fits"
    caps = [int(parse_memory(budget) * (1 - 0.1)) for budget in NOTHING_FITS_BUDGETS]  # max_memory less margin
    for rank in (0, 1):
        message = rank_json(result, tmp_path / f"nothing{rank}.json")["message"]
        print(f"rank {rank}: {message}")
        assert f"the budget of the tightest rank, 26.4 KiB ({min(caps)} bytes)" in message
        sides = dict(re.findall(r"rank (\d) (.*?)(?=; rank \d |\. Measured|\. Try)", message))
        assert set(sides) == {"0", "1"}, message
        for other, cap in enumerate(caps):  # each rank's figures are its own, on every rank's message
            assert "its cap of" in sides[str(other)] and f"({cap} bytes)" in sides[str(other)], message
            assert f"({caps[1 - other]} bytes)" not in sides[str(other)].split(": CUDA")[0], message
        assert "max_memory='60KB'" not in message  # rank 0's setting is not set beside rank 1's budget


def test_ddp_out_of_memory_on_rank_1_only_both_ranks_adapt_in_the_same_step_and_match_a_run_by_hand(launched):
    import torch
    from ddp_script import OOM_LONG, oom_rank_indices
    from oom_models import TokenModel, VariableLengthDataset, pad_collate
    from torch.nn import functional as F

    result, tmp_path = launched[0], launched[1] / "oom"  # a hang would time out the launch
    ranks = [rank_json(result, tmp_path / f"oom{rank}.json") for rank in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["global_step"] == 4
    adaptations = ranks[0]["adaptations"]
    # rank 1's third batch holds the long samples (step 2); a short step may run out first when the
    # host is loaded (gloo's buffers are freed late): the point is the one decision, in one step, on both ranks
    assert adaptations and len({a["step"] for a in adaptations}) == 1
    assert all(a["reason"].startswith("out of memory on rank ") for a in adaptations)
    # the truth: each step, the mean of the two ranks' losses on their own (padded) batches, unsplit
    dataset = VariableLengthDataset(64, long_at=OOM_LONG, long=128)
    model = TokenModel(dataset)
    optimizer = model.configure_optimizers()
    indices = oom_rank_indices()
    for step in range(4):
        optimizer.zero_grad()
        losses = []
        for rank in (0, 1):
            tokens, labels = pad_collate([dataset[i] for i in indices[rank][8 * step : 8 * step + 8]])
            losses.append(F.cross_entropy(model(tokens), labels))
        (sum(losses) / 2).backward()
        optimizer.step()
    for rank in (0, 1):
        trained = torch.load(tmp_path / f"oom{rank}.pt")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(trained[name], value, rtol=1e-6, atol=1e-6, msg=f"rank {rank}: {name}")


def test_each_ddp_rank_estimates_its_own_without_deadlock(launched):
    report = read_json(launched[1] / "memory" / REPORT_FILENAME)["memory"]  # written by rank 0
    assert report["method"] == "traced" and report["measured_peak_bytes"] > 0
    assert report["untraced_bytes"] == report["grads_bytes"]  # DDP's gradient buckets
    assert abs(report["estimate_error"]) <= 0.05  # the estimate's tolerance (integration/test_estimate.py)
