"""GpuOptCLI through examples/cli_train.py: its ``main()`` run in this process with the command line a
user types (``sys.argv``), and once as a subprocess, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO as ROOT

from lightning_gpuopt.cli.lightning_cli import preset_flag_as_key

SCRIPT = ROOT / "examples" / "cli_train.py"
CONFIGS = ROOT / "examples" / "configs"
QUICK = ["--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false", "--model.num_samples", "256"]


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train(tmp_path, monkeypatch, capsys):
    """``python examples/cli_train.py fit ARGS`` in this process: its exit status and output; the
    environment variables it sets (Lightning's seed) are put back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as Python does for the script it runs: examples/models.py
    environment = dict(os.environ)

    def run(tmp_path: Path, *args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
        argv = [str(script), "fit", *args, "--trainer.default_root_dir", str(tmp_path)]
        monkeypatch.setattr(sys, "argv", argv)
        try:
            load_script(script).main()
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, captured.out, captured.err)

    yield run
    os.environ.clear()
    os.environ.update(environment)


def in_subprocess(tmp_path: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), "fit", *args, "--trainer.default_root_dir", str(tmp_path)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def saved_config(tmp_path: Path) -> dict:
    (path,) = tmp_path.rglob("config.yaml")
    return yaml.safe_load(path.read_text())


def report(tmp_path: Path) -> dict:
    (path,) = tmp_path.rglob("gpuopt_report.json")
    return json.loads(path.read_text())


def test_fit_gpuopt_diagnose_measures_and_saves_its_settings(tmp_path):
    ran(in_subprocess(tmp_path, SCRIPT, "--gpuopt", "diagnose", *QUICK))
    config = saved_config(tmp_path)["gpuopt"]
    assert config["preset"] == "diagnose" and config["monitor"] is True and config["fill_memory"] is False
    saved = report(tmp_path)
    assert saved["gpuopt"]["changes"] == [] and saved["data_wait"]["diagnosis"]["verdict"]


def test_fit_gpuopt_yaml_file_extending_a_preset(tmp_path, train):
    ran(train(tmp_path, "--gpuopt", str(CONFIGS / "team.yaml"), *QUICK))
    config = saved_config(tmp_path)["gpuopt"]
    assert (config["activation_checkpointing"], config["min_micro_batch_size"], config["global_batch_size"]) == (
        "auto",
        4,
        128,
    )
    plan = report(tmp_path)["memory_fill"]
    assert plan["micro_batch_size"] * plan["accumulate_grad_batches"] == 128


def test_fit_dotted_override_changes_one_setting(tmp_path, train):
    ran(
        train(
            tmp_path,
            "--gpuopt",
            "fill-memory",
            "--gpuopt.max_memory",
            "40MB",
            "--gpuopt.precision",
            "bf16-mixed",
            *QUICK,
        )
    )
    assert saved_config(tmp_path)["gpuopt"]["precision"] == "bf16-mixed"
    assert report(tmp_path)["gpuopt"]["changes"][0] == "precision: 32-true → bf16-mixed"


@pytest.mark.parametrize("config", ["fill-memory-cli.yaml", "fill-memory-lightningcli.yaml"])
def test_fit_config_file_with_a_preset(tmp_path, train, config):
    ran(train(tmp_path, "--config", str(CONFIGS / config), *QUICK))
    saved = report(tmp_path)
    assert saved["gpuopt"]["preset"] == "fill-memory"
    assert saved["gpuopt"]["changes"] == ["batch size: 32 → 64"]  # global batch 64 fits whole in 40 MB


def test_unknown_preset_fails_with_the_valid_ones(tmp_path, train):
    result = train(tmp_path, "--gpuopt", "fast", *QUICK)
    assert result.returncode == 2
    assert (
        "unknown preset 'fast': expected one of 'diagnose', 'fill-memory', 'low-memory', 'max-throughput'"
        in result.stderr
    )
    assert not list(tmp_path.rglob("gpuopt_report.json"))  # nothing ran


def test_without_the_flag_nothing_is_added(tmp_path, train):
    ran(train(tmp_path, *QUICK))
    assert not list(tmp_path.rglob("gpuopt_report.json"))
    assert saved_config(tmp_path)["gpuopt"]["preset"] is None


def test_preset_flag_forms():
    assert preset_flag_as_key(["fit", "--gpuopt=low-memory", "--gpuopt.precision=null"]) == [
        "fit",
        "--gpuopt.preset=low-memory",
        "--gpuopt.precision=null",
    ]


def shipped_preset(name: str) -> dict:
    """The preset's file read as plain YAML (not through load_preset)."""
    return yaml.safe_load((ROOT / "lightning_gpuopt" / "presets" / f"{name}.yaml").read_text())


def test_print_config_shows_the_resolved_preset_and_overrides(tmp_path, train):
    result = train(
        tmp_path,
        "--gpuopt",
        "fill-memory",
        "--gpuopt.precision",
        "bf16-mixed",
        "--gpuopt.max_memory",
        "40MB",
        "--print_config",
    )
    ran(result)
    printed = yaml.safe_load(result.stdout)["gpuopt"]
    expected = {
        **shipped_preset("fill-memory"),
        "precision": "bf16-mixed",
        "max_memory": "40MB",
        "preset": "fill-memory",
    }
    assert {key: printed[key] for key in expected} == expected
    assert all(value is None for key, value in printed.items() if key not in expected)  # the parts' own defaults
    assert not list(tmp_path.rglob("gpuopt_report.json"))  # printed, nothing ran


def test_help_describes_the_gpuopt_flag_and_lists_the_presets(tmp_path, train):
    result = train(tmp_path, "--help")
    ran(result)
    text = " ".join(result.stdout.split()).replace("- ", "-")  # argparse wraps lines at hyphens
    usage = "[--gpuopt PRESET_OR_YAML]"
    start = text.index("--gpuopt PRESET_OR_YAML", text.index(usage) + len(usage))  # the option's entry
    described = text[start : text.index("--gpuopt.preset PRESET ", start)]
    assert "configuration file" not in described and "preset name or the path of a YAML file" in described
    assert all(name in described for name in ("diagnose", "fill-memory", "low-memory", "max-throughput"))
    assert "run MemoryFill: largest micro-batch" in text  # each setting has its meaning


SUBCLASS = """
import sys
sys.path.insert(0, {examples!r})
from models import TokenTransformer
from lightning_gpuopt import GpuOptCLI


class MyCLI(GpuOptCLI):
    def add_arguments_to_parser(self, parser):  # no super(): it must not lose --gpuopt
        parser.add_argument("--notes", type=str, default="")


def main():
    MyCLI(TokenTransformer, trainer_defaults={{"accelerator": "cpu", "devices": 1}})
"""


def test_a_subclass_that_overrides_add_arguments_to_parser_without_super_keeps_gpuopt(tmp_path, train):
    script = tmp_path / "my_train.py"
    script.write_text(SUBCLASS.format(examples=str(SCRIPT.parent)))
    ran(train(tmp_path, "--gpuopt", "diagnose", "--notes", "mine", *QUICK, script=script))
    assert report(tmp_path)["gpuopt"]["preset"] == "diagnose"
    assert saved_config(tmp_path)["notes"] == "mine"


@pytest.mark.parametrize(
    "text, line", [("precision: [auto\nmonitor: true\n", 2), ("preset: ../{folder}/self.yaml\n", None)]
)
def test_a_broken_preset_file_is_a_usage_error_naming_the_file(tmp_path, train, text, line):
    path = tmp_path / "self.yaml"
    path.write_text(text.format(folder=tmp_path.name))  # the second extends itself by another spelling
    result = train(tmp_path, "--gpuopt", str(path), *QUICK)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(path) in result.stderr and (line is None or f"line {line}" in result.stderr)
    assert line is not None or "cycle" in result.stderr
    assert not list(tmp_path.rglob("gpuopt_report.json"))


def test_gpuopt_presets_command_refuses_a_broken_file_with_exit_2(tmp_path, capsys):
    from lightning_gpuopt.cli import main

    path = tmp_path / "broken.yaml"
    path.write_text("monitor: true\n  estimate: false\n")
    assert main(["presets", str(path)]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and "line 2" in error and "Traceback" not in error
