"""DataWaitMonitor with a real Trainer on CPU, real dataloaders and an independent stopwatch."""

from __future__ import annotations

import csv
import itertools
import json
import statistics
import time
from typing import Any, Optional

import pytest
from helpers import (
    MLP,
    SlowDataset,
    SlowHook,
    TimedLoader,
    TrainingWallClock,
    memory_files,
    preloaded_batches,
    preloaded_dataset,
    quiet_trainer,
)
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import Precision
from lightning.pytorch.profilers import SimpleProfiler
from models_users import DataloaderIterModule
from torch.utils.data import DataLoader

from lightning_gpuopt import DataWaitMonitor, DataWaitReport, MemoryEstimator
from lightning_gpuopt.callbacks import _detect_hooks, data_wait_monitor
from lightning_gpuopt.core.report import from_dict


def test_slow_dataset_is_input_bound_with_the_true_data_wait(tmp_path):
    delay_s, batch_size = 0.002, 8
    dataset = SlowDataset(480, delay_s=delay_s)
    monitor, stopwatch = DataWaitMonitor(warmup_steps=2), TrainingWallClock()
    # the training step itself costs ~10 ms, so the true data wait share is near 0.6
    loader = TimedLoader(dataset, batch_size=batch_size)
    quiet_trainer(tmp_path, [monitor, stopwatch], max_epochs=1).fit(MLP(step_sleep_s=0.01), loader)

    report = monitor.report
    # ground truth: the loader's own stopwatch around every next() over the test's wall clock; the
    # fetch includes collate and, on a loaded machine, the waits for a core after each sleep
    truth = sum(loader.fetch_s) / stopwatch.wall_s
    assert 0.3 < truth < 0.9
    assert sum(loader.fetch_s) >= dataset.loading_time(0)  # the samples' own sleeps are inside it
    assert report.data_wait_fraction == pytest.approx(truth, abs=0.1)
    assert report.verdict == "input-bound"
    assert report.totals.steps == 60 - 2  # 60 batches less 2 warm-up steps (the epoch's first step is one of them)
    # absolute figure: the measured steps fetched every batch after the 2 warm-up batches
    loading = dataset.loading_time(2 * batch_size)
    assert 0.9 * loading <= report.totals.data_wait_s <= loading * 1.1 + report.totals.steps * 0.001  # (see below)
    assert report.totals.samples == report.totals.steps * batch_size
    assert report.gpu_idle_fraction is None and report.totals.gpu_util_mean is None  # CPU, no NVML
    loader_cpu = report.totals.loader_cpu_fraction
    assert loader_cpu is not None and loader_cpu < 0.5  # sleeping, not computing
    workers = [advice for advice in report.recommendations if advice.startswith("num_workers=0 → ")]
    assert len(workers) == 1, report.recommendations


def test_preloaded_data_and_heavy_model_is_compute_bound(tmp_path):
    # whole batches of 512: the fetch of a preloaded batch costs the same ~0.5-1.2 ms a step on a
    # loaded machine whatever its size, so the step must be long by construction (batches of 64
    # made ~15 ms steps whose data wait share reached 5-8% beside two CPU hogs)
    loader = DataLoader(preloaded_batches(24, 512, 256), batch_size=None)
    monitor = DataWaitMonitor(warmup_steps=2)
    quiet_trainer(tmp_path, [monitor], max_steps=24).fit(MLP(features=256, hidden=1024, layers=3), loader)

    report = monitor.report
    assert report.verdict == "compute-bound", report.verdict_reason
    assert report.data_wait_fraction < 0.05
    assert report.totals.compute_fraction > 0.75
    assert not any(advice.startswith("num_workers") for advice in report.recommendations)


