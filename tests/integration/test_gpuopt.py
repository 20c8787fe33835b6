"""GpuOpt: presets composed into one callback, each run as a short fit on CPU."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from helpers import missing_protocol, quiet_trainer
from lightning import Trainer
from models_memory import make_model

from lightning_gpuopt import GpuOpt, available_presets, load_preset
from lightning_gpuopt.callbacks import _reporting
from lightning_gpuopt.callbacks._reporting import report_dir, write_report_section
from lightning_gpuopt.callbacks.gpuopt import render_report
from lightning_gpuopt.core import report as report_module
from lightning_gpuopt.core.estimate import StepEstimator

BUDGET = "40MB"  # the transformer at micro-batch 64 fits it; checkpointing lets 8 fit far below


def fit(tmp_path, gpuopt: GpuOpt, initial: int = 16, max_steps: int = 2, **kwargs) -> tuple[Trainer, object]:
    model = make_model("transformer", num_samples=256, batch_size=initial)
    trainer = quiet_trainer(tmp_path, [gpuopt], max_steps=max_steps, **kwargs)
    trainer.fit(model)
    return trainer, model


def saved_report(trainer: Trainer) -> dict:
    return json.loads((report_dir(trainer) / "gpuopt_report.json").read_text())


def test_diagnose_measures_and_changes_nothing(tmp_path):
    gpuopt = GpuOpt("diagnose")
    trainer, model = fit(tmp_path, gpuopt)
    report = gpuopt.report
    assert report.changes == [] and report.memory_fill is None and report.dataloader is None
    assert report.data_wait is not None and report.data_wait.verdict
    assert report.memory is not None and report.memory.measured_peak_bytes > 0
    assert model.batch_size == 16 and trainer.precision == "32-true"
    saved = saved_report(trainer)
    assert saved["gpuopt"]["changes"] == [] and {"data_wait", "memory"} <= saved.keys()
    assert "nothing changed (measured only)" in render_report(report)


def rows(text: str, name: str) -> list[str]:
    """The values of every table row of ``text`` named ``name``."""
    return [line.split("│")[2].strip() for line in text.splitlines() if line.startswith(f"│ {name} ")]


def test_fill_memory_lists_the_batch_it_set(tmp_path, monkeypatch):
    traced, estimate = [], StepEstimator.estimate
    monkeypatch.setattr(
        StepEstimator, "estimate", lambda self, *a: traced.append(self.step.batch_size) or estimate(self, *a)
    )
    written = []  # the sections written
    write = _reporting.write_report_section
    monkeypatch.setattr(_reporting, "write_report_section", lambda *a: written.append(a[1]) or write(*a))
    gpuopt = GpuOpt("fill-memory", max_memory=BUDGET, global_batch_size=64)
    trainer, _ = fit(tmp_path, gpuopt)
    plan = gpuopt.report.memory_fill
    assert gpuopt.report.changes == ["batch size: 16 → 64"]
    assert (plan.micro_batch_size, plan.accumulate_grad_batches, plan.checkpointing) == (64, 1, False)
    assert gpuopt.report.batch_size_search.batch_size == 64
    # the estimate was made at the micro-batch that trained, and checked against its real peak
    assert gpuopt.report.memory.batch_size == 64
    assert abs(gpuopt.report.memory.estimate_error) < 0.05
    assert saved_report(trainer)["gpuopt"]["changes"] == ["batch size: 16 → 64"]
    # the planned step is traced once (MemoryEstimator, at 64): the plan's predicted peak is its estimate's lines
    # at 64, no trace of its own, and equals that trace
    assert traced == [16, 64] and plan.predicted_peak_bytes == gpuopt.report.memory.predicted_peak_bytes
    assert trainer.callback_metrics["gpuopt/fill_predicted_peak_bytes"].item() == pytest.approx(
        plan.predicted_peak_bytes
    )
    assert saved_report(trainer)["memory_fill"]["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert written.count("memory_fill") == 1  # once
    # one figure per quantity, named alike in every table: the memory limit, the budget, the largest batch
    text = render_report(gpuopt.report)
    limit, budget = report_module.format_bytes(40_000_000, decimal=True), report_module.format_bytes(plan.budget_bytes)
    assert limit == "38.1 MiB (40 MB)" and budget == "38.1 MiB"  # margin='auto' keeps none of it back
    assert rows(text, "memory limit") == [f"{limit} per rank, 1 rank(s)", limit]  # BatchSizeSearch, MemoryEstimator
    assert rows(text, "budget") == [budget, f"{budget} (the memory limit)"]  # MemoryFill, BatchSizeSearch
    assert saved_report(trainer)["batch_size_search"]["limit_bytes"] == 40_000_000
    assert rows(text, "micro-batch") == ["16 → 64 (largest trained: 64)"]
    predicted = gpuopt.report.batch_size_search.predicted_batch_size
    assert rows(text, "largest batch: predicted / trained") == [f"{predicted} (estimate) / 64 (trials)"]
    flat = " ".join(text.replace("│", " ").split())  # table cells wrap
    assert "stopped at the upper bound" in flat and "MemoryFill needs no micro-batch above 64" in flat  # why 64
    assert not any(old in text for old in ("capacity", "largest that fits", "max batch size", "measured only"))


def test_a_plan_that_changes_nothing_says_what_only_ran(tmp_path):
    gpuopt = GpuOpt("fill-memory", max_memory=BUDGET, global_batch_size=16, monitor=False, estimate=False)
    fit(tmp_path, gpuopt, max_steps=1)
    trials = len(gpuopt.report.batch_size_search.trials)
    assert gpuopt.report.changes == [] and trials >= 1
    expected = f"nothing changed (measured only: {trials} batch size trial(s) before training, undone)"
    assert expected in " ".join(render_report(gpuopt.report).replace("│", " ").split())  # the cell wraps


def test_fill_memory_without_a_global_batch_trains_the_largest_batch_that_fits(tmp_path):
    gpuopt = GpuOpt("fill-memory", max_memory=BUDGET, monitor=False, estimate=False)
    fit(tmp_path, gpuopt)
    plan, search = gpuopt.report.memory_fill, gpuopt.report.batch_size_search
    assert plan.micro_batch_size == search.batch_size > 16 and plan.accumulate_grad_batches == 1
    assert (
        search.stop_reason == "bracketed"
        and not next(t for t in search.trials if t.batch_size == search.batch_size + 1).fits
    )
    grown = plan.global_batch_size / 16
    assert gpuopt.report.changes == [f"batch size: 16 → {plan.micro_batch_size}"]  # the learning rate kept
    assert f"the global batch is {grown:.4g}x yours, lr kept at 0.001: the linear rule would set" in plan.reasons[-1]


def test_max_throughput_with_amp_on_cpu_and_a_tuned_loader(tmp_path):
    gpuopt = GpuOpt(
        "max-throughput", max_memory=BUDGET, global_batch_size=128, precision="bf16-mixed", loader_max_seconds=3
    )
    fit(tmp_path, gpuopt)
    report = gpuopt.report
    assert report.changes[0] == "precision: 32-true → bf16-mixed"
    assert report.memory_fill.global_batch_size == 128
    assert report.dataloader is not None and report.dataloader.candidates  # the loader was timed
    assert report.data_wait is not None


def test_low_memory_checkpoints_and_accumulates_at_the_smallest_micro_batch(tmp_path):
    gpuopt = GpuOpt("low-memory", max_memory=BUDGET, global_batch_size=64)
    _trainer, _model = fit(tmp_path, gpuopt)
    plan = gpuopt.report.memory_fill
    assert plan.checkpointing and plan.checkpointed_classes == ["TransformerEncoderLayer"]
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 8)
    assert gpuopt.report.changes == [
        "activation checkpointing: on for 2 blocks (TransformerEncoderLayer)",
        "batch size: 16 → 8",
        "accumulate_grad_batches: 1 → 8",
    ]
    # less memory than fill-memory's plan for the same global batch, measured by the trials
    filled = GpuOpt("fill-memory", max_memory=BUDGET, global_batch_size=64, monitor=False, estimate=False)
    fit(tmp_path / "fill", filled)
    assert plan.measured_peak_bytes < 0.5 * filled.report.memory_fill.measured_peak_bytes


def test_a_users_yaml_extends_a_preset_and_keywords_override_it(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text("preset: fill-memory\nmonitor: false\nmin_micro_batch_size: 4\n")
    gpuopt = GpuOpt(str(path), max_memory=BUDGET, precision="bf16-mixed")
    assert gpuopt.settings["activation_checkpointing"] == "auto"  # from fill-memory
    assert gpuopt.settings["min_micro_batch_size"] == 4 and gpuopt.settings["monitor"] is False  # from the file
    assert gpuopt.settings["precision"] == "bf16-mixed"  # from the keyword
    assert gpuopt.monitor is None and gpuopt.fill is not None and gpuopt.fill.precision == "bf16-mixed"
    fit(tmp_path, gpuopt, max_steps=1)
    assert gpuopt.report.memory_fill.precision == "bf16-mixed"


def test_unknown_preset_and_key_list_the_valid_ones(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown preset 'fast'.*'diagnose', 'fill-memory', 'low-memory', 'max-throughput'"
    ):
        GpuOpt("fast")
    path = tmp_path / "typo.yaml"
    path.write_text("preset: diagnose\nampp: true\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'ampp' in .*typo.yaml: valid keys are monitor, estimate"):
        GpuOpt(str(path))
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("preset: cycle.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        load_preset(cycle)


def test_every_shipped_preset_loads_into_gpuopt():
    for name in available_presets():
        gpuopt = GpuOpt(name, max_memory="1GB")
        assert gpuopt.settings == {**load_preset(name), "max_memory": "1GB"}
        assert gpuopt.monitor is not None  # every preset measures


def _unwritable_dir(tmp_path, how: str):
    if how == "read-only":
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o555)
        if os.access(directory, os.W_OK):  # root: chmod cannot deny
            pytest.skip("running as root: a read-only directory cannot be made with chmod")
        return directory
    blocker = tmp_path / "a-file"  # the log dir lies under a file: NotADirectoryError / FileExistsError
    blocker.write_text("")
    return blocker / "logs"


@pytest.mark.parametrize("how", ["read-only", "under-a-file"])
def test_a_report_that_cannot_be_written_never_costs_the_run(tmp_path, how):
    directory = _unwritable_dir(tmp_path, how)
    gpuopt = GpuOpt("fill-memory", max_memory=BUDGET, global_batch_size=64)
    with pytest.warns(UserWarning, match="could not write the report") as caught:
        trainer, _ = fit(directory, gpuopt, max_steps=3)
    assert trainer.global_step == 3 and gpuopt.report.memory.batch_size == 64  # trained, at the batch it chose
    assert gpuopt.report.changes == ["batch size: 16 → 64"]
    # five sections failed (batch_size_search, memory_fill, memory, data_wait, gpuopt): one warning says so
    (message,) = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert str(directory / "gpuopt_report.json") in message and "training goes on" in message
    if how == "under-a-file":
        assert f"{tmp_path / 'a-file'} is a file, not a folder" in message and "errno" not in message


def test_a_full_disk_at_the_end_of_fit_warns_and_the_run_ends_normally(tmp_path, monkeypatch):
    # every write of the report goes to /dev/full: the kernel answers ENOSPC, as a full disk does
    monkeypatch.setattr(
        report_module,
        "_create_sibling",
        lambda target: (os.open("/dev/full", os.O_WRONLY), tmp_path / ".gpuopt_report.json.tmp"),
    )
    gpuopt = GpuOpt("diagnose")
    with pytest.warns(UserWarning, match="No space left on device") as caught:
        trainer, _ = fit(tmp_path, gpuopt, max_steps=3)
    assert trainer.global_step == 3 and trainer.state.finished
    assert gpuopt.report is not None and gpuopt.report.data_wait is not None and gpuopt.report.memory is not None
    assert sum("No space left on device" in str(w.message) for w in caught) == 1  # memory, data_wait, gpuopt: once
    assert not (tmp_path / "gpuopt_report.json").exists()


def test_a_log_dir_url_without_its_filesystem_package_is_one_warning_and_the_run_ends_normally(tmp_path, monkeypatch):
    protocol, package = missing_protocol()  # e.g. s3:// without s3fs
    monkeypatch.chdir(tmp_path)
    url = f"{protocol}://gpuopt-test-{uuid.uuid4().hex[:12]}/run"
    gpuopt = GpuOpt("diagnose")  # three sections (memory, data_wait, gpuopt): one warning for the folder
    with pytest.warns(UserWarning, match=f"pip install {package}") as caught:
        trainer, _ = fit(url, gpuopt, max_steps=3)  # logger=False: Lightning itself writes nothing there
    assert trainer.global_step == 3 and trainer.state.finished
    assert gpuopt.report.data_wait is not None and gpuopt.report.memory is not None
    about_it = [str(w.message) for w in caught if url in str(w.message)]
    assert (
        len(about_it) == 1 and f"{url}/gpuopt_report.json" in about_it[0] and "training goes on" in about_it[0].lower()
    )
    assert list(tmp_path.iterdir()) == []  # no local `s3:` folder


def test_a_remote_filesystems_own_error_is_a_warning(memory_url, monkeypatch):
    import fsspec

    def refuse(*args, **kwargs):
        raise RuntimeError("no credentials found")  # as botocore's NoCredentialsError, not an OSError

    monkeypatch.setattr(type(fsspec.filesystem("memory")), "pipe_file", refuse)
    url = f"{memory_url}/gpuopt_report.json"
    with pytest.warns(UserWarning, match=r"could not write the report .*RuntimeError: no credentials found"):
        assert write_report_section(url, "gpuopt", {"changes": []}) is None


def test_without_a_logger_the_report_goes_to_default_root_dir_and_gpuopt_says_where(tmp_path, monkeypatch, caplog):
    # Lightning's own files without a logger (checkpoints/) go to default_root_dir, the working directory unless set
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with caplog.at_level("INFO"):
        trainer, _ = fit(tmp_path / "root", GpuOpt("diagnose"), max_steps=3, enable_checkpointing=True)
    assert trainer.loggers == [] and (tmp_path / "root" / "gpuopt_report.json").is_file()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["checkpoints", "gpuopt_report.json"]
    assert list((tmp_path / "cwd").iterdir()) == []
    (said,) = [r.getMessage() for r in caplog.records if "report written to" in r.getMessage()]
    assert said == (
        f"gpuopt: report written to {tmp_path / 'root' / 'gpuopt_report.json'}"
        " (no logger: default_root_dir, where Lightning saves checkpoints)"
    )


def test_the_tuner_note_inside_gpuopt_says_what_it_did_to_your_setting(tmp_path):
    gpuopt = GpuOpt("diagnose", tune_loader=True, loader_max_seconds=2)
    fit(tmp_path, gpuopt)
    tuned = gpuopt.report.dataloader
    text = render_report(gpuopt.report)
    below = text.split("gpuopt · DataLoaderTuner", 1)[1].split("┘\n", 1)[1]  # the note under the tuner's table
    note = " ".join(below.split("\ngpuopt")[0].split())  # its wrapped lines joined
    assert not note.startswith(";")  # it read "; 1.00x your setting" with no sentence before it
    if tuned.setting == tuned.baseline.setting:
        assert note.startswith(f"kept your setting {tuned.baseline.setting.describe()}") and "1.00x" not in text
    else:
        assert note.startswith(f"{tuned.baseline.setting.describe()} → {tuned.setting.describe()}")
        assert f"{tuned.samples_per_second / tuned.baseline.samples_per_second:.2f}x" in note


def test_every_hook_a_part_overrides_is_written_out_in_gpuopt():
    """GpuOpt forwards hooks in its class body; a hook a part gains must be forwarded too, or the
    part silently stops seeing it inside GpuOpt."""
    from lightning.pytorch.callbacks import Callback

    from lightning_gpuopt import DataLoaderTuner, DataWaitMonitor, MemoryEstimator, MemoryFill

    hooks = {name for name, value in vars(Callback).items() if callable(value) and not name.startswith("_")}
    overridden = set()
    for part in (MemoryFill, DataLoaderTuner, MemoryEstimator, DataWaitMonitor):
        for klass in part.__mro__[: part.__mro__.index(Callback)]:
            overridden |= hooks & set(vars(klass))
    assert overridden, "the parts override no hook: the check would pass for nothing"
    assert overridden <= set(vars(GpuOpt)), sorted(overridden - set(vars(GpuOpt)))
    for name in overridden:
        assert getattr(vars(GpuOpt)[name], "__override__", False), f"GpuOpt.{name} lacks @override"


def test_lightning_names_precision_activation_checkpointing_and_verbose(tmp_path, caplog):
    # precision= takes a Lightning precision string (CPU runs it too), activation_checkpointing= names the blocks,
    # verbose=False silences the combined report while the JSON report is still written
    gpuopt = GpuOpt(
        "fill-memory",
        max_memory=BUDGET,
        global_batch_size=32,
        precision="bf16-mixed",
        activation_checkpointing=["TransformerEncoderLayer"],
        monitor=False,
        estimate=False,
        verbose=False,
    )
    with caplog.at_level("INFO"):
        trainer, _ = fit(tmp_path, gpuopt, max_steps=1)
    plan = gpuopt.report.memory_fill
    assert plan.precision == "bf16-mixed" and plan.checkpointed_classes == ["TransformerEncoderLayer"]
    assert trainer.precision == "32-true"  # put back at teardown
    assert "gpuopt · preset" not in caplog.text and saved_report(trainer)["gpuopt"]["settings"]["precision"]
    kept = GpuOpt("max-throughput", precision=None)  # None: the preset's value (its key in a YAML file: null)
    assert kept.fill is not None and kept.fill.precision == "auto" and GpuOpt("fill-memory").fill.precision is None
    with pytest.raises(ValueError, match=r"`precision`='bf16-true' is not a precision MemoryFill switches to"):
        GpuOpt("fill-memory", precision="bf16-true")
    with pytest.raises(ValueError, match=r"`verbose` must be True or False"):
        GpuOpt(verbose="no")  # type: ignore[arg-type]
