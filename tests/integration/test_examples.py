"""Every example in examples/ runs, at a small size, in this process (a smoke test: each is a few seconds).

The examples are scripts, not modules of the package: each is loaded from its file. ``cli_train.py`` has its
own tests (test_gpuopt_cli.py). The user's pytest file is imported here, not collected: pyproject's
``testpaths`` leave examples/ out, so it runs once."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from helpers import REPO

EXAMPLES = REPO / "examples"


def load(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_are_left_out_of_the_test_paths(pytestconfig):
    assert not any(Path(path).parts[0] == "examples" for path in pytestconfig.getini("testpaths"))


def test_gpuopt_with_a_datamodule(tmp_path, capsys):
    argv = ["--samples", "256", "--global-batch-size", "64", "--steps", "3", "--root-dir", str(tmp_path)]
    gpuopt = load("gpuopt_datamodule").main(argv)
    plan = gpuopt.report.memory_fill
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 64
    assert f"= {plan.global_batch_size} samples per step" in capsys.readouterr().out


def test_batch_size_search_alone(tmp_path, capsys):
    search = load("batch_size_search").main(["--samples", "256", "--steps", "2", "--root-dir", str(tmp_path)])
    assert search.result.batch_size == 256  # the whole small dataset fits the 16 MB budget
    assert "batch size set: 256, the largest that trained in" in capsys.readouterr().out


def test_the_users_simulated_gpu_test(tmp_path):
    module = load("test_my_model_fits")
    module.test_my_model_trains_a_global_batch_of_256_on_a_t4(tmp_path)


def test_quickstart_the_make_demo_target(tmp_path, capsys, monkeypatch):
    threads = torch.get_num_threads()  # the demo runs on one intra-op thread
    try:
        argv = ["--samples", "96", "--epochs", "1", "--delay-ms", "0.2", "--tune-seconds", "1"]
        load("quickstart").main([*argv, "--root-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "=== Run 2: the same, with DataLoaderTuner ===" in out and "samples/s" in out
    # the verdict after the speed-up is the second run's own measurement, said so (not "input-bound → input-bound")
    assert "Verdict of run 2, measured again after tuning: " in out and "verdict input-bound →" not in out
    assert len(list(tmp_path.rglob("gpuopt_report.json"))) == 2
