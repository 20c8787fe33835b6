"""Progress of long work (one line per batch-size trial / loader candidate as it ends, or a rich bar
with the Trainer's progress bar; silence with ``verbose=False``), and ``gpuopt/*`` metrics in
``trainer.callback_metrics`` so that ``ModelCheckpoint`` and ``EarlyStopping`` can monitor them, with
and without a logger."""

from __future__ import annotations

import csv
import logging
import re
from typing import Any

import pytest
import torch
from helpers import MLP, SlowDataset, quiet_trainer
from lightning import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models_memory import make_model
from torch.utils.data import DataLoader

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt

BUDGET = "20MB"


def make_trainer(tmp_path, callbacks, **kwargs: Any) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 1, **kwargs})


class Lines(logging.Handler):
    """The progress lines logged (through ``rank_zero_info``) that start with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__(logging.INFO)
        self.prefix = prefix
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix):
            self.lines.append(message)


@pytest.fixture
def trial_lines():
    handler = Lines("BatchSizeSearch trial")
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    logging.getLogger("lightning").setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def candidate_lines(trial_lines):
    handler = Lines("DataLoaderTuner timing")
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def test_each_trial_is_reported_as_it_ends(tmp_path, trial_lines):
    model = make_model("mlp", num_samples=4096, batch_size=16)
    lines_seen_by_steps: list[int] = []
    training_step = model.training_step

    def counting_step(*args: Any, **kwargs: Any) -> Any:
        lines_seen_by_steps.append(len(trial_lines.lines))
        return training_step(*args, **kwargs)

    model.training_step = counting_step
    search = BatchSizeSearch(max_memory=BUDGET)
    make_trainer(tmp_path, [search]).fit(model)
    trials = search.result.trials
    assert len(trials) >= 2 and len(trial_lines.lines) == len(trials)
    for number, (line, trial) in enumerate(zip(trial_lines.lines, trials), 1):
        outcome = "fits" if trial.fits else "does not fit"
        assert line.startswith(f"BatchSizeSearch trial {number}/10: batch size {trial.batch_size} {outcome}: peak ")
    # trial k's steps ran after the lines of trials 1..k-1 and before its own; training saw them all
    assert lines_seen_by_steps[0] == 0 and lines_seen_by_steps[-1] == len(trials)
    assert sorted(set(lines_seen_by_steps)) == list(range(len(trials) + 1))
    assert lines_seen_by_steps == sorted(lines_seen_by_steps)


def test_quiet_search_reports_nothing(tmp_path, trial_lines, caplog):
    search = BatchSizeSearch(max_memory=BUDGET, verbose=False)
    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path, [search]).fit(make_model("mlp", num_samples=4096, batch_size=16))
    assert search.result.trials and trial_lines.lines == []
    assert "BatchSizeSearch" not in caplog.text


def test_with_the_trainers_progress_bar_the_trials_advance_a_bar_instead(tmp_path, trial_lines, capsys):
    search = BatchSizeSearch(max_memory=BUDGET)
    make_trainer(tmp_path, [search], enable_progress_bar=True).fit(make_model("mlp", num_samples=4096, batch_size=16))
    assert search.result.trials and trial_lines.lines == []
    shown = capsys.readouterr().out
    last = search.result.trials[-1]
    trials = len(search.result.trials)
    assert "BatchSizeSearch trial" in shown and f" {trials}/{trials} " in shown  # the bar ends full
    assert f"batch size {last.batch_size}" in shown  # and shows the last trial


def test_each_loader_candidate_is_reported_and_gpuopt_shows_progress_of_its_quiet_parts(tmp_path, candidate_lines):
    gpuopt = GpuOpt("diagnose", tune_loader=True, loader_max_seconds=1, estimate=False, monitor=False)
    make_trainer(tmp_path, [gpuopt]).fit(MLP(), DataLoader(SlowDataset(2048, delay_s=0.0002), batch_size=32))
    candidates = gpuopt.report.dataloader.candidates
    # every timing run is one line (a contender may be timed twice; the result keeps its best timing)
    assert len(candidate_lines.lines) >= len(candidates) >= 2
    assert candidate_lines.lines[0].startswith("DataLoaderTuner timing 1: main process (0 workers) [yours]: ")
    for candidate in candidates:
        assert any(f": {candidate.setting.short()}" in line for line in candidate_lines.lines)
    # the summary counts what the progress lines counted: settings, and timings (a repeat says "again")
    lines = candidate_lines.lines
    assert f"{len(candidates)} settings in {len(lines)} timings" in gpuopt.tuner.message
    assert sum(", again" in line for line in lines) == len(lines) - len(candidates)

    quiet = DataLoaderTuner(max_seconds=1, verbose=False)
    before = len(candidate_lines.lines)
    make_trainer(tmp_path, [quiet]).fit(MLP(), DataLoader(SlowDataset(2048, delay_s=0.0002), batch_size=32))
    assert quiet.result.candidates and len(candidate_lines.lines) == before


def test_fill_memory_shows_each_phase_of_its_added_time_as_a_line(tmp_path, trial_lines):
    lines = Lines("")
    logging.getLogger().addHandler(lines)
    gpuopt = GpuOpt("fill-memory", max_memory=BUDGET, monitor=False)
    make_trainer(tmp_path, [gpuopt]).fit(make_model("mlp", num_samples=4096, batch_size=16))
    logging.getLogger().removeHandler(lines)
    ours = [line for line in lines.lines if line.startswith(("MemoryFill", "BatchSizeSearch", "MemoryEstimator"))]
    trials, plan = len(gpuopt.report.batch_size_search.trials), gpuopt.report.memory_fill
    predicted = gpuopt.report.batch_size_search.predicted_batch_size
    # the estimate before the trials, each trial, the plan's time by phase, the trace of the first batch
    assert ours[0].startswith(
        f"MemoryFill estimate: a trace of the step predicts a largest micro-batch of {predicted} ("
    )
    assert [line.split(":")[0] for line in ours[1 : trials + 1]] == [
        f"BatchSizeSearch trial {n}/10" for n in range(1, trials + 1)
    ]
    assert re.fullmatch(
        r"MemoryFill: planned in [\d.]+ m?s \(estimate [\d.]+ m?s, trials and the rest [\d.]+ m?s\)", ours[trials + 1]
    )
    assert ours[trials + 2].startswith(f"MemoryEstimator: step traced at batch {plan.micro_batch_size} (")
    assert len(ours) == trials + 3


# ------------------------------------------------------------------ metrics for EarlyStopping / ModelCheckpoint


def csv_column(logger: CSVLogger, key: str) -> list[float]:
    with open(logger.experiment.metrics_file_path) as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


@pytest.mark.parametrize("with_logger", [False, True], ids=["no-logger", "csv-logger"])
def test_model_checkpoint_monitors_the_batch_size_found(tmp_path, with_logger):
    logger = CSVLogger(tmp_path) if with_logger else False
    search = BatchSizeSearch(max_memory=BUDGET, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="gpuopt/batch_size", mode="max", save_top_k=1)
    trainer = make_trainer(tmp_path, [search, checkpoint], logger=logger, max_steps=2, enable_checkpointing=True)
    trainer.fit(make_model("mlp", num_samples=4096, batch_size=16))
    assert trainer.train_dataloader.batch_size == search.result.batch_size  # what trained, read from the loader
    assert checkpoint.best_model_score == trainer.train_dataloader.batch_size
    assert checkpoint.best_model_path and (tmp_path / "ckpt").exists()
    value = trainer.callback_metrics["gpuopt/batch_size"]
    assert isinstance(value, torch.Tensor) and value.ndim == 0
    if with_logger:
        trainer.logger.save()
        assert csv_column(trainer.logger, "gpuopt/batch_size") == [float(search.result.batch_size)]


@pytest.mark.parametrize("with_logger", [False, True], ids=["no-logger", "csv-logger"])
def test_early_stopping_on_a_data_wait_metric(tmp_path, with_logger):
    logger = CSVLogger(tmp_path) if with_logger else False
    monitor = DataWaitMonitor(warmup_steps=1, log_every_n_steps=2, verbose=False)
    # any step time is below the threshold: training stops at the first check, after epoch 0
    stopper = EarlyStopping(monitor="gpuopt/step_time_ms", mode="min", stopping_threshold=1e9)
    trainer = make_trainer(tmp_path, [monitor, stopper], logger=logger, max_steps=-1, max_epochs=5)
    trainer.fit(MLP(), DataLoader(SlowDataset(64), batch_size=8))
    assert stopper.stopped_epoch == 0 and trainer.current_epoch == 1 and trainer.global_step == 8
    assert "gpuopt/data_wait_fraction" in trainer.callback_metrics
    if with_logger:
        trainer.logger.save()
        logged = csv_column(trainer.logger, "gpuopt/step_time_ms")
        assert logged and trainer.callback_metrics["gpuopt/step_time_ms"].item() == pytest.approx(logged[-1])
