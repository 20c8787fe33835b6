"""DataWaitMonitor's ``"slow-hook"``, ``"checkpoint-time"`` and ``"slow-disk"`` findings: on a real
Trainer with the pattern (found, with its numbers) and without it (no finding), the decisions on
numbers, and the profiler tap's catch-all listener.

Every share is large by construction (a hook sleeping 50 ms on a ~1 ms step, a 32 MB checkpoint
on a ~1 ms step, against a 10% threshold), so a loaded machine does not change the outcome."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from helpers import MLP, SlowHook, preloaded_dataset, quiet_trainer
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.profilers import SimpleProfiler
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from lightning_gpuopt import DataWaitMonitor
from lightning_gpuopt.callbacks import _detect_hooks, _profiler_tap
from lightning_gpuopt.callbacks._detect_hooks import DiskRead, dataset_files, filesystem_type, read_sample
from lightning_gpuopt.core.findings import (
    CHECKPOINT_SHARE,
    CheckpointSaver,
    checkpoint_time,
    nice_ceil,
    slow_disk,
    slow_hook,
)
from lightning_gpuopt.core.report import data_wait_table, format_fraction


def make_trainer(tmp_path, callbacks, **kwargs) -> Trainer:
    return quiet_trainer(tmp_path, callbacks, **{"max_steps": 12, **kwargs})


def fit(tmp_path, model, loader, callbacks=(), val_loader=None, **kwargs) -> tuple[DataWaitMonitor, Trainer]:
    monitor = DataWaitMonitor(warmup_steps=2, verbose=False)
    trainer = make_trainer(tmp_path, [monitor, *callbacks], **kwargs)
    trainer.fit(model, loader, val_loader)
    return monitor, trainer


def of_kind(monitor: DataWaitMonitor, kind: str):
    return [finding for finding in monitor.report.findings if finding.kind == kind]


def loader(count: int = 256) -> DataLoader:
    return DataLoader(preloaded_dataset(count, 32), batch_size=16)


# ----------------------------------------------------------------------------- the profiler tap


def test_the_catch_all_listener_sees_every_action_and_the_users_profiler_sees_what_it_saw(tmp_path):
    seen: dict[str, list[float]] = {}

    class Tap(Callback):
        def setup(self, trainer, pl_module, stage):
            def any_action(name, wall):
                seen.setdefault(name, []).append(wall)

            self.tap = _profiler_tap.install(trainer, {"save_checkpoint": lambda wall, cpu: None}, any_action)

        def teardown(self, trainer, pl_module, stage):
            _profiler_tap.uninstall(trainer, self.tap)

    profiler = SimpleProfiler()
    trainer = make_trainer(
        tmp_path,
        [Tap(), SlowHook(0.02), ModelCheckpoint(every_n_train_steps=4)],
        max_steps=8,
        profiler=profiler,
        enable_checkpointing=True,
    )
    trainer.fit(MLP(), loader())
    assert trainer.profiler is profiler
    hook = "[Callback]SlowHook.on_train_batch_end"
    assert len(seen[hook]) == 8 and min(seen[hook]) >= 0.02
    assert len(seen["save_checkpoint"]) == 2  # an exact-name listener's action reaches the catch-all too
    assert len(seen["[_TrainingEpochLoop].train_dataloader_next"]) == len(
        profiler.recorded_durations["[_TrainingEpochLoop].train_dataloader_next"]
    )
    # every action the tap saw, the user's profiler recorded, as often
    for name, walls in seen.items():
        assert len(profiler.recorded_durations[name]) == len(walls), name


def test_uninstall_silences_the_catch_all():
    calls = []

    class Inner:
        def profile(self, name):
            import contextlib

            return contextlib.nullcontext()

        def start(self, name):
            pass

        def stop(self, name):
            pass

    class Holder:
        profiler = Inner()

    holder = Holder()
    tap = _profiler_tap.install(holder, {}, any_action=lambda name, wall: calls.append(name))
    with holder.profiler.profile("[Callback]A.on_train_batch_end"):
        pass
    holder.profiler.start("x")
    holder.profiler.stop("x")
    assert calls == ["[Callback]A.on_train_batch_end", "x"]
    _profiler_tap.uninstall(holder, tap)
    assert isinstance(holder.profiler, Inner) and tap.any_action is None


def test_two_taps_one_over_the_other_both_see_every_action_its_start_and_its_end(tmp_path):
    events: list[tuple[str, str]] = []
    configure = "[LightningModule]MLP.configure_optimizers"

    class Tap(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def setup(self, trainer, pl_module, stage):
            self.tap = _profiler_tap.install(
                trainer,
                {configure: lambda wall, cpu: events.append((self.name, "end"))},
                on_start={configure: lambda: events.append((self.name, "start"))},
            )

        def teardown(self, trainer, pl_module, stage):
            _profiler_tap.uninstall(trainer, self.tap)

    profiler = SimpleProfiler()
    trainer = make_trainer(tmp_path, [Tap("first"), Tap("second")], max_steps=2, profiler=profiler)
    trainer.fit(MLP(), loader())
    # the second tap wraps the first and times the action inside the first's own timing; each tap tells its
    # listeners after the profiler it wraps stopped (their work is outside its timing): the outer tap last
    assert events == [("first", "start"), ("second", "start"), ("first", "end"), ("second", "end")]
    assert len(profiler.recorded_durations[configure]) == 1 and trainer.profiler is profiler


# ----------------------------------------------------------------------------- slow-hook


class SlowBackwardHook(MLP):
    def on_after_backward(self) -> None:
        time.sleep(0.05)


class SlowEpochEnd(Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        time.sleep(0.4)


class SlowInValidation(Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        time.sleep(0.05)


def test_a_slow_callback_hook_is_found_with_its_numbers_and_the_interval(tmp_path):
    monitor, _ = fit(tmp_path, MLP(), loader(), callbacks=[SlowHook(0.05)], max_steps=12)
    (finding,) = of_kind(monitor, "slow-hook")
    assert finding.where == "SlowHook.on_train_batch_end"
    assert finding.figures["calls"] == 12
    assert finding.figures["seconds"] >= 12 * 0.05 and finding.figures["ms_per_call"] >= 50
    assert 0.2 <= finding.figures["share"] <= 1.0
    every = int(finding.figures["suggested_every_n"])
    assert every >= 10 and f"`if trainer.global_step % {every} == 0:`" in finding.fix
    assert "SlowHook.on_train_batch_end took" in finding.message and "12 call(s)" in finding.message


def test_a_slow_module_hook_is_found_and_the_fix_uses_self(tmp_path):
    monitor, _ = fit(tmp_path, SlowBackwardHook(), loader(), max_steps=10)
    (finding,) = of_kind(monitor, "slow-hook")
    assert finding.where == "SlowBackwardHook.on_after_backward"
    assert finding.figures["calls"] == 10
    assert "`if self.global_step %" in finding.fix


class SlowStepHook(MLP):
    def on_before_optimizer_step(self, optimizer) -> None:
        time.sleep(0.004)


def test_hooks_inside_steps_are_timed_in_a_sample_of_steps_and_scaled_to_every_step(tmp_path):
    steps = 2 * _detect_hooks.HOOK_SAMPLE_EVERY
    monitor, _ = fit(tmp_path, SlowStepHook(), loader(steps * 16), max_steps=steps)
    probe = next(p for p in monitor._probes if isinstance(p, _detect_hooks.HookTimes))
    assert _detect_hooks.HOOK_SAMPLED_FIRST <= probe.sampled_steps < steps // 2  # the rest were not timed
    (finding,) = of_kind(monitor, "slow-hook")
    assert finding.where == "SlowStepHook.on_before_optimizer_step"
    assert finding.figures["calls"] == steps  # exact: called once every step
    assert finding.figures["ms_per_call"] >= 4 and finding.figures["seconds"] >= steps * 0.004
    assert f"; timed in {probe.sampled_steps} of {steps} steps and scaled" in finding.message  # the sampling, stated


class SlowBatchAndEpochEnd(SlowHook):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        time.sleep(0.03)


@pytest.mark.parametrize("slow_first", [False, True], ids=["monitor-first", "slow-callback-first"])
def test_per_step_hooks_between_steps_are_reported_only_in_sampled_steps_and_still_counted_exactly(
    tmp_path, slow_first
):
    steps, monitor = 2 * 24, DataWaitMonitor(warmup_steps=2, verbose=False)
    reported: list[tuple[str, bool]] = []
    monitor._on_action = lambda action, seconds: (  # type: ignore[method-assign]  # a spy: it forwards every call
        reported.append((action, monitor._action_probes[0].in_sample)),
        DataWaitMonitor._on_action(monitor, action, seconds),
    )
    slow = SlowBatchAndEpochEnd(0.003)  # its epoch-end hook runs after steps the tap left, first or after the monitor
    trainer = make_trainer(tmp_path, [slow, monitor] if slow_first else [monitor, slow], max_steps=steps)
    trainer.fit(MLP(), loader(24 * 16))
    probe = monitor._action_probes[0]
    assert _detect_hooks.HOOK_SAMPLED_FIRST <= probe.sampled_steps < steps // 2
    batch_end = [
        in_sample for action, in_sample in reported if action.endswith("SlowBatchAndEpochEnd.on_train_batch_end")
    ]
    assert len(batch_end) == probe.sampled_steps and all(batch_end)  # not reported in the other steps
    found = {finding.where: finding.figures for finding in of_kind(monitor, "slow-hook")}
    assert found["SlowBatchAndEpochEnd.on_train_batch_end"]["calls"] == steps  # scaled, exact in calls
    assert found["SlowBatchAndEpochEnd.on_train_epoch_end"]["calls"] == 2  # an epoch hook: every call, not scaled
    messages = {finding.where: finding.message for finding in of_kind(monitor, "slow-hook")}
    assert "scaled" in messages["SlowBatchAndEpochEnd.on_train_batch_end"]
    assert "scaled" not in messages["SlowBatchAndEpochEnd.on_train_epoch_end"]


def test_a_slow_epoch_hook_is_fixed_with_an_epoch_interval(tmp_path):
    monitor, _ = fit(
        tmp_path,
        MLP(),
        DataLoader(preloaded_dataset(64, 32), batch_size=16),
        callbacks=[SlowEpochEnd()],
        max_steps=-1,
        max_epochs=3,
    )
    (finding,) = of_kind(monitor, "slow-hook")
    assert finding.where == "SlowEpochEnd.on_train_epoch_end" and finding.figures["calls"] == 3
    assert "`if trainer.current_epoch %" in finding.fix and "every" in finding.fix


def test_fast_hooks_lightnings_own_callbacks_and_compute_are_no_finding(tmp_path):
    # the step itself is slow (training_step sleeps); the progress bar and model summary run; a hook is fast
    monitor, _ = fit(
        tmp_path,
        MLP(step_sleep_s=0.05),
        loader(640),
        callbacks=[SlowHook(0.0)],
        max_steps=30,
        enable_progress_bar=True,
        enable_model_summary=True,
        enable_checkpointing=True,
    )
    assert of_kind(monitor, "slow-hook") == []


def test_a_hook_slow_only_inside_validation_is_no_finding(tmp_path):
    val = DataLoader(preloaded_dataset(64, 32), batch_size=16)
    # training steps of 30 ms: a hiccup of a trivial hook on a loaded machine stays far under 10% of training
    monitor, _ = fit(
        tmp_path,
        MLP(step_sleep_s=0.03),
        loader(),
        callbacks=[SlowInValidation()],
        val_loader=val,
        max_steps=12,
        val_check_interval=4,
    )
    assert monitor.report.totals.validation_s >= 2 * 4 * 0.05  # the hook did run, inside validation
    assert of_kind(monitor, "slow-hook") == []


def test_slow_hook_decision_on_numbers():
    assert slow_hook("A.on_train_batch_end", total_s=0.9, calls=100, train_s=10.0) is None  # 9%
    found = slow_hook("A.on_train_batch_end", total_s=1.0, calls=100, train_s=10.0)  # 10%
    assert found.figures["share"] == pytest.approx(0.1) and found.figures["ms_per_call"] == pytest.approx(10.0)
    # 1 s of 10 s -> 0.98 / (0.02 * 9) = 5.4x fewer calls -> every 10 steps
    assert found.figures["suggested_every_n"] == 10 and "move the work to on_train_epoch_end" in found.fix
    assert slow_hook("A.on_train_batch_end", 1.0, 100, 10.0, threshold=0.2) is None
    epoch = slow_hook("A.on_train_epoch_end", total_s=4.0, calls=2, train_s=10.0, epochs=2)
    assert "current_epoch % " in epoch.fix and "move the work" not in epoch.fix
    everything = slow_hook("A.on_train_batch_end", total_s=10.0, calls=20, train_s=10.0)
    assert everything.figures["suggested_every_n"] == 20
    assert nice_ceil(5.4) == 10 and nice_ceil(1) == 1 and nice_ceil(120) == 200


# ----------------------------------------------------------------------------- checkpoint-time


class BigCheckpoint(MLP):
    """A small, fast model whose checkpoint is large: a 32 MB buffer it never computes with."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("table", torch.zeros(8 * 2**20))