def test_slow_host_hook_is_host_bound(tmp_path):
    # the hook's share is large by construction: 50 ms of sleep against a step of ~1 ms and a fetch
    # of ~0.5 ms (with a 10 ms hook a loaded machine's few ms of preemption in the fetches alone
    # took the data wait share from ~3% past 5%)
    hook_s = 0.05
    loader = DataLoader(preloaded_dataset(1024, 32), batch_size=32)
    monitor = DataWaitMonitor(warmup_steps=1)
    quiet_trainer(tmp_path, [monitor, SlowHook(hook_s)], max_steps=20).fit(MLP(), loader)

    report, totals = monitor.report, monitor.report.totals
    figures = (totals.steps, totals.wall_s, totals.data_wait_s, totals.compute_s, totals.other_s)
    assert report.verdict == "host-bound", (report.verdict_reason, figures)
    assert totals.other_fraction > 0.5, figures
    # a sleep never returns early: the hook's 50 ms a step land in "other" on any machine ...
    assert totals.other_s / totals.steps >= 0.95 * hook_s, figures
    # ... and not in data wait, which would then hold at least 50 ms a step (and half the wall time)
    assert totals.data_wait_s / totals.steps < hook_s / 5, figures
    assert report.data_wait_fraction < 0.1, figures
    assert any(advice.startswith("batch_size=32 → 64") for advice in report.recommendations)


def test_validation_and_checkpoints_do_not_leak_into_data_wait(tmp_path):
    batch_size = 8
    train_data, val_data = SlowDataset(400, delay_s=0.001), SlowDataset(64, delay_s=0.004)
    monitor, stopwatch = DataWaitMonitor(warmup_steps=1), TrainingWallClock()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = quiet_trainer(
        tmp_path,
        [monitor, stopwatch, checkpoint],
        max_steps=30,
        val_check_interval=10,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
    )
    trainer.fit(
        MLP(step_sleep_s=0.002), DataLoader(train_data, batch_size=batch_size), DataLoader(val_data, batch_size=16)
    )

    report = monitor.report
    loading = train_data.loading_time(1 * batch_size)  # the batches of the measured steps
    # steps not sampled are the gap less the sampled steps' mean rest: a loaded machine's stall in a sampled gap
    # lowers them all a little, one in a gap not sampled counts as wait
    assert 0.9 * loading <= report.totals.data_wait_s <= loading * 1.1 + report.totals.steps * 0.002
    assert len(val_data.durations) == 3 * 2 * 16  # validation after steps 10, 20, 30
    assert report.totals.validation_s >= val_data.loading_time(0)
    assert report.totals.checkpoint_s > 0
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 6
    # the shares are of the training steps alone: validation and saving are outside their wall time
    assert report.data_wait_fraction == pytest.approx(report.totals.data_wait_s / report.totals.wall_s)
    assert report.totals.wall_s + report.totals.validation_s + report.totals.checkpoint_s <= stopwatch.wall_s


def test_json_report_round_trips_and_metrics_reach_the_csv_logger(tmp_path):
    loader = DataLoader(SlowDataset(320, delay_s=0.001), batch_size=8)
    monitor = DataWaitMonitor(warmup_steps=2, log_every_n_steps=5)
    logger = CSVLogger(tmp_path, name="run")
    quiet_trainer(tmp_path, [monitor], max_steps=32, logger=logger).fit(MLP(), loader)

    path = monitor.report_file
    assert path is not None and path.name == "gpuopt_report.json" and path.parent == tmp_path / "run" / "version_0"
    loaded = from_dict(DataWaitReport, json.loads(path.read_text())["data_wait"])
    assert loaded == monitor.report

    with open(tmp_path / "run" / "version_0" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("gpuopt/data_wait_fraction")]
    assert len(rows) == (32 - 2) // 5
    for row in rows:
        assert 0.0 < float(row["gpuopt/data_wait_fraction"]) <= 1.0
        assert float(row["gpuopt/samples_per_second"]) > 0
        assert float(row["gpuopt/step_time_ms"]) >= float(row["gpuopt/data_wait_ms"]) > 0
    assert "gpuopt/gpu_util" not in rows[0]  # no NVML on this machine: the key is left out, not faked


