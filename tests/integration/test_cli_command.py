"""Tests of the ``gpuopt`` console command (lightning_gpuopt.cli) and its checks (lightning_gpuopt.core.doctor).

The commands run as users run them, in a subprocess (``python -m lightning_gpuopt.cli``); the
memory estimate is checked against the live-tensor peak of real training steps of the same model.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar, Literal, Optional

import pytest
import torch
from helpers import REPO, TESTS, usable_cores_from_the_os

from lightning_gpuopt import cli
from lightning_gpuopt.cli._estimate_inputs import DEFAULT_BATCH_SIZE
from lightning_gpuopt.core import doctor
from lightning_gpuopt.core.loader import usable_cpu_count
from lightning_gpuopt.core.op_memory import LiveTensorTracker
from lightning_gpuopt.presets import PRESET_KEYS, available_presets, load_preset, preset_description

EXAMPLE_MODELS = REPO / "examples" / "models.py"
TOLERANCE = 0.10
CHECK_NAMES = [
    "torch_build",
    "cuda_driver",
    "gpu_arch",
    "gpus",
    "gpu_processes",
    "matmul",
    "cpu_cores",
    "torch_threads",
    "blas",
    "pinned_memory",
    "shm",
]


def run_gpuopt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m lightning_gpuopt.cli ARGS`` from the repository root, this checkout first on the path (and the
    tests' support modules, which a model file given as ``FILE:CLASS`` may import)."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(TESTS), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "lightning_gpuopt.cli", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``cli.main(args)`` in this process: (exit status, stdout, stderr)."""
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --------------------------------------------------------------------------- a light command


