"""DataLoaderTuner with a real Trainer on CPU and real (slow) datasets."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from helpers import (
    MLP,
    BatchRecorder,
    CpuHeavyDataset,
    SlowDataset,
    StreamDataset,
    quiet_trainer,
    usable_cores_from_the_os,
)
from lightning import LightningDataModule, seed_everything
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import DataLoaderTuner, DataWaitMonitor, LoaderTuneResult
from lightning_gpuopt.core.loader import (
    LoaderSetting,
    LoaderTiming,
    _child_pids,
    _choose,
    _settled,
    time_loader,
    tune_loader,
)
from lightning_gpuopt.core.report import from_dict


def test_io_latency_dataset_gets_workers_and_training_throughput_rises(tmp_path):
    dataset = SlowDataset(2560, delay_s=0.0005)
    plain = DataWaitMonitor(warmup_steps=3)
    quiet_trainer(tmp_path, [plain], max_steps=60).fit(MLP(), DataLoader(dataset, batch_size=32))

    tuner, tuned, recorder = DataLoaderTuner(max_seconds=5), DataWaitMonitor(warmup_steps=3), BatchRecorder()
    quiet_trainer(tmp_path, [tuner, tuned, recorder], max_steps=60).fit(MLP(), DataLoader(dataset, batch_size=32))

    result = tuner.result
    assert result.num_workers > 0
    assert result.baseline.setting == LoaderSetting(0, None, False, False)
    # what the fit used is what the tuner chose
    assert recorder.loader_settings == (result.num_workers, result.prefetch_factor, result.persistent_workers, False)
    # 2-9x on an idle 2-core machine, 1.8x beside two helpers' benchmarks (load 6): the speed-up itself is
    # benchmarks/tuner_end_to_end.py's; here, that training got faster by more than noise
    assert tuned.report.totals.samples_per_second >= 1.3 * plain.report.totals.samples_per_second
    # sleeping workers use little CPU, so more of them than the 2 cores were worth timing
    assert all(t.worker_cpu_fraction < 0.5 for t in result.candidates if t.worker_cpu_fraction is not None)
    assert "num_workers=0" in tuner.message and f"num_workers={result.num_workers}" in tuner.message


def test_cpu_heavy_dataset_gets_no_more_workers_than_cores(tmp_path):
    tuner = DataLoaderTuner(max_seconds=6)
    quiet_trainer(tmp_path, [tuner], max_steps=3).fit(MLP(features=2), DataLoader(CpuHeavyDataset(4000), batch_size=8))

    result = tuner.result
    assert result.usable_cpus == usable_cores_from_the_os()
    assert result.num_workers <= result.usable_cpus
    alone = [t for t in result.candidates if t.loading_cpu_fraction is not None]
    assert alone and max(t.loading_cpu_fraction for t in alone) >= 0.5  # the loading was measured computing
    # independently: a sample costs mostly CPU. CPU time does not depend on other work on the
    # machine; of the wall times, the shortest of 20 calls is the least disturbed
    dataset, cpu_s, wall_s = CpuHeavyDataset(20), [], []
    for index in range(20):
        wall_started, cpu_started = time.perf_counter(), time.thread_time()
        dataset[index]
        cpu_s.append(time.thread_time() - cpu_started)
        wall_s.append(time.perf_counter() - wall_started)
    assert statistics.median(cpu_s) >= 0.5 * min(wall_s)


def test_tuning_consumes_no_randomness_training_equals_the_setting_set_by_hand(tmp_path):
    class DataModule(LightningDataModule):
        def __init__(self, **loader_kwargs):
            super().__init__()
            self.loader_kwargs = loader_kwargs

        def train_dataloader(self):
            # 1 ms a sample: workers clearly help even on a busy machine (at 0.2 ms the tuner could
            # measure no gain and rightly keep 0 workers, which this test is not about)
            return DataLoader(SlowDataset(640, delay_s=0.001), batch_size=16, shuffle=True, **self.loader_kwargs)

    def batches_seen(callbacks, datamodule):
        seed_everything(7)
        recorder = BatchRecorder()
        quiet_trainer(tmp_path, [*callbacks, recorder], max_epochs=2).fit(MLP(), datamodule=datamodule)
        return recorder

    tuner = DataLoaderTuner(max_seconds=3)
    tuned = batches_seen([tuner], DataModule())
    by_hand = batches_seen([], DataModule(**tuner.result.setting.loader_kwargs()))
    assert tuner.result.num_workers > 0 and tuned.loader_settings == by_hand.loader_settings
    assert len(tuned.first_values) == 2 * 640 and tuned.first_values == by_hand.first_values
    # ... and each epoch still sees every sample once, as without any worker
    plain = batches_seen([], DataModule())
    for epoch in (slice(0, 640), slice(640, 1280)):
        assert sorted(tuned.first_values[epoch]) == sorted(plain.first_values[epoch])


def test_iterable_dataset_is_left_alone_with_a_clear_message(tmp_path):
    tuner, recorder = DataLoaderTuner(), BatchRecorder()
    with pytest.warns(UserWarning, match="IterableDataset"):
        quiet_trainer(tmp_path, [tuner, recorder], max_steps=5).fit(MLP(), DataLoader(StreamDataset(200), batch_size=8))
    assert tuner.result is None
    assert "get_worker_info()" in tuner.message
    assert recorder.loader_settings[0] == 0


def test_an_iterable_that_is_not_a_dataloader_is_left_alone(tmp_path):
    class Batches:
        def __init__(self):
            generator = torch.Generator().manual_seed(0)
            self.items = [
                (torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
                for _ in range(10)
            ]

        def __iter__(self):
            return iter(self.items)

        def __len__(self):
            return len(self.items)

    tuner = DataLoaderTuner()
    with pytest.warns(UserWarning, match="not a torch.utils.data.DataLoader"):
        trainer = quiet_trainer(tmp_path, [tuner], max_steps=5)
        trainer.fit(MLP(), Batches())
    assert tuner.result is None and trainer.global_step == 5


def test_json_report_round_trips_and_lightning_source_is_restored(tmp_path):
    tuner = DataLoaderTuner(max_seconds=2)
    trainer = quiet_trainer(tmp_path, [tuner], max_steps=3)
    trainer.fit(MLP(), DataLoader(SlowDataset(320, delay_s=0.0002), batch_size=8))
    section = json.loads((tmp_path / "gpuopt_report.json").read_text())["dataloader"]
    assert section["message"] == tuner.message
    assert from_dict(LoaderTuneResult, section) == tuner.result
    assert type(trainer.fit_loop._data_source).__name__ == "_DataLoaderSource"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_seconds": 0}, "max_seconds"),
        ({"batches_per_candidate": 1}, "batches_per_candidate"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"target_samples_per_second": -5}, "target_samples_per_second"),
        ({"max_num_workers": -1}, "max_num_workers"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DataLoaderTuner(**kwargs)


def test_a_short_epoch_does_not_inflate_deep_prefetch():
    # 8 workers sleeping 0.5 ms per sample can deliver at most 8 x 32 / 16 ms = 16,000 samples/s;
    # an epoch of 32 batches is entirely queued at iter() with prefetch_factor=4
    setting = LoaderSetting(8, 4, True)
    loader = DataLoader(SlowDataset(32 * 32, delay_s=0.0005), batch_size=32, **setting.loader_kwargs())
    timing = time_loader(loader, setting, 16)
    assert timing.batches == 32
    assert timing.samples_per_second <= 16_000


def test_a_cgroup_cpu_quota_of_one_core_caps_the_workers_tried(tmp_path, monkeypatch):
    """``docker run --cpus=1`` on a many-core host: 1 usable core, not the affinity's count."""
    from lightning_gpuopt.core import loader

    monkeypatch.setattr(loader, "cgroup_cpu_quota", lambda: 1.0)  # the OS boundary: what cpu.max would say
    tuner = DataLoaderTuner(max_seconds=4)
    quiet_trainer(tmp_path, [tuner], max_steps=2).fit(MLP(features=2), DataLoader(CpuHeavyDataset(400), batch_size=8))

    result = tuner.result
    assert result.usable_cpus == 1
    tried = {t.setting.num_workers for t in result.candidates}
    assert tried and max(tried) <= 1, tried  # CPU-bound loading: nothing past the one core
    assert result.num_workers <= 1