@pytest.mark.parametrize("every", [None, 2])
def test_following_the_trainers_cadence_logs_are_a_second_apart_and_a_cadence_given_is_kept(
    tmp_path, every, monkeypatch
):
    monkeypatch.setattr(data_wait_monitor, "LOG_EVERY_S", 0.1)  # a second, scaled to a short run
    monitor, logged_at = DataWaitMonitor(warmup_steps=1, log_every_n_steps=every, verbose=False), []
    monkeypatch.setattr(monitor, "_log_window", lambda *args: logged_at.append(time.perf_counter()))
    loader = DataLoader(preloaded_dataset(8 * 41, 32), batch_size=8)
    quiet_trainer(tmp_path, [monitor], max_steps=41, log_every_n_steps=2).fit(MLP(step_sleep_s=0.01), loader)

    if every == 2:  # every 2 measured steps, however close in time
        assert len(logged_at) == 20
    else:  # every 2 steps at most, and 0.1 s apart: a log in about every 10 steps of ~11 ms
        assert 2 <= len(logged_at) < 10 and min(b - a for a, b in itertools.pairwise(logged_at)) >= 0.1


def test_report_goes_to_a_remote_log_dir_through_fsspec(memory_url, tmp_path):
    # the logger's save_dir is a URL (as s3://bucket/runs would be): trainer.log_dir is memory://.../run/version_0
    monitor = DataWaitMonitor(warmup_steps=2)
    logger = CSVLogger(memory_url, name="run")
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=8, logger=logger, default_root_dir=memory_url)
    trainer.fit(MLP(), DataLoader(SlowDataset(96, delay_s=0.001), batch_size=8))

    url = f"{memory_url}/run/version_0/gpuopt_report.json"
    assert trainer.log_dir == f"{memory_url}/run/version_0" and monitor.report_file == url
    saved = json.loads(memory_files(memory_url)[url])
    section = saved["data_wait"]
    assert {"verdict", "recommendations"} <= section["diagnosis"].keys()
    assert {"steps", "data_wait_fraction", "gpu_idle_fraction", "other_s"} <= section["totals"].keys()
    assert from_dict(DataWaitReport, saved["data_wait"]) == monitor.report
    assert list(tmp_path.iterdir()) == []  # nothing local: no `memory:` folder made of a mangled URL


def test_users_profiler_keeps_working_and_is_restored(tmp_path):
    profiler = SimpleProfiler()
    loader = DataLoader(SlowDataset(160, delay_s=0.001), batch_size=8)
    monitor = DataWaitMonitor(warmup_steps=1)
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=15, profiler=profiler)
    trainer.fit(MLP(), loader)

    assert trainer.profiler is profiler
    fetches = profiler.recorded_durations["[_TrainingEpochLoop].train_dataloader_next"]
    assert len(fetches) == 15
    # the profiler and the monitor timed the same calls
    measured = sum(fetches[1:])  # step 0 is warm-up (and the epoch's start-up)
    assert monitor.report.totals.data_wait_s == pytest.approx(measured, rel=0.05)


def test_lightning_dispatches_only_the_per_batch_hooks_our_callbacks_use(tmp_path):
    profiler, monitor, estimator = SimpleProfiler(), DataWaitMonitor(verbose=False), MemoryEstimator(verbose=False)
    trainer = quiet_trainer(tmp_path, [monitor, estimator], max_steps=4, profiler=profiler)
    trainer.fit(MLP(), DataLoader(preloaded_dataset(64, 32), batch_size=8))

    dispatched = {action for action in profiler.recorded_durations if action.startswith("[Callback]")}
    for callback in (monitor, estimator):  # each hook it has is called every batch; the no-ops never are
        hooks = {
            action.rpartition(".")[2] for action in dispatched if action.startswith(f"[Callback]{callback.state_key}.")
        }
        assert "on_train_batch_end" in hooks and not hooks & {
            "on_before_backward",
            "on_after_backward",
            "on_before_zero_grad",
        }
    assert len(profiler.recorded_durations[f"[Callback]{monitor.state_key}.on_train_batch_start"]) == 4


