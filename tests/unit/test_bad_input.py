"""Bad input is refused early and clearly: every public constructor argument of every callback, and
every preset key, given a wrong type or value, raises a ``ValueError``/``TypeError`` whose message
names the argument and the value given -- never a deep traceback, never a silently wrong run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt, MemoryEstimator, MemoryFill
from lightning_gpuopt.presets import PRESET_KEYS, load_preset

NAN, INF = float("nan"), float("inf")
# values no argument of one kind accepts
NOT_A_BOOL = ["false", "no", "true", 0, 1, None, 1.0]
MEMORY = ["lots", "-1GB", "0GB", -1, 0, 1, 1023, 1.5, 0.0, -0.5, NAN, True, [1], "0.5GiB of it"]


def ints(minimum: int, allow_none: bool = False) -> list[Any]:
    """Wrong values for an int >= ``minimum``: a string, a float, a bool, NaN, below the minimum."""
    values = ["3", 3.5, 4.0, True, NAN, minimum - 1, -1]
    return values if allow_none else [*values, None]


def fractions() -> list[Any]:
    """Wrong values for a number in (0, 1)."""
    return ["0.2", True, NAN, 0, -0.1, 1, 1.5, None]


def positive_numbers(allow_none: bool = False) -> list[Any]:
    values = ["10", True, NAN, INF, -INF, 0, -1, [1]]
    return values if allow_none else [*values, None]


CASES: dict[type, dict[str, list[Any]]] = {
    DataWaitMonitor: {
        "warmup_steps": ints(0),
        "log_every_n_steps": ints(1, allow_none=True),
        "nvml_interval_s": positive_numbers(),
        "data_wait_high": fractions(),
        "data_wait_low": fractions(),
        "gpu_idle_high": fractions(),
        "host_overhead_high": fractions(),
        "straggler_slowdown": fractions(),
        "report_path": [123, "", b"report.json", 1.5, ["a.json"]],
        "verbose": NOT_A_BOOL,
        "find_patterns": NOT_A_BOOL,
    },
    MemoryEstimator: {
        "max_memory": MEMORY,
        "measure_steps": ints(1),
        "verbose": NOT_A_BOOL,
    },
    BatchSizeSearch: {
        "max_memory": MEMORY,
        "margin": ["0.1", "Auto", True, NAN, -0.1, 1, 1.5, None],
        "steps_per_trial": ints(1),
        "max_trials": ints(1),
        "min_batch_size": ints(1),
        "max_batch_size": ints(1),
        "batch_arg_name": ["", 1, None, ["batch_size"]],
        "multiple_of": ints(1),
        "mode": ["Fill", "largest", 1, None, True],
        "verbose": NOT_A_BOOL,
    },
    MemoryFill: {
        "global_batch_size": ints(1, allow_none=True),
        "precision": ["false", "yes", "fp8", "bf16-true", "16-true", 1, 0, True, False],
        "activation_checkpointing": [1, 0, "", None, [], [1], {"a": 1}, "true"],
        "accumulation": ["false", "no", True, 1, 0, None, 4],
        "max_memory": MEMORY,
        "margin": ["0.1", True, NAN, -0.1, 1, None],
        "min_micro_batch_size": ints(1),
        "objective": ["speed", "Throughput", 1, None],
        "on_oom": ["Adapt", "retry", 1, None, True],
        "scale_lr": ["Linear", "square", 1, True],
        "batch_arg_name": ["", 1, None],
        "steps_per_trial": ints(1),
        "max_trials": ints(1),
        "verbose": NOT_A_BOOL,
    },
    DataLoaderTuner: {
        "max_seconds": positive_numbers(),
        "batches_per_candidate": ints(2),
        "tolerance": ["0.05", True, NAN, -0.1, 1, None],
        "target_samples_per_second": positive_numbers(allow_none=True),
        "max_num_workers": ints(0, allow_none=True),
        "persistent_workers": NOT_A_BOOL,
        "verbose": NOT_A_BOOL,
    },
}
# GpuOpt's settings (its keyword arguments, the preset keys): None there means "from the preset"
GPUOPT_CASES: dict[str, list[Any]] = {
    "monitor": ["false", "no", 0, 1],
    "estimate": ["false", "no", 0, 1],
    "tune_loader": ["no", "false", 0, 1],
    "fill_memory": ["false", "no", 0, 1],
    "max_memory": [v for v in MEMORY if v is not None],
    "margin": ["0.1", True, NAN, -0.1, 1],
    "global_batch_size": [v for v in ints(1) if v is not None],
    "precision": ["false", "fp8", "64-true", 1, 0, True],
    "activation_checkpointing": [1, 0, "", [], [1], "true"],
    "accumulation": ["false", True, 1, 0, 4],
    "objective": ["speed", 1],
    "min_micro_batch_size": [v for v in ints(1) if v is not None],
    "batch_arg_name": ["", 1],
    "loader_max_seconds": [v for v in positive_numbers() if v is not None],
    "on_oom": ["Adapt", "retry", 1, True],
    "scale_lr": ["Linear", "square", 1, True],
}


def shown(value: Any) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else repr(value)


def assert_names(error: pytest.ExceptionInfo, argument: str, value: Any) -> None:
    message = str(error.value)
    assert f"`{argument}`" in message or f"{argument}:" in message, message
    assert shown(value) in message, message
    assert "\n" not in message.strip(), message  # one clear message


def test_every_constructor_argument_and_preset_key_is_covered():
    import inspect

    for cls, table in CASES.items():
        assert set(inspect.signature(cls).parameters) == set(table), cls.__name__
    # ``verbose`` and ``plots`` are GpuOpt's own (what to log and draw), not preset keys
    own = {"preset", "verbose", "plots"}
    assert set(GPUOPT_CASES) == set(PRESET_KEYS) == set(inspect.signature(GpuOpt).parameters) - own


@pytest.mark.parametrize("argument", ["plots", "verbose"])
@pytest.mark.parametrize("value", ["yes", "false", 1, 0], ids=shown)
def test_gpuopt_refuses_a_plots_or_verbose_value_that_is_not_a_bool(argument, value):
    with pytest.raises(ValueError) as error:
        GpuOpt("diagnose", **{argument: value})
    assert_names(error, argument, value)


@pytest.mark.parametrize(
    "cls, argument, value",
    [(cls, argument, value) for cls, table in CASES.items() for argument, values in table.items() for value in values],
    ids=lambda item: item.__name__ if isinstance(item, type) else shown(item),
)
def test_callback_refuses_bad_argument_naming_it_and_the_value(cls, argument, value):
    with pytest.raises((ValueError, TypeError)) as error:
        cls(**{argument: value})
    assert_names(error, argument, value)


@pytest.mark.parametrize(
    "argument, value",
    [(argument, value) for argument, values in GPUOPT_CASES.items() for value in values],
    ids=shown,
)
def test_gpuopt_refuses_bad_setting_whichever_parts_run(argument, value):
    # "diagnose" runs neither MemoryFill nor the tuner: their settings are still checked, not ignored
    for preset in ("diagnose", "max-throughput"):
        with pytest.raises((ValueError, TypeError)) as error:
            GpuOpt(preset, **{argument: value})
        assert_names(error, argument, value)


@pytest.mark.parametrize(
    "argument, value",
    [(argument, values[0]) for argument, values in GPUOPT_CASES.items() if yaml.safe_dump(values[0]) is not None],
    ids=shown,
)
def test_preset_file_with_a_bad_value_names_the_key_the_value_and_the_file(tmp_path, argument, value):
    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump({"preset": "fill-memory", argument: value}))
    with pytest.raises(ValueError) as error:
        GpuOpt(str(path))
    assert_names(error, argument, value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("text", ['fill_memory: "false"', "tune_loader: no_thanks", "monitor: 'off'"])
def test_string_booleans_in_a_preset_file_do_not_turn_a_part_on(tmp_path, text):
    path = tmp_path / "mine.yaml"
    path.write_text(f"preset: diagnose\n{text}\n")
    with pytest.raises(ValueError, match=f"`{text.split(':')[0]}` must be True or False"):
        GpuOpt(path)


@pytest.mark.parametrize("preset", [123, 1.5, True, b"diagnose", ["diagnose"], "", "fast", "missing.yaml"])
def test_gpuopt_refuses_a_preset_that_is_no_name_or_path(preset):
    with pytest.raises(ValueError) as error:
        GpuOpt(preset)
    if not isinstance(preset, str) or not preset:  # not a name at all: the argument is named
        assert_names(error, "preset", preset)
    else:  # a name that is no preset: the name is quoted
        assert repr(preset) in str(error.value)
    assert "'diagnose', 'fill-memory', 'low-memory', 'max-throughput'" in str(error.value)


def test_max_memory_of_one_reports_the_value_given_and_what_works():
    with pytest.raises(ValueError) as error:
        BatchSizeSearch(max_memory=1)
    message = str(error.value)
    assert "`max_memory`=1" in message and "`max_memory`=0" not in message
    assert "1.0" in message and '"20GiB"' in message and "(0, 1]" in message


def test_a_fraction_too_small_for_the_device_is_refused_naming_the_fraction():
    from lightning_gpuopt.core.memory import parse_memory
    from lightning_gpuopt.testing import SimulatedGpu

    with SimulatedGpu("T4", memory="64MiB"), pytest.raises(ValueError) as error:
        parse_memory(1e-9, "cuda", name="max_memory", minimum=1024)
    assert "`max_memory`=1e-09" in str(error.value) and "1024" in str(error.value)


# ----------------------------------------------------------------------------- preset files


def test_preset_that_extends_itself_names_the_cycle(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "a.yaml").write_text("preset: ../sub/a.yaml\nprecision: null\n")
    with pytest.raises(ValueError, match="cycle") as error:
        load_preset(sub / "a.yaml")
    assert "a.yaml -> " in str(error.value) and len(str(error.value)) < 1000


def test_presets_extending_each_other_name_the_whole_chain(tmp_path):
    (tmp_path / "a.yaml").write_text("preset: ./b.yaml\n")
    (tmp_path / "b.yaml").write_text(f"preset: {tmp_path / 'c.yaml'}\n")
    (tmp_path / "c.yaml").write_text("preset: a.yaml\n")
    with pytest.raises(ValueError, match="cycle") as error:
        load_preset(tmp_path / "a.yaml")
    message = str(error.value)
    assert message.index("a.yaml") < message.index("b.yaml") < message.index("c.yaml") < message.rindex("a.yaml")


@pytest.mark.parametrize(
    "text, line",
    [
        ("precision: [auto\nmonitor: true\n", 2),
        ("monitor: true\n  estimate: false\n", 2),
        ("monitor: true\nmonitor: : x\n", 2),
    ],
)
def test_malformed_preset_yaml_names_the_file_and_line(tmp_path, text, line):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        GpuOpt(path)
    message = str(error.value)
    assert str(path) in message and f"line {line}" in message and "\n" not in message.strip()


def test_preset_path_that_is_a_directory_or_not_yaml(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    for preset in (tmp_path / "dir.yaml", tmp_path / "settings.txt"):
        with pytest.raises(ValueError, match="unknown preset"):
            GpuOpt(Path(preset))


# ----------------------------------------------------------------------------- an infinite interval, an empty preset


def test_an_infinite_number_is_refused_saying_it_must_be_finite():
    with pytest.raises(
        ValueError, match=r"`nvml_interval_s` must be a finite number > 0, got inf; e.g. nvml_interval_s=0.5"
    ):
        DataWaitMonitor(nvml_interval_s=INF)


@pytest.mark.parametrize("text", ["", "\n\n", "# our team's settings\n# (to do)\n", "---\n", "{}\n"])
def test_an_empty_or_comment_only_preset_file_is_a_warning(tmp_path, text):
    path = tmp_path / "team.yaml"
    path.write_text(text)
    with pytest.warns(UserWarning, match="is empty") as caught:
        gpuopt = GpuOpt(path)
    (message,) = [str(w.message) for w in caught if "is empty" in str(w.message)]
    assert str(path) in message and "runs no part" in message and "`preset: diagnose`" in message
    assert gpuopt.parts == []  # what the warning says


def test_a_preset_file_that_sets_something_is_no_warning(tmp_path, recwarn):
    path = tmp_path / "team.yaml"
    path.write_text("# extends diagnose\npreset: diagnose\n")
    GpuOpt(path)
    assert not [w for w in recwarn if "is empty" in str(w.message)]


# ----------------------------------------------------------------------------- reports: version, place, one warning

OLD_DATA_WAIT = {"verdict": "input-bound", "data_wait_fraction": 0.5, "steps": 10}  # 0.1.0's flat section


@pytest.mark.parametrize(
    "report, found",
    [
        ({"data_wait": OLD_DATA_WAIT}, 1),  # 0.1.0's report: no `report_version`
        ({"data_wait": OLD_DATA_WAIT, "report_version": 1}, 1),
        ({"data_wait": {}, "report_version": 3}, 3),  # a newer version's
    ],
)
def test_gpuopt_plot_on_another_versions_report_exits_2_naming_both_versions(tmp_path, capsys, report, found):
    from lightning_gpuopt.cli import main
    from lightning_gpuopt.core.report import REPORT_VERSION

    path = tmp_path / "gpuopt_report.json"
    path.write_text(json.dumps(report))
    assert main(["plot", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"`REPORT`={str(path)!r} is a version-{found} report" in error
    assert f"reads version {REPORT_VERSION}" in error and "Traceback" not in error
    assert not list(tmp_path.glob("*.png"))


def test_every_report_section_written_carries_the_report_version(tmp_path):
    from lightning_gpuopt.core.report import REPORT_VERSION, read_json, update_json_section

    path = update_json_section(tmp_path / "gpuopt_report.json", "memory", {"peak": 1})
    assert read_json(path) == {"memory": {"peak": 1}, "report_version": REPORT_VERSION}


@pytest.mark.parametrize("under", ["a-file/gpuopt_report.json", "a-file/deeper/gpuopt_report.json"])
def test_a_report_path_under_a_file_is_refused_at_construction(tmp_path, under):
    (tmp_path / "a-file").write_text("")
    value = str(tmp_path / under)
    with pytest.raises(ValueError) as error:
        DataWaitMonitor(report_path=value)
    assert_names(error, "report_path", value)
    assert f"{tmp_path / 'a-file'}, which is a file, not a folder" in str(error.value)
    assert "errno" not in str(error.value).lower()


@pytest.mark.parametrize("under", ["a-file", "a-file/deeper"])
def test_a_report_under_a_file_is_one_clear_warning_however_many_sections(tmp_path, recwarn, under):
    from lightning_gpuopt.callbacks._reporting import write_report_section

    (tmp_path / "a-file").write_text("")
    path = tmp_path / under / "gpuopt_report.json"
    for section in ("batch_size_search", "memory_fill", "memory", "data_wait", "gpuopt"):
        assert write_report_section(path, section, {"x": 1}) is None
    messages = [str(w.message) for w in recwarn if str(path) in str(w.message)]
    assert len(messages) == 1, messages
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in messages[0] and "training goes on" in messages[0]
    assert "errno" not in messages[0].lower()
