"""Smoke test of ``benchmarks/search_vs_lightning.py``'s simulated-H100 path on its smallest setting
(one tiny model, an 80 MiB card): every method runs, every found size is checked with a whole
shuffled epoch, and the truth is bisected. Nothing is written to RESULTS.md."""

from __future__ import annotations

import importlib.util
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "search_vs_lightning.py"
METHODS = ["BatchSizeSearch()", "BatchSizeSearch(margin=0)", "Lightning power", "Lightning binsearch"]


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
    by_method = {method: figures for _, method, figures, _ in rows}
    truth = rows[0][3]
    assert set(METHODS) <= set(by_method) and truth >= 1
    card = bench.SMOKE_WORKLOADS[0]
    for method in METHODS:
        figures = by_method[method]
        check = figures["check"]
        assert figures["trials"] >= 1 and figures["steps"] >= 1 and check.batch_size == figures["batch"]
        assert check.peak_reserved <= bench.parse_memory(card.memory)
    # ours tests every size it returns: it trains a whole shuffled epoch on the same card, so the
    # bisection (seeded with it) finds a truth at least as large
    for method in METHODS[:2]:
        assert by_method[method]["check"].trains and by_method[method]["batch"] <= truth
    assert by_method["truth: epochs bisected"]["check"].trains
    assert "simulated H100" in capsys.readouterr().out