class SeesProfiler(MLP):
    """Notes, in each ``training_step``, whether the monitor's profiler tap is in ``trainer.profiler``'s path;
    saves a checkpoint in ``training_step`` every ``save_every`` steps."""

    def __init__(self, save_every: int = 0, path: Any = None) -> None:
        super().__init__(step_sleep_s=0.002)
        self.tapped: list[bool] = []
        self.save_every, self.path = save_every, path

    def training_step(self, batch, batch_idx):
        self.tapped.append(type(self.trainer.profiler).__name__ == "ProfilerTap")
        if self.save_every and len(self.tapped) % self.save_every == 0:
            self.trainer.save_checkpoint(self.path / f"step{len(self.tapped)}.ckpt")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("find_patterns", [True, False])
def test_training_step_is_timed_in_sampled_steps_and_the_tap_leaves_the_path_in_the_others(tmp_path, find_patterns):
    profiler, model = SimpleProfiler(), SeesProfiler()
    monitor = DataWaitMonitor(warmup_steps=1, find_patterns=find_patterns, verbose=False)
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=160, profiler=profiler)
    trainer.fit(model, DataLoader(preloaded_dataset(8 * 200, 32), batch_size=8))

    first = 1 + _detect_hooks.HOOK_SAMPLED_FIRST  # warm-up + 4, then about one in 32
    assert all(model.tapped[:first]) and 1 <= sum(model.tapped[first:]) <= 3 * 160 / _detect_hooks.HOOK_SAMPLE_EVERY
    assert trainer.profiler is profiler  # restored; it saw every step
    steps = profiler.recorded_durations["[Strategy]SingleDeviceStrategy.training_step"]
    fetches = profiler.recorded_durations["[_TrainingEpochLoop].train_dataloader_next"]
    assert len(steps) == 160 and len(fetches) >= 160
    totals = monitor.report.totals
    assert len(monitor.report.timeline.data_wait_s) == totals.steps == 159  # a point a step, timed or estimated
    sampled = [seconds for seconds, tapped in zip(steps[1:], model.tapped[1:]) if tapped]  # the profiler's, there
    assert totals.forward_s == pytest.approx(statistics.mean(sampled) * totals.steps, rel=0.1)  # their mean, scaled
    assert totals.forward_s > 0


class EveryFifthBatchSlow(SlowDataset):
    """Unshuffled batches of 8: each sample of every fifth batch sleeps 1 ms."""

    def __getitem__(self, index: int) -> Any:
        self.delay_s = 0.001 if index // 8 % 5 == 0 else 0.0
        return super().__getitem__(index)


def test_the_data_wait_of_a_step_the_tap_left_is_the_gap_before_it_less_the_sampled_steps_rest(tmp_path):
    monitor, loader = DataWaitMonitor(warmup_steps=1, verbose=False), TimedLoader(EveryFifthBatchSlow(8 * 120), 8)
    quiet_trainer(tmp_path, [monitor], max_steps=120).fit(MLP(), loader)

    timeline, truth = monitor.report.timeline, loader.fetch_s  # the loader's own stopwatch around each next()
    assert timeline.steps_per_point == 1 and timeline.step == list(range(1, 120))
    slow = [(wait, truth[step]) for step, wait in zip(timeline.step, timeline.data_wait_s) if step % 5 == 0]
    fast = [(wait, truth[step]) for step, wait in zip(timeline.step, timeline.data_wait_s) if step % 5]
    assert all(wait > 0.006 for wait, _ in slow)  # step by step (a loaded machine's stalls only add to a gap)
    assert statistics.median(wait for wait, _ in slow) == pytest.approx(statistics.median(t for _, t in slow), rel=0.1)
    assert statistics.median(wait for wait, _ in fast) < 0.001
    assert sum(timeline.data_wait_s) >= 0.9 * sum(truth[1:120])