def test_saving_every_step_a_large_checkpoint_is_found_with_the_setting_to_change(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)
    monitor, _ = fit(
        tmp_path, BigCheckpoint(), loader(), callbacks=[checkpoint], max_steps=10, enable_checkpointing=True
    )
    (finding,) = of_kind(monitor, "checkpoint-time")
    assert finding.figures["saves"] == 10
    assert finding.figures["share"] >= 0.2
    assert finding.figures["checkpoint_mb"] >= 32
    assert finding.where == "ModelCheckpoint(every_n_train_steps=1)"
    new = int(finding.figures["suggested_interval"])
    assert new >= 5 and f"ModelCheckpoint(every_n_train_steps=1 → {new})" in finding.fix
    assert "save_weights_only" not in finding.fix  # SGD: no optimizer state
    # the saves are not also a slow hook of ModelCheckpoint
    assert of_kind(monitor, "slow-hook") == []
    # the monitor's own figure agrees on what saving cost
    assert monitor.report.totals.checkpoint_s == pytest.approx(finding.figures["seconds"], rel=0.05)


def test_the_table_and_the_finding_show_one_share_of_one_denominator(tmp_path):
    """Saves at each validation's end: before, the table left them in validation and divided by the
    measured steps, the finding counted them and divided by the fit (two figures, one finding missing)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1)
    monitor, _ = fit(
        tmp_path,
        BigCheckpoint(),
        loader(64),
        callbacks=[checkpoint],
        val_loader=loader(16),
        max_steps=-1,
        max_epochs=3,
        enable_checkpointing=True,
    )
    totals = monitor.report.totals
    share = totals.training_share(totals.checkpoint_s)
    assert share >= CHECKPOINT_SHARE
    (finding,) = of_kind(monitor, "checkpoint-time")
    assert finding.figures["saves"] == 3 and finding.figures["share"] == pytest.approx(share, rel=1e-6)
    shown = format_fraction(share)
    assert f"({shown} of training time)" in data_wait_table(monitor.report) and shown in finding.message


def test_saving_once_an_epoch_over_many_steps_is_no_finding(tmp_path):
    monitor, _ = fit(
        tmp_path,
        MLP(step_sleep_s=0.01),
        DataLoader(preloaded_dataset(1600, 32), batch_size=16),
        max_steps=-1,
        max_epochs=1,
        enable_checkpointing=True,
    )
    assert monitor.report.totals.checkpoint_s > 0  # the default ModelCheckpoint saved once
    assert of_kind(monitor, "checkpoint-time") == []


class SavesEveryStep(Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.save_checkpoint(self.path)


def test_a_hook_calling_save_checkpoint_is_named_and_not_a_slow_hook(tmp_path):
    monitor, _ = fit(tmp_path, BigCheckpoint(), loader(), callbacks=[SavesEveryStep(tmp_path / "x.ckpt")], max_steps=8)
    (finding,) = of_kind(monitor, "checkpoint-time")
    assert finding.where == "SavesEveryStep.on_train_batch_end" and finding.figures["saves"] == 8
    assert "in SavesEveryStep.on_train_batch_end, save every" in finding.fix
    assert of_kind(monitor, "slow-hook") == []  # its time is the saves'


def test_checkpoint_time_decision_on_numbers():
    steps = CheckpointSaver("ModelCheckpoint(every_n_train_steps=10)", saves=10, seconds=0.5, every_n_train_steps=10)
    assert checkpoint_time([steps], fit_s=10.0, steps=100) is None  # 5%
    steps.seconds = 2.0  # 20%: 2 * 0.98 / (0.02 * 8) = 12.25x -> every 10 * 12.25 -> 200 steps
    found = checkpoint_time([steps], fit_s=10.0, steps=100)
    assert "ModelCheckpoint(every_n_train_steps=10 → 200)" in found.fix and found.figures["suggested_interval"] == 200
    epochs = CheckpointSaver("ModelCheckpoint(every_n_epochs=1)", 4, 3.0, every_n_epochs=1, save_last=True)
    fix = checkpoint_time([epochs], fit_s=10.0, steps=400, optimizer_bytes=200, parameter_bytes=100).fix
    assert "every_n_epochs=1 → " in fix and 'save_last=True → "link"' in fix and "save_weights_only=True" in fix
    assert "cannot resume the optimizer" in fix
    timed = CheckpointSaver(
        "ModelCheckpoint(train_time_interval=0:00:01)",
        10,
        5.0,
        train_time_interval_s=timedelta(seconds=1).total_seconds(),
    )
    fix = checkpoint_time([timed], fit_s=10.0, steps=100).fix
    assert "train_time_interval=timedelta(seconds=1) → timedelta(seconds=50)" in fix
    # two savers under the threshold each, over it together
    a = CheckpointSaver("ModelCheckpoint(every_n_train_steps=5)", 20, 0.6, every_n_train_steps=5)
    b = CheckpointSaver("MyCallback.on_train_batch_end", 20, 0.6, model_checkpoint=False)
    both = checkpoint_time([a, b], fit_s=10.0, steps=100)
    assert both.figures["saves"] == 40 and "in MyCallback.on_train_batch_end, save every" in both.fix


# ----------------------------------------------------------------------------- slow-disk


class FileDataset(Dataset):
    """One file a sample, read whole in ``__getitem__`` (an image-folder stand-in)."""

    def __init__(self, root, count: int = 64, size: int = 64 * 1024) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = str(root)
        self.samples = []
        for index in range(count):
            path = os.path.join(self.root, f"{index:04d}.bin")
            with open(path, "wb") as handle:
                handle.write(os.urandom(size))
            self.samples.append((path, index % 10))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as handle:
            data = handle.read()
        return torch.frombuffer(bytearray(data[:128]), dtype=torch.float32), torch.tensor(label)


def test_files_read_slowly_by_a_slow_model_are_no_finding_and_the_read_rate_is_reported(tmp_path):
    dataset = FileDataset(tmp_path / "data", count=64, size=64 * 1024)
    monitor, trainer = fit(tmp_path, MLP(step_sleep_s=0.03), DataLoader(dataset, batch_size=4), max_steps=12)
    assert of_kind(monitor, "slow-disk") == []
    read = trainer.callback_metrics["gpuopt/dataset_read_mb_s"].item()
    needed = trainer.callback_metrics["gpuopt/dataset_needed_mb_s"].item()
    assert read > 0 and needed > 0
    # 64 KiB a sample at the samples per second the monitor measured
    assert needed == pytest.approx(64 * 1024 * monitor.report.totals.samples_per_second / 1e6, rel=1e-6)


def test_a_slow_read_of_an_input_bound_run_is_found(tmp_path, monkeypatch):
    """The whole path on a real run, the disk replaced by a 0.1 MB/s read (a slow disk cannot be had
    reliably on a test machine): the files are found, read, and the finding names their directory."""
    dataset = FileDataset(tmp_path / "data", count=64, size=64 * 1024)
    monkeypatch.setattr(_detect_hooks, "read_sample", lambda paths: DiskRead(len(paths), 100_000, 1.0))
    monitor, _ = fit(tmp_path, MLP(step_sleep_s=0.03), DataLoader(dataset, batch_size=4), max_steps=12)
    assert of_kind(monitor, "slow-disk") == []  # the same slow read, but the run is not input-bound
    monitor, _ = fit(
        tmp_path,
        MLP(),
        DataLoader(Subset(ConcatDataset([SlowDatasetFiles(dataset)]), range(64)), batch_size=4),
        max_steps=12,
    )
    (finding,) = of_kind(monitor, "slow-disk")
    assert finding.where == str(tmp_path / "data")
    assert finding.figures["read_mb_s"] == pytest.approx(0.1)
    assert finding.figures["data_wait_fraction"] >= 0.2
    assert f"cp -r {tmp_path / 'data'} /dev/shm/" in finding.fix
    assert "65.5 kB a sample x" in finding.message


class SlowDatasetFiles(Dataset):
    """``FileDataset``'s files, each read 10 ms slowly (the loader is the bottleneck)."""

    def __init__(self, files: FileDataset) -> None:
        self.samples = files.samples
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        time.sleep(0.01)
        return self.files[index]


