"""Smoke test of ``benchmarks/search_vs_lightning.py``'s simulated-card path on its smallest setting
(one tiny model, an 80 MiB card): every method runs, every found size is checked with a whole
shuffled epoch, and the truth is bisected. Nothing is written to RESULTS.md."""

from __future__ import annotations

import importlib.util
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "search_vs_lightning.py"
METHODS = ["BatchSizeSearch()", "Lightning binsearch"]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("search_vs_lightning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_simulated_path_runs_checks_and_bisects_on_the_smallest_setting(capsys):
    bench = load_benchmark()
    rows, notes = bench.run_simulated(bench.SMOKE_WORKLOADS, echo=lambda _: None)
    bench.print_and_record_simulated(rows, notes, no_write=True, wall_seconds=0.0)
    ((workload, methods),) = rows
    truth = methods["truth"]["batch"]
    assert set(METHODS) <= set(methods) and truth >= 1
    for method in METHODS:
        figures = methods[method]
        check = figures["check"]
        assert figures["trials"] >= 1 and figures["steps"] >= 1 and check.batch_size == figures["batch"]
        assert check.peak_reserved <= bench.parse_memory(workload.memory)
    # ours with its defaults: it trains a whole shuffled epoch on the same card, within 5% of the truth
    ours = methods["BatchSizeSearch()"]
    assert ours["check"].trains and 0.95 * truth <= ours["batch"] <= truth
    assert methods["truth"]["check"].trains
    assert "simulated cards" in capsys.readouterr().out


def test_a_size_found_at_the_edge_of_the_card_keeps_training():
    """GRU on a simulated H100 of 96 MiB: every size near the limit reserves all but 0.6 MiB of the card, and 50
    first runs out of memory at its 4th step (a new 2 MiB small-pool segment). Its 2-step trial fitted; the
    trial at the edge now runs as many steps again, so the size found trains ten full batches."""
    bench = load_benchmark()
    (workload,) = [w for w in bench.SIMULATED_WORKLOADS if w.name == "GRU" and w.card == "H100"]
    found = bench.run_ours_simulated(workload)
    checker = bench.EpochChecker(workload)
    assert checker.check(found["batch"]).trains
    assert not checker.check(found["batch"] + 1).trains  # the limit itself, not a size below it
    assert found["steps"] > 2 * found["trials"]  # the trials at the edge ran longer
