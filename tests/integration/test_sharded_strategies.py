"""Our callbacks under a sharded strategy, on a real CPU Trainer: Lightning runs ``ModelParallelStrategy`` on
CPU (gloo, one process here) with FSDP2's ``fully_shard`` applied in ``configure_model``. DataWaitMonitor and
DataLoaderTuner run and report; the memory callbacks refuse at setup, before changing anything, naming the
strategy and what to do instead (FSDPStrategy refuses CPU in Lightning itself; DeepSpeed is not installed:
both are checked on their strategy objects in tests/unit/test_strategy_support.py)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import MLP, preloaded_dataset, quiet_trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt, MemoryEstimator, MemoryFill


class ShardedMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8

    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(preloaded_dataset(64, 32), batch_size=self.batch_size)


@pytest.fixture
def one_process_group():
    """The process group a fit opens in this process, and the variables Lightning set for it, gone afterwards."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def test_monitor_and_tuner_run_under_model_parallel_the_memory_callbacks_refuse(tmp_path, one_process_group):
    monitor, tuner = DataWaitMonitor(warmup_steps=1), DataLoaderTuner(max_seconds=1)
    model = ShardedMLP()
    trainer = quiet_trainer(tmp_path, [monitor, tuner], strategy=ModelParallelStrategy(), max_steps=4)
    trainer.fit(model)
    assert type(model.net).__name__ == "FSDPSequential"  # fully_shard ran: FSDP2's class for the Sequential
    assert monitor.report.totals.steps == 3 and monitor.report.verdict  # 4 steps, the first a warm-up
    assert tuner.result is not None and trainer.global_step == 4

    for callback, fix in [
        (BatchSizeSearch(max_memory="64MiB"), "Remove BatchSizeSearch"),
        (MemoryFill(max_memory="64MiB"), "Remove MemoryFill"),
        (MemoryEstimator(), "Remove MemoryEstimator"),
        (GpuOpt("diagnose"), "Pass estimate=False to GpuOpt"),
    ]:
        model = ShardedMLP()
        trainer = quiet_trainer(tmp_path, [callback], strategy=ModelParallelStrategy(), max_steps=2)
        with pytest.raises(MisconfigurationException, match="cannot run under ModelParallelStrategy") as error:
            trainer.fit(model)
        assert fix in str(error.value)
        assert trainer.global_step == 0 and model.batch_size == 8
        torch.distributed.destroy_process_group()