def test_dataset_files_follow_wrappers_lists_and_root_directories(tmp_path):
    files = FileDataset(tmp_path / "a", count=8, size=1000)
    found = dataset_files(Subset(ConcatDataset([files]), [0, 1]))
    assert sorted(found.sample) == sorted(path for path, _ in files.samples)
    assert found.bytes_per_sample == pytest.approx(1000) and found.directory == str(tmp_path / "a")

    class RootOnly(Dataset):  # a directory and nothing else
        def __init__(self, root):
            self.root = root

        def __len__(self):
            return 4  # 8 files of 1000 bytes for 4 samples

    assert dataset_files(RootOnly(str(tmp_path / "a"))).bytes_per_sample == pytest.approx(2000)
    assert dataset_files(preloaded_dataset(8, 4)) is None  # tensors in memory: no files

    measured = read_sample(found.sample)
    assert measured.files == 8 and measured.bytes == 8000 and measured.read_mb_s > 0
    assert filesystem_type(str(tmp_path)) is not None


def test_slow_disk_decision_on_numbers():
    found = slow_disk(80.0, 100.0, 0.6, 0.2, "/data/imagenet", files_read=32, mb_read=64.0, filesystem="nfs")
    assert found.figures == {"read_mb_s": 80.0, "needed_mb_s": 100.0, "data_wait_fraction": 0.6, "files_read": 32.0}
    assert "80.0 MB/s" in found.message and "100.0 MB/s" in found.message and "(nfs)" in found.message
    assert "cp -r /data/imagenet /dev/shm/" in found.fix
    assert slow_disk(140.0, 100.0, 0.6, 0.2, "/d", 32, 64.0) is not None  # under 1.5x: no headroom
    assert slow_disk(160.0, 100.0, 0.6, 0.2, "/d", 32, 64.0) is None  # 1.6x the need
    assert slow_disk(80.0, 100.0, 0.1, 0.2, "/d", 32, 64.0) is None  # not input-bound
    in_memory = slow_disk(80.0, 100.0, 0.6, 0.2, "/dev/shm/d", 32, 64.0, filesystem="tmpfs")
    assert "tmpfs: already in memory" in in_memory.message and "num_workers" in in_memory.fix