class SwapsPrecisionPlugin(Callback):
    """Gives the strategy a new precision plugin at step ``at`` (as a callback that changes precision does)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.strategy.precision_plugin = Precision()


class FailsAt(SeesProfiler):
    def training_step(self, batch, batch_idx):
        if batch_idx == 90:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def _ours_left(trainer: Any, monitor: DataWaitMonitor) -> set[str]:
    """Our functions still on Lightning's objects or the monitor's hooks still set aside on it."""
    owners = {"monitor": monitor, "epoch loop": trainer.fit_loop.epoch_loop, "plugin": trainer.precision_plugin}
    names = ("on_train_batch_start", "on_train_batch_end", "_on_before_fetch", "convert_input")
    return {f"{owner}.{name}" for owner, obj in owners.items() for name in names if name in vars(obj)}


def test_lightning_calls_no_hook_of_the_monitor_in_steps_not_sampled_and_every_step_is_measured(tmp_path):
    profiler, model = SimpleProfiler(), SeesProfiler()
    monitor, loader = DataWaitMonitor(warmup_steps=1, verbose=False), TimedLoader(EveryFifthBatchSlow(8 * 120), 8)
    trainer = quiet_trainer(tmp_path, [monitor, SwapsPrecisionPlugin(at=70)], max_steps=120, profiler=profiler)
    trainer.fit(model, loader)

    starts = profiler.recorded_durations[f"[Callback]{monitor.state_key}.on_train_batch_start"]
    assert len(starts) == sum(model.tapped) < 30  # the sampled steps' only (the tap in the path of their step)
    timeline = monitor.report.timeline  # every step but the first measured, the plugin's swap notwithstanding
    assert timeline.step == list(range(1, 120)) and monitor.report.totals.steps == 119
    excess = [wait - truth for wait, truth in zip(timeline.data_wait_s, loader.fetch_s[1:120])]  # each step's fetch
    assert min(excess) >= 0 and statistics.median(excess) < 0.0005  # around the loader's own stopwatch
    assert not _ours_left(trainer, monitor)


def test_a_run_stopped_in_a_noted_step_leaves_nothing_of_the_monitor_behind(tmp_path):
    model, monitor = FailsAt(), DataWaitMonitor(warmup_steps=1, verbose=False)
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=120)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        trainer.fit(model, DataLoader(preloaded_dataset(8 * 120, 32), batch_size=8))
    assert not model.tapped[-1] and not _ours_left(trainer, monitor)  # it stopped in a step not sampled


def test_a_save_inside_a_step_the_tap_left_is_timed_and_counted_like_any_other(tmp_path):
    profiler, model = SimpleProfiler(), SeesProfiler(save_every=10, path=tmp_path)
    monitor = DataWaitMonitor(warmup_steps=1, verbose=False)
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=80, profiler=profiler)
    trainer.fit(model, DataLoader(preloaded_dataset(8 * 100, 32), batch_size=8))

    assert not all(model.tapped[19::10])  # some saves ran in steps whose start the tap did not see
    saves = profiler.recorded_durations["save_checkpoint"]
    assert len(saves) == 8 and 0.7 * sum(saves) <= monitor.report.totals.checkpoint_s <= sum(saves)  # ours: inside
    hooks = monitor._action_probes[0]  # every save reached the checkpoint-time probe
    assert sum(saves for saves, _ in hooks._saves.values()) + hooks._pending_saves[0] == 8


class EndsEpochWhenUntapped(MLP):
    """Ends its first epoch (``-1``) at the first step after 20 whose start the monitor's tap is not in the path of;
    notes at each epoch start whether the tap is in the path (for the epoch's fetches)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended_at: Optional[int] = None
        self.tapped_at_epoch_start: list[bool] = []

    def on_train_batch_start(self, batch, batch_idx):
        if self.ended_at is None and batch_idx > 20 and type(self.trainer.profiler).__name__ != "ProfilerTap":
            self.ended_at = batch_idx
            return -1
        return None

    def on_train_epoch_start(self) -> None:
        self.tapped_at_epoch_start.append(type(self.trainer.profiler).__name__ == "ProfilerTap")


@pytest.mark.parametrize("save", [True, False])
def test_an_epoch_ended_by_on_train_batch_start_has_its_save_timed_and_the_tap_back_for_the_next(tmp_path, save):
    profiler, model = SimpleProfiler(), EndsEpochWhenUntapped()
    monitor = DataWaitMonitor(warmup_steps=1, verbose=False)
    checkpoint = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)] if save else []
    trainer = quiet_trainer(
        tmp_path, [monitor, *checkpoint], max_epochs=2, profiler=profiler, enable_checkpointing=save
    )
    trainer.fit(model, DataLoader(preloaded_dataset(8 * 40, 32), batch_size=8))

    assert model.ended_at is not None and model.tapped_at_epoch_start == [True, True]
    saves = profiler.recorded_durations["save_checkpoint"]
    assert len(saves) == 2 * save and 0.7 * sum(saves) <= monitor.report.totals.checkpoint_s <= sum(saves)


