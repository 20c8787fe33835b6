"""Smoke test of ``benchmarks/oom_recovery.py`` on its smallest setting: without recovery the run
dies at the batch with the long samples, with it the run finishes having adapted that step only,
and its weights equal the unsplit run by hand. Nothing is written to RESULTS.md."""

from __future__ import annotations

import importlib.util
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "oom_recovery.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("oom_recovery_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_smoke_setting_dies_without_recovery_and_finishes_equal_to_the_truth_with_it(tmp_path, capsys):
    bench = load_benchmark()
    runs, figures = bench.measure(bench.SMOKE, str(tmp_path))
    raised, adapted, longest, truth = runs
    assert not raised.finished and raised.died_at == figures["long_step"]
    assert adapted.finished and adapted.adapted_steps == [figures["long_step"]]
    assert longest.finished and not longest.adapted_steps
    for run in (adapted, longest):
        _absolute, relative = bench.distance(run.weights, truth.weights)
        assert relative < 1e-5, run.name
    print(bench.table(runs, truth))
    assert "no: OOM at step" in capsys.readouterr().out
