"""Which strategies our callbacks run under, decided in one place (``_lightning_compat.check_strategy``): under
FSDP, ModelParallel and DeepSpeed the memory callbacks refuse at setup, naming the strategy and what to do
instead; the others run. Real strategy objects, constructed without launching (DeepSpeed's without its
``__init__``, which needs the package: the check must not import it)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gpuopt import BatchSizeSearch, DataLoaderTuner, DataWaitMonitor, GpuOpt, MemoryEstimator, MemoryFill
from lightning_gpuopt.callbacks._lightning_compat import check_strategy


class UsersFSDP(FSDPStrategy):
    """A user's subclass: still sharded."""


SHARDED = {
    "FSDPStrategy": FSDPStrategy,
    "ModelParallelStrategy": ModelParallelStrategy,
    "DeepSpeedStrategy": lambda: DeepSpeedStrategy.__new__(DeepSpeedStrategy),
    "UsersFSDP": UsersFSDP,
}


def check(strategy, callback):
    check_strategy(SimpleNamespace(strategy=strategy), callback)


@pytest.mark.parametrize("name", SHARDED)
def test_memory_callbacks_refuse_sharded_strategies_and_say_what_to_do(name):
    strategy = SHARDED[name]()
    shown = "FSDPStrategy" if name == "UsersFSDP" else name
    for callback in (BatchSizeSearch(max_memory="1GiB"), MemoryFill(max_memory="1GiB"), MemoryEstimator()):
        with pytest.raises(
            MisconfigurationException, match=f"{type(callback).__name__} cannot run under {shown}"
        ) as error:
            check(strategy, callback)
        assert f"Remove {type(callback).__name__}" in str(error.value) and "strategy='ddp'" in str(error.value)
    with pytest.raises(MisconfigurationException, match="Pass fill_memory=False, estimate=False to GpuOpt") as error:
        check(strategy, GpuOpt("max-throughput", max_memory="1GiB"))
    assert f"MemoryFill and MemoryEstimator cannot run under {shown}" in str(error.value)
    for callback in (DataWaitMonitor(), DataLoaderTuner(), GpuOpt("diagnose", estimate=False)):
        check(strategy, callback)  # runs
    assert "deepspeed" not in sys.modules


def test_unsharded_strategies_run_every_callback():
    for callback in (BatchSizeSearch(max_memory="1GiB"), MemoryFill(max_memory="1GiB"), MemoryEstimator(), GpuOpt()):
        check(DDPStrategy(), callback)