class PullsSlowBatches(DataloaderIterModule):
    """``training_step(self, dataloader_iter)``: its batches are fetched inside the step, 8 sleeps of 0.5 ms each."""

    def train_dataloader(self):
        return DataLoader(SlowDataset(64, delay_s=0.0005), batch_size=8)


def test_a_training_step_that_pulls_its_batches_has_its_fetch_timed_in_every_step(tmp_path):
    monitor = DataWaitMonitor(warmup_steps=1, verbose=False)
    quiet_trainer(tmp_path, [monitor], max_steps=80).fit(PullsSlowBatches())
    totals = monitor.report.totals
    assert totals.steps >= 60  # 10 epochs of 8 steps, each epoch's first not measured
    assert 0.8 * 0.004 <= totals.data_wait_per_step_s <= 3 * 0.004  # every step's fetch, not the sampled ones'


def test_multi_epoch_run_reports_loader_start_up_per_epoch(tmp_path):
    loader = DataLoader(SlowDataset(64, delay_s=0.001), batch_size=8, num_workers=1, persistent_workers=False)
    monitor = DataWaitMonitor(warmup_steps=0)
    quiet_trainer(tmp_path, [monitor], max_epochs=3).fit(MLP(), loader)

    report = monitor.report
    assert report.settings.epochs == 3
    assert len(report.settings.worker_startup_s) == 3
    assert all(seconds > 0.008 for seconds in report.settings.worker_startup_s)  # >= one batch of 8 x 1 ms
    assert report.totals.steps == 3 * (8 - 1)
    assert report.settings.num_workers == 1 and report.settings.persistent_workers is False


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"nvml_interval_s": 0}, "nvml_interval_s"),
        ({"data_wait_high": 1.5}, "data_wait_high"),
        ({"data_wait_low": 0.3, "data_wait_high": 0.2}, "data_wait_low"),
        ({"gpu_idle_high": 0}, "gpu_idle_high"),
        ({"host_overhead_high": "0.2"}, "host_overhead_high"),
        ({"straggler_slowdown": -0.1}, "straggler_slowdown"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name) as error:
        DataWaitMonitor(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(error.value)


def test_report_is_none_until_a_fit_ends_and_validate_alone_is_ignored(tmp_path):
    monitor = DataWaitMonitor()
    assert monitor.report is None
    trainer = quiet_trainer(tmp_path, [monitor])
    trainer.validate(MLP(), DataLoader(preloaded_dataset(64, 32), batch_size=16))
    assert monitor.report is None


def test_rank_totals_survive_the_all_gather():
    from types import SimpleNamespace

    import torch

    from lightning_gpuopt.callbacks.data_wait_monitor import gather_totals
    from lightning_gpuopt.core.timing import StepTotals

    own = StepTotals(steps=10, samples=80, wall_s=1.0, data_wait_s=0.4, compute_s=0.5, forward_s=0.1, gpu_idle_s=0.2)
    one_rank = SimpleNamespace(strategy=SimpleNamespace(all_gather=lambda tensor: tensor))
    assert gather_totals(one_rank, own, torch.device("cpu")) == [own]  # gpu_util_mean None survives as NaN
    two_ranks = SimpleNamespace(strategy=SimpleNamespace(all_gather=lambda tensor: torch.stack([tensor, tensor])))
    with_util = StepTotals(steps=3, gpu_util_mean=55.0)
    assert gather_totals(two_ranks, with_util, torch.device("cpu")) == [with_util, with_util]