@pytest.mark.parametrize(
    "args", [["--help"], ["estimate", "--help"], ["presets"], ["presets", "fill-memory", "--json"]]
)
def test_help_and_presets_do_not_import_torch_or_lightning(args):
    # what makes `gpuopt --help` take seconds is importing torch and Lightning; what the command imports
    # is a fact that does not depend on the machine's load, unlike a time limit
    code = (
        "import sys\n"
        "from lightning_gpuopt.cli import main\n"
        f"sys.argv = ['gpuopt', *{args!r}]\n"
        "status = main()\n"
        "print('IMPORTED', status, 'torch' in sys.modules, 'lightning' in sys.modules, "
        "'pytorch_lightning' in sys.modules, 'jsonargparse' in sys.modules)"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "IMPORTED 0 False False False False", result.stdout[-2000:]


def test_the_package_and_its_cli_import_without_torch_and_keep_their_names():
    code = (
        "import sys, lightning_gpuopt, lightning_gpuopt.cli\n"
        "print('torch' in sys.modules, 'lightning' in sys.modules)\n"
        "from lightning_gpuopt import GpuOpt, GpuOptCLI, DataWaitMonitor, cli\n"
        "from lightning_gpuopt.cli import main\n"
        "print('torch' in sys.modules, GpuOptCLI is lightning_gpuopt.cli.GpuOptCLI, cli is lightning_gpuopt.cli)"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True", "True", "True"]


def test_the_package_lists_its_public_names():
    import lightning_gpuopt

    assert set(lightning_gpuopt.__all__) <= set(dir(lightning_gpuopt))
    assert {"callbacks", "cli", "core", "presets"} <= set(dir(lightning_gpuopt))
    for name in lightning_gpuopt.__all__:
        assert getattr(lightning_gpuopt, name) is not None
    assert lightning_gpuopt.GpuOpt is lightning_gpuopt.callbacks.GpuOpt
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        lightning_gpuopt.NotAName  # noqa: B018


def test_version_prints_the_package_version(capsys):
    from lightning_gpuopt import __version__

    assert run_main(capsys, "--version")[:2] == (0, f"gpuopt {__version__}\n")


# --------------------------------------------------------------------------- gpuopt doctor


def test_doctor_json_without_a_gpu_reports_it_as_a_status():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this is the no-GPU machine on any machine
    result = run_gpuopt("doctor", "--json", "--quick", env={"CUDA_VISIBLE_DEVICES": ""})
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert list(checks) == CHECK_NAMES
    assert all(check["status"] in doctor.STATUSES and check["value"] for check in checks.values())
    statuses = [check["status"] for check in checks.values()]
    assert report["status"] == max(statuses, key=doctor.STATUSES.index)
    assert result.returncode == (1 if "fail" in statuses else 0)

    assert checks["gpus"]["status"] == "warn" and "no GPU visible" in checks["gpus"]["value"]
    assert "--gpus all" in checks["gpus"]["fix"]
    assert checks["pinned_memory"]["status"] == "info" and "no CUDA" in checks["pinned_memory"]["value"]
    matmul = checks["matmul"]  # the CPU fallback of the benchmark
    assert matmul["status"] == "info" and matmul["details"]["device"] == "cpu"
    assert matmul["details"]["gflops"]["fp32"] > 0.1
    assert checks["shm"]["details"]["total_bytes"] > 0 or checks["shm"]["status"] == "warn"


def test_doctor_table_in_process(capsys):
    status, out, _ = run_main(capsys, "doctor", "--matmul-seconds", "0")
    assert status in (0, 1)
    assert all(name in out for name in CHECK_NAMES) and "checks:" in out
    assert run_main(capsys, "doctor", "--matmul-seconds", "-1")[0] == 2


# --------------------------------------------------------------------------- gpuopt presets


def test_presets_lists_every_preset_with_its_description():
    result = run_gpuopt("presets")
    assert result.returncode == 0, result.stderr
    for name in available_presets():
        assert name in result.stdout
        assert " ".join(preset_description(name).split()[:3]) in " ".join(result.stdout.split())


def test_preset_json_shows_its_settings_and_what_each_key_means():
    result = run_gpuopt("presets", "fill-memory", "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["name"] == "fill-memory" and shown["settings"] == load_preset("fill-memory")
    assert shown["meanings"] == {key: PRESET_KEYS[key] for key in shown["settings"]}
    assert shown["description"] == preset_description("fill-memory")


def test_unknown_preset_exits_2_and_lists_the_valid_names():
    result = run_gpuopt("presets", "nope")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'nope'" in result.stderr
    assert all(repr(name) in result.stderr for name in available_presets())


def test_preset_table_in_process(capsys):
    status, out, _ = run_main(capsys, "presets", "max-throughput")
    assert status == 0
    assert all(key in out for key in load_preset("max-throughput"))


# --------------------------------------------------------------------------- gpuopt estimate


def real_step_peak(model: torch.nn.Module, batch: tuple, steps: int = 3) -> int:
    """The live-tensor peak of ``steps`` real training steps in Lightning's order (forward and loss,
    zero_grad, backward, optimizer step), counting the model, optimizer state and the batch."""
    optimizer = model.configure_optimizers()
    model.log = lambda *args, **kwargs: None  # training_step logs; there is no Trainer here
    with LiveTensorTracker(existing=(model, optimizer, batch)) as tracker:
        for _ in range(steps):
            loss = model.training_step(batch, 0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            del loss
    del model.log
    return tracker.peak_bytes


def example_model(name: str, **kwargs):
    if str(EXAMPLE_MODELS.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_MODELS.parent))
    return getattr(importlib.import_module(EXAMPLE_MODELS.stem), name)(**kwargs)


def test_estimate_of_an_example_model_matches_real_steps():
    result = run_gpuopt(
        "estimate",
        "examples/models.py:TokenTransformer",
        "--batch-size",
        "8",
        "--max-memory",
        "200MB",
        "--device",
        "cpu",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    estimate = json.loads(result.stdout)
    assert estimate["method"] == "traced" and estimate["batch_size"] == 8
    assert estimate["setup"]["loss"] == "the model's training_step()"
    assert estimate["setup"]["optimizer"].startswith("AdamW")

    torch.manual_seed(0)
    model = example_model("TokenTransformer", batch_size=8)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate["params_bytes"] == params_bytes == estimate["grads_bytes"]
    assert estimate["optimizer_bytes"] >= 2 * params_bytes  # AdamW: exp_avg and exp_avg_sq

    measured = real_step_peak(model, next(iter(model.train_dataloader())))
    error = (estimate["predicted_peak_bytes"] - measured) / measured
    print(
        f"\nTokenTransformer B=8: predicted {estimate['predicted_peak_bytes']} measured {measured} error {error:+.4f}"
    )
    assert abs(error) <= TOLERANCE

    # the largest batch for 200 MB: a real step at that size fits and fills the memory
    largest, fixed, per_sample = estimate["max_batch_size"], estimate["fixed_bytes"], estimate["bytes_per_sample"]
    assert estimate["capacity_bytes"] == 200_000_000
    assert fixed + largest * per_sample <= 200_000_000 < fixed + (largest + 1) * per_sample
    model = example_model("TokenTransformer", batch_size=largest, num_samples=largest)
    batch = next(iter(model.train_dataloader()))
    assert len(batch[0]) == largest
    measured_largest = real_step_peak(model, batch)
    print(f"TokenTransformer largest batch {largest}: measured {measured_largest} of 200,000,000 bytes")
    assert (1 - TOLERANCE) * 200_000_000 <= measured_largest <= 200_000_000
    assert 100 < largest < 10_000


def test_estimate_table_and_other_batch_sources_in_process(capsys):
    status, out, err = run_main(
        capsys,
        "estimate",
        f"{EXAMPLE_MODELS}:ResidualConvNet",
        "--batch-size",
        "16",
        "--max-memory",
        "1GiB",
        "--device",
        "cpu",
        "--precision",
        "bf16-mixed",
    )
    assert status == 0, err
    for row in ("predicted peak at batch size 16", "largest batch that fits", "torchinfo total", "bf16-mixed"):
        assert row in out

    # --input-size: random inputs and a stand-in loss, said in a note
    status, out, err = run_main(
        capsys,
        "estimate",
        "torch.nn:Linear",
        "--init-args",
        '{"in_features": 100, "out_features": 10}',
        "--input-size",
        "100",
        "--batch-size",
        "32",
        "--optimizer",
        "sgd",
        "--device",
        "cpu",
        "--json",
    )
    assert status == 0, err
    estimate = json.loads(out)
    assert estimate["batch_size"] == 32 and estimate["params_bytes"] == 1010 * 4
    assert estimate["optimizer_bytes"] == 1010 * 4  # SGD's momentum buffers
    assert estimate["batch_bytes"] == 32 * 100 * 4
    assert any("stand-in" in note for note in estimate["notes"])

    # token ids for a model without a dataloader: --dtype long, the vocabulary from its nn.Embedding
    status, out, err = run_main(
        capsys,
        "estimate",
        "torch.nn:Embedding",
        "--init-args",
        '{"num_embeddings": 50, "embedding_dim": 8}',
        "--input-size",
        "12",
        "--dtype",
        "long",
        "--device",
        "cpu",
        "--optimizer",
        "none",
        "--json",
    )
    assert status == 0, err
    estimate = json.loads(out)
    assert estimate["batch_size"] == DEFAULT_BATCH_SIZE and estimate["optimizer_bytes"] == 0


def test_a_bad_module_class_exits_2_and_names_it():
    result = run_gpuopt("estimate", "no_such_module_xyz:Model")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "`MODULE:CLASS`='no_such_module_xyz:Model'" in result.stderr
    assert "the module part 'no_such_module_xyz' cannot be imported" in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["TokenTransformer"], "`MODULE:CLASS`='TokenTransformer' is not MODULE:CLASS"),
        (["examples/missing.py:Model"], "the file 'examples/missing.py' does not exist"),
        ([f"{EXAMPLE_MODELS}:TokenTransfomer"], "has no attribute 'TokenTransfomer'; did you mean 'TokenTransformer'?"),
        (["json:loads"], "'loads' is a function, not a torch.nn.Module class"),
        (
            [f"{EXAMPLE_MODELS}:TokenTransformer", "--init-args", '{"width": 3'],
            """`--init-args`='{"width": 3' is not JSON or YAML""",
        ),
        ([f"{EXAMPLE_MODELS}:TokenTransformer", "--init-args", '{"widht": 3}'], "unexpected keyword argument 'widht'"),
        ([f"{EXAMPLE_MODELS}:TokenTransformer", "--max-memory", "lots"], "`--max-memory`='lots' is not a memory size"),
        (["torch.nn:Linear", "--init-args", '{"in_features": 2, "out_features": 2}'], "pass --input-size"),
        (["torch.nn:Identity", "--input-size", "3x4"], "`--input-size`='3x4' is not a list of positive integers"),
        (["torch.nn:Identity", "--input-size", "4", "--dtype", "long"], "give it with --vocab N"),
        (["torch.nn:Identity", "--batch-size", "0"], "`--batch-size`=0 must be a positive integer"),
        (["torch.nn:Identity", "--device", "cpu", "--precision", "16-mixed"], "16-mixed' needs CUDA"),
    ],
)
def test_bad_estimate_arguments_exit_2_with_what_would_work(capsys, args, expected):
    status, out, err = run_main(capsys, "estimate", *args)
    assert status == 2 and out == ""
    assert err.startswith("gpuopt estimate: error: ") and expected in err


# --------------------------------------------------------------------------- --init-args: type-checked


class TypedNet(torch.nn.Module):
    """A model with typed init args, for ``gpuopt estimate --init-args`` (the last one built is kept)."""

    last: ClassVar[Optional[TypedNet]] = None

    def __init__(
        self,
        hidden: int,
        scale: float = 1.0,
        act: Literal["relu", "gelu"] = "relu",
        backbone: Optional[torch.nn.Module] = None,
    ) -> None:
        super().__init__()
        self.hidden, self.scale, self.act = hidden, scale, act
        self.backbone = torch.nn.Linear(4, hidden) if backbone is None else backbone
        self.head = torch.nn.Linear(hidden, 1)
        TypedNet.last = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(x)
        hidden = torch.relu(hidden) if self.act == "relu" else torch.nn.functional.gelu(hidden)
        return self.head(hidden) * self.scale


class ConfigNet(torch.nn.Module):
    """HuggingFace/timm style: an untyped ``config`` and ``drop_rate``, ``**kwargs``, one typed argument."""

    last: ClassVar[Optional[ConfigNet]] = None

    def __init__(self, config, drop_rate=0.0, depth: int = 1, **kwargs) -> None:
        super().__init__()
        self.config, self.drop_rate, self.depth, self.kwargs = config, drop_rate, depth, kwargs
        self.layer = torch.nn.Linear(4, config["hidden"])
        ConfigNet.last = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


THIS_FILE = Path(__file__).resolve()
#: a fast CPU estimate: random inputs of 4 features, a stand-in loss, no optimizer
FAST_ESTIMATE = ("--input-size", "4", "--batch-size", "2", "--optimizer", "none", "--device", "cpu", "--json")
TYPED_YAML = """\
hidden: 16
scale: 1
act: gelu
backbone:
  class_path: torch.nn.Linear
  init_args: {in_features: 4, out_features: 16, bias: false}
"""
TYPED_SIGNATURE = "TypedNet(hidden: int, scale: float = 1.0, act: Literal['relu', 'gelu'] = 'relu', backbone:"


@pytest.mark.parametrize("form", ["json text", "yaml text", "yaml file", "json file"])
def test_init_args_are_type_checked_and_nested_class_paths_built(capsys, tmp_path, form):
    import yaml

    mapping = yaml.safe_load(TYPED_YAML)
    init_args = {
        "json text": json.dumps(mapping),
        "yaml text": TYPED_YAML,
        "yaml file": str(tmp_path / "typed.yaml"),
        "json file": str(tmp_path / "typed.json"),
    }[form]
    (tmp_path / "typed.yaml").write_text(TYPED_YAML)
    (tmp_path / "typed.json").write_text(json.dumps(mapping))
    TypedNet.last = None
    status, out, err = run_main(capsys, "estimate", f"{THIS_FILE}:TypedNet", "--init-args", init_args, *FAST_ESTIMATE)
    assert status == 0, err
    model = TypedNet.last
    assert model is not None and model.hidden == 16 and model.act == "gelu"
    assert isinstance(model.scale, float) and model.scale == 1.0  # 1 converted to the annotated float
    backbone = model.backbone  # built from its class_path and init_args
    assert isinstance(backbone, torch.nn.Linear) and backbone.out_features == 16 and backbone.bias is None
    # the estimate is of that model: 4 x 16 backbone weights (no bias) and a 16 + 1 head
    assert json.loads(out)["params_bytes"] == (4 * 16 + 16 + 1) * 4


@pytest.mark.parametrize(
    ("init_args", "expected"),
    [
        ('{"hidden": "big"}', ['Parser key "model.hidden"', "Expected a <class 'int'>. Got value: big"]),
        ('{"hiden": 16}', ["unexpected keyword argument 'hiden'", "unknown key; did you mean 'hidden'?"]),
        ("{}", ["required", "model.hidden"]),
        ("hidden: 16\nact: tanh", ['Parser key "model.act"']),
        (
            '{"hidden": 16, "backbone": {"class_path": "torch.nn.Linear", "init_args": {"in_feature": 4}}}',
            ['Parser key "model.backbone"', "in_feature"],
        ),
        ('{"hidden": 16', ["is not JSON or YAML"]),
        ("[16]", ["is a list ([16]), not a mapping"]),
        ("no/such/typed.yaml", ["the file 'no/such/typed.yaml' does not exist"]),
    ],
)
def test_bad_init_args_exit_2_naming_the_argument_the_value_and_the_signature(capsys, init_args, expected):
    status, out, err = run_main(capsys, "estimate", f"{THIS_FILE}:TypedNet", "--init-args", init_args, *FAST_ESTIMATE)
    assert status == 2 and out == ""
    assert err.startswith(f"gpuopt estimate: error: `--init-args`={init_args!r}"), err
    assert all(text in err for text in expected), err
    assert TYPED_SIGNATURE in err
    assert "Traceback" not in err and "usage:" not in err


def test_a_wrong_type_in_a_subprocess_is_our_message_and_exit_2():
    result = run_gpuopt("estimate", f"{THIS_FILE}:TypedNet", "--init-args", '{"hidden": "big"}', *FAST_ESTIMATE)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("""gpuopt estimate: error: `--init-args`='{"hidden": "big"}'"""), result.stderr
    assert "\"model.hidden\": Expected a <class 'int'>. Got value: big" in result.stderr
    assert TYPED_SIGNATURE in result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr


def test_untyped_arguments_and_kwargs_pass_as_given_and_typed_ones_are_checked(capsys):
    extra = {"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 2}}
    init_args = {"config": {"hidden": 8, "activation": "gelu"}, "drop_rate": "0.1", "depth": "3", "extra": extra}
    status, out, err = run_main(
        capsys, "estimate", f"{THIS_FILE}:ConfigNet", "--init-args", json.dumps(init_args), *FAST_ESTIMATE
    )
    assert status == 0, err
    model = ConfigNet.last
    assert model is not None and model.config == {"hidden": 8, "activation": "gelu"}
    assert model.drop_rate == "0.1"  # untyped: as given
    assert model.depth == 3  # typed: converted
    assert model.kwargs == {"extra": extra}  # **kwargs: as given, not built
    assert json.loads(out)["params_bytes"] == (4 * 8 + 8) * 4
    status, out, err = run_main(
        capsys, "estimate", f"{THIS_FILE}:ConfigNet", "--init-args", "config: {hidden: 8}\ndepth: deep"
    )
    assert status == 2 and "\"model.depth\": Expected a <class 'int'>. Got value: deep" in err
    assert "ConfigNet(config, drop_rate=0.0, depth: int = 1, **kwargs)" in err


def test_a_huggingface_model_takes_its_config_as_a_class_path_or_as_its_init_args(capsys):
    transformers = pytest.importorskip("transformers")
    config = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
    config.update(bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    params_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    for init_args in (
        {"config": {"class_path": "transformers.GPT2Config", "init_args": config}},
        {"config": config},  # the class from the annotation `config: GPT2Config`
    ):
        status, out, err = run_main(
            capsys,
            "estimate",
            "transformers:GPT2LMHeadModel",
            "--init-args",
            json.dumps(init_args),
            *("--input-size", "8", "--dtype", "long", "--optimizer", "none", "--device", "cpu", "--json"),
        )
        assert status == 0, err
        assert json.loads(out)["params_bytes"] == params_bytes


# --------------------------------------------------------------------------- core.doctor checks


def test_thread_check_flags_oversubscription_with_real_torch_threads(monkeypatch):
    cores = usable_cpu_count()
    assert cores == usable_cores_from_the_os()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cores + 1)
        check = doctor.run_check("torch_threads")
    finally:
        torch.set_num_threads(threads)
    assert check.status == "warn" and check.details["threads"] == cores + 1
    assert f"torch.set_num_threads({cores})" in check.fix

    # several processes on one host (torchrun's LOCAL_WORLD_SIZE), one thread each: still too many
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    check = doctor.run_check("torch_threads")
    assert check.status == "warn" and check.details["processes"] == 2 * cores
    assert "torch.set_num_threads(1)" in check.fix

    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert doctor.torch_threads_check(threads=cores, cores=cores).status == "ok"


def test_shm_check_reads_a_real_statvfs(tmp_path):
    stat = os.statvfs(tmp_path)
    check = doctor.run_check("shm", str(tmp_path))
    assert check.details["total_bytes"] == stat.f_frsize * stat.f_blocks
    assert 0 <= check.details["free_bytes"] <= check.details["total_bytes"]
    small = check.details["total_bytes"] < doctor.SHM_WARN_BYTES or check.details["free_bytes"] < doctor.SHM_WARN_BYTES
    assert check.status == ("warn" if small else "ok")

    missing = doctor.run_check("shm", str(tmp_path / "no-such-dir"))
    assert missing.status == "warn" and "num_workers=0" in missing.fix
    docker_default = doctor.shared_memory_check(64 * 2**20, 64 * 2**20)
    assert docker_default.status == "warn" and "--shm-size" in docker_default.fix


def test_cpu_cores_check_against_a_cgroup_quota():
    count, affinity = os.cpu_count(), len(os.sched_getaffinity(0))
    assert doctor.run_check("cpu_cores").details == {
        "cpu_count": count,
        "affinity": affinity,
        "cgroup_quota": doctor.cgroup_cpu_quota(),
    }
    limited = doctor.cpu_cores_check(count, affinity, quota=affinity / 2)
    assert limited.status == "warn" and "num_workers" in limited.fix


def test_one_core_count_the_affinity_within_the_cgroup_quota(monkeypatch):
    from lightning_gpuopt.core import loader

    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(loader, "cgroup_cpu_quota", lambda: 0.5)
    # the loader tuner, the data-wait monitor, its oversubscription finding, the doctor's thread
    # check: half a core, rounded up
    assert usable_cpu_count() == 1
    assert doctor.run_check("torch_threads").details["cores"] == 1
    # the doctor's core check reports the affinity and the quota apart
    assert usable_cpu_count(within_quota=False) == affinity
    assert doctor.run_check("cpu_cores").details["affinity"] == affinity
    monkeypatch.setattr(loader, "cgroup_cpu_quota", lambda: affinity + 1.5)
    assert usable_cpu_count() == affinity
    monkeypatch.setattr(loader, "cgroup_cpu_quota", lambda: None)
    assert usable_cpu_count() == affinity


@pytest.mark.parametrize(
    ("build", "driver", "status"),
    [
        ("12.4", 12040, "ok"),
        ("12.1", 12080, "ok"),
        ("12.8", 12020, "warn"),
        ("12.4", 11080, "fail"),
        (None, 12040, "info"),
        ("12.4", None, "info"),
    ],
)
def test_cuda_driver_versus_build(build, driver, status):
    assert doctor.cuda_driver_check(build, driver).status == status


def test_architecture_support_and_card_peaks():
    assert doctor.arch_support((9, 0), ["sm_80", "sm_90"]) == "native"
    assert doctor.arch_support((8, 9), ["sm_80", "sm_86"]) == "native"  # same major, earlier minor
    assert doctor.arch_support((10, 0), ["sm_90", "compute_90"]) == "ptx"
    assert doctor.arch_support((7, 0), ["sm_80", "sm_90"]) == "none"
    names = {
        "NVIDIA A100-SXM4-40GB": "A100",
        "NVIDIA A10": "A10",
        "NVIDIA L4": "L4",
        "NVIDIA L40S": "L40S",
        "NVIDIA H100 PCIe": "H100 PCIe",
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H200": "H200 SXM",
        "Tesla V100-SXM2-16GB": "V100 SXM2",
        "Tesla T4": "T4",
        "NVIDIA GeForce RTX 4090": "RTX 4090",
        "NVIDIA GeForce RTX 3090": "RTX 3090",
    }
    assert {name: doctor.card_peaks(name).card for name in names} == names
    assert doctor.card_peaks("NVIDIA GeForce GTX 1080") is None


def test_blas_of_the_installed_torch():
    check = doctor.run_check("blas")
    assert check.details["torch"] == doctor.torch_blas(torch.__config__.show()) != "none"
    assert check.status in ("ok", "info")


def test_a_check_that_raises_becomes_a_warning_naming_the_error(monkeypatch):
    def broken(within_quota: bool = True) -> int:
        raise PermissionError("sched_getaffinity denied")

    monkeypatch.setattr(doctor, "usable_cpu_count", broken)
    check = doctor.run_check("torch_threads")
    assert check.status == "warn" and "PermissionError: sched_getaffinity denied" in check.value