def _slow_start(worker_id: int) -> None:
    time.sleep(1.0)  # workers that take a second to start (imports, opening files, a busy machine)


def test_workers_that_start_slowly_are_judged_on_their_loading_not_their_start(tmp_path):
    """A candidate is stopped early only when it loads slower than the best so far, counted from its
    first batch: a slow start is paid once (persistent workers). Before, the 2-worker candidate was
    stopped at its first batch, 1 s after it began, and the tuner kept 0 workers at half the rate."""

    def build(setting: LoaderSetting) -> DataLoader:
        kwargs = setting.loader_kwargs()
        if setting.num_workers:
            kwargs["worker_init_fn"] = _slow_start
        return DataLoader(SlowDataset(4000, delay_s=0.002), batch_size=16, **kwargs)

    result = tune_loader(build, usable_cpus=2, max_seconds=20, max_workers=2)
    assert result.num_workers == 2, result.reason
    two = next(t for t in result.candidates if t.setting == result.setting)
    assert two.startup_s >= 1.0 and not two.stopped_early

    # independently: the chosen loader, past its start-up, against no workers (sleeps, so other work
    # on the machine barely matters; the faster of two timings each)
    def rate(setting: LoaderSetting) -> float:
        return max(time_loader(build(setting), setting, 40).samples_per_second for _ in range(2))

    assert rate(result.setting) > 1.3 * rate(LoaderSetting(0, None))


def test_a_choice_timed_once_says_it_is_unconfirmed():
    def build(setting: LoaderSetting) -> DataLoader:
        return DataLoader(SlowDataset(64, delay_s=0.001), batch_size=16, **setting.loader_kwargs())

    result = tune_loader(build, usable_cpus=2, max_seconds=0.01)
    assert result.candidates and not result.settled
    assert "unconfirmed: `max_seconds` ran out" in result.reason


class PidDataset(Dataset):
    """Each sample is the id of the process that loaded it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


def test_the_loaders_worker_process_is_seen_as_a_child():
    """The workers whose run-queue waits time_loader reads are this process's children."""
    before = _child_pids()
    assert before is not None
    iterator = iter(DataLoader(PidDataset(), batch_size=8, num_workers=1))
    # independently: the worker's own os.getpid(), carried back in the batch
    loaded_by = {int(pid) for pid in next(iterator)}
    assert loaded_by != {os.getpid()} and len(loaded_by) == 1
    assert _child_pids() - before == loaded_by
    del iterator  # shuts its worker down and joins it
    assert not (_child_pids() - before) & loaded_by


def test_each_timed_batch_runs_the_training_step_so_settings_are_judged_end_to_end(tmp_path):
    """A 10 ms step bounds what any setting can reach (16 samples a batch: 1,600 samples/s), where the
    loader alone delivers far more: the candidates were timed with the step competing for the cores."""
    dataset = SlowDataset(640)
    tuner = DataLoaderTuner(max_seconds=1.0, verbose=False)
    trainer = quiet_trainer(tmp_path, [tuner], max_steps=2)
    trainer.fit(MLP(step_sleep_s=0.01), DataLoader(dataset, batch_size=16))
    assert all(t.samples_per_second <= 1600 for t in tuner.result.candidates)
    alone = time_loader(DataLoader(dataset, batch_size=16), LoaderSetting(0), 16)
    assert alone.samples_per_second > 3 * 1600
    assert trainer.global_step == 2  # the step's backward passes left no gradient behind: training ran as set


def test_the_main_threads_loading_share_leaves_the_training_step_out():
    """Sleeping samples (waiting on I/O) with a step that computes: the loading is still seen waiting."""

    def burn(batch) -> None:
        started = time.thread_time()
        while time.thread_time() - started < 0.01:
            pass

    loader = DataLoader(SlowDataset(64, delay_s=0.002), batch_size=4)
    timing = time_loader(loader, LoaderSetting(0), 8, consume=burn)
    assert timing.loading_cpu_fraction < 0.5
    assert timing.samples_per_second <= 4 / 0.018  # 8 ms of sleeps and 10 ms of step a batch


def timing(workers: int, rate: float) -> LoaderTiming:
    return LoaderTiming(LoaderSetting(workers, 2 if workers else None), 8, 64, 0.1, 1.0, rate, None)


def test_the_choice_keeps_the_users_setting_unless_it_is_clearly_faster():
    yours = LoaderSetting(2, 2)
    chosen, reason = _choose([timing(0, 1000.0), timing(2, 1050.0)], 0.05, None, yours)
    assert chosen.setting == yours and reason.startswith("yours kept, the choice being 0.95x it (under 1.1x)")
    chosen, _ = _choose([timing(0, 1000.0), timing(2, 1050.0)], 0.05, None, LoaderSetting(0))
    assert chosen.setting == LoaderSetting(0)  # the user's is the cheapest within tolerance anyway
    chosen, _ = _choose([timing(0, 1200.0), timing(2, 1000.0)], 0.05, None, yours)
    assert chosen.setting == LoaderSetting(0)  # 1.2x: clearly faster


def test_a_choice_not_confirmed_by_a_second_timing_keeps_the_users_setting():
    yours = LoaderSetting(0)
    chosen, reason, settled = _settled(
        [timing(0, 1000.0), timing(2, 1300.0)], time_loader, lambda timed: _choose(timed, 0.05, None, yours), 0.0, yours
    )
    assert chosen.setting == yours and not settled
    assert reason.startswith("yours kept: the cheapest setting within 5%") and "unconfirmed" in reason
    # without the user's setting among the timings, the choice stands (and says it is unconfirmed)
    chosen, reason, settled = _settled(
        [timing(2, 1300.0)], time_loader, lambda timed: _choose(timed, 0.05, None), 0.0, yours
    )
    assert chosen.setting.num_workers == 2 and not settled and "unconfirmed" in reason
    # a choice at 1.5x the user's or more stands even when unconfirmed
    chosen, _, _ = _settled(
        [timing(0, 1000.0), timing(2, 1600.0)], time_loader, lambda t: _choose(t, 0.05, None), 0.0, yours
    )
    assert chosen.setting.num_workers == 2
