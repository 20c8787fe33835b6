"""Datasets, models and small callbacks shared by the tests and the DDP test script."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from lightning import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpuopt.core.memory import MemoryBudget, is_out_of_memory_error

#: the tests' folder (support modules, data, the DDP script) and the repository
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def usable_cores_from_the_os() -> int:
    """The cores this process may keep busy, read apart from the library: its CPU affinity, at most
    the cgroup CPU quota (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) rounded up."""
    affinity = len(os.sched_getaffinity(0))
    quota: Optional[float] = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as handle:
            limit, period = handle.read().split()[:2]
        quota = None if limit == "max" else int(limit) / int(period)
    except OSError:
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as quota_file:
                limit_us = int(quota_file.read())
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as period_file:
                period_us = int(period_file.read())
            quota = limit_us / period_us if limit_us > 0 else None
        except OSError:
            quota = None
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


def quiet_trainer(root_dir: Any, callbacks: Iterable[Callback] = (), **settings: Any) -> Trainer:
    """A quiet one-device CPU Trainer (no logger, checkpoints, progress bar or summary) in ``root_dir``;
    ``settings`` add to or override those.

    >>> quiet_trainer("/tmp/run", max_steps=2).max_steps
    2
    """
    quiet = dict(
        accelerator="cpu",
        devices=1,
        default_root_dir=root_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(callbacks=list(callbacks), **{**quiet, **settings})


class SlowDataset(Dataset):
    """Random features; each ``__getitem__`` sleeps ``delay_s`` (a stand-in for a disk read).

    ``delay_for`` (optional) returns the delay to use, so a test can make one rank slower.
    With ``num_workers=0``, ``durations`` holds how long each ``__getitem__`` really took (a
    loaded machine oversleeps): the ground truth the tests compare against.
    """

    def __init__(
        self, size: int, features: int = 32, delay_s: float = 0.0, delay_for: Optional[Callable[[], float]] = None
    ) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=generator)
        self.y = torch.randint(0, 10, (size,), generator=generator)
        self.delay_s = delay_s
        self.delay_for = delay_for
        self.durations: list[float] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        delay = self.delay_for() if self.delay_for is not None else self.delay_s
        if delay:
            time.sleep(delay)
        item = self.x[index], self.y[index]
        self.durations.append(time.perf_counter() - started)
        return item

    def loading_time(self, first_sample: int, last_sample: int | None = None) -> float:
        """Seconds ``__getitem__`` really took for samples ``first_sample:last_sample`` in fetch order."""
        return sum(self.durations[first_sample:last_sample])


def preloaded_dataset(size: int, features: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(size, features, generator=generator), torch.randint(0, 10, (size,), generator=generator)
    )


def preloaded_batches(batches: int, batch_size: int, features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole batches already in memory: use with ``DataLoader(..., batch_size=None)``."""
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch_size, features, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator),
        )
        for _ in range(batches)
    ]


class MLP(LightningModule):
    """An MLP classifier; ``step_sleep_s`` adds a fixed host-side cost to each training step."""

    def __init__(self, features: int = 32, hidden: int = 64, layers: int = 1, step_sleep_s: float = 0.0) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, 10))
        self.step_sleep_s = step_sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TrainingWallClock(Callback):
    """An independent stopwatch: wall time from the first epoch start to the end of training
    (validation and checkpointing inside it included), and the number of samples trained."""

    def __init__(self) -> None:
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.samples = 0

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.samples += len(batch[0])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.ended = time.perf_counter()

    @property
    def wall_s(self) -> float:
        assert self.started is not None and self.ended is not None
        return self.ended - self.started


class SlowHook(Callback):
    """Host work after every training step (like a heavy logging callback)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.seconds > 0:  # sleep(0) yields the CPU: on a loaded machine the hook would wait for it again
            time.sleep(self.seconds)


class CpuHeavyDataset(Dataset):
    """Each sample costs ~1 ms of pure-Python CPU work (decoding-like), no I/O wait."""

    def __init__(self, size: int, work: int = 30000) -> None:
        self.size, self.work = size, work

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = 0
        for k in range(self.work):
            total += k * k
        return torch.tensor([float(total % 7), float(index)]), torch.tensor(index % 10)


class StreamDataset(torch.utils.data.IterableDataset):
    """An iterable dataset that does not shard by worker."""

    def __init__(self, size: int, features: int = 32) -> None:
        self.size, self.features = size, features

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(self.size):
            yield torch.randn(self.features, generator=generator), torch.randint(0, 10, (), generator=generator)


class BatchRecorder(Callback):
    """Records the loader settings used and the first feature of every sample, in training order."""

    def __init__(self) -> None:
        self.loader_settings: Optional[tuple] = None
        self.first_values: list[float] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        self.loader_settings = (
            loader.num_workers,
            loader.prefetch_factor,
            loader.persistent_workers,
            loader.pin_memory,
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.first_values.extend(batch[0][:, 0].tolist())


#: the name of the profiler range :func:`profiler_peak_bytes` records when an ``existing`` storage dies
_FREED_MARKER = "profiler_peak_bytes.freed"


def profiler_peak_bytes(fn: Callable[[], Any], existing: Iterable[Any] = ()) -> int:
    """The host allocator's peak while ``fn()`` runs, as the torch profiler records it, plus the
    storage bytes of ``existing`` (tensors alive before the window: model, optimizer, batch).

    An independent measurement: every allocation and free the CPU allocator serves inside the
    window (``profile_memory=True``, kernel workspaces included), summed in time order. The
    profiler does not report the free of a block it did not see allocated ("Memory block of unknown
    size was allocated before the profiling started"), e.g. a gradient of the previous step freed by
    ``zero_grad(set_to_none=True)``, and reports it with a stale size when it saw another block at
    that address in an earlier profile. So only frees of blocks allocated inside the window are
    taken from the allocator's events, and the death of each storage of ``existing`` is marked in
    the profile (a ``record_function`` range from a weak-reference callback) and counted as its free.

    Example::

        >>> weights = torch.zeros(1000)                       # 4000 bytes, alive before the window
        >>> def work():
        ...     a = torch.ones(500); del a                    # 2000 bytes, freed
        ...     return torch.ones(1000).exp()                 # 4000 + 4000 bytes at once
        >>> profiler_peak_bytes(work, existing=[weights])
        12000
    """
    import gc
    import weakref

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from lightning_gpuopt.core.op_memory import collect_tensors

    before: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for tensor in collect_tensors(*existing):
        storage = tensor.untyped_storage()
        before.setdefault(storage.data_ptr(), (storage, storage.nbytes()))

    def freed(data_ptr: int) -> Callable[[Any], None]:
        def mark(_reference: Any) -> None:
            with record_function(f"{_FREED_MARKER} {data_ptr}"):
                pass

        return mark

    gc.collect()  # garbage of earlier work must not be freed (and counted) inside the window
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        references = [weakref.ref(storage, freed(data_ptr)) for data_ptr, (storage, _) in before.items()]
        sizes = {data_ptr: num_bytes for data_ptr, (_, num_bytes) in before.items()}
        before.clear()  # the window holds no reference of its own
        fn()
    del references
    events: list[tuple[int, int, int, bool]] = []  # (time, signed bytes, data pointer, a death marker)

    def collect(nodes: Any) -> None:
        for event in nodes:
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                events.append((event.start_time_ns, int(event.extra_fields.alloc_size), event.extra_fields.ptr, False))
            elif event.name.startswith(_FREED_MARKER):
                data_ptr = int(event.name.split()[-1])
                events.append((event.start_time_ns, -sizes[data_ptr], data_ptr, True))
            collect(event.children)

    collect(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = sum(sizes.values())
    allocated: dict[int, int] = {}  # blocks allocated inside the window, by address
    for _, size, data_ptr, marker in sorted(events, key=lambda event: event[0]):  # stable: ties keep tree order
        if marker:
            live += size
        elif size > 0:
            allocated[data_ptr] = size
            live += size
        elif data_ptr in allocated:
            live -= allocated.pop(data_ptr)
        # else: the free of a block from before the window. Its size in the profiler can be stale (an
        # address the profiler saw earlier, reused since); ``existing`` blocks are counted by marker
        peak = max(peak, live)
    return peak


class TimedLoader(DataLoader):
    """A ``DataLoader`` whose iterators time every ``next()`` with their own stopwatch: the whole
    fetch (sampler, every ``__getitem__``, collate, and any wait for a core on a loaded machine),
    independent of what the library measures. ``fetch_s[i]`` is batch ``i``'s fetch time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetch_s: list[float] = []

    def __iter__(self) -> Any:
        inner = super().__iter__()
        loader = self

        class Timed:
            def __iter__(self) -> Any:
                return self

            def __next__(self) -> Any:
                started = time.perf_counter()
                try:
                    return next(inner)
                finally:
                    loader.fetch_s.append(time.perf_counter() - started)

            def __len__(self) -> int:
                return len(inner)

        return Timed()


def memory_files(url: str) -> dict[str, bytes]:
    """Every file under the ``memory://`` folder ``url``, by its URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/" + url.removeprefix("memory://")
    return {f"memory:/{key}": fs.cat_file(key) for key in fs.store if key.startswith(root + "/")}


def missing_protocol() -> tuple[str, str]:
    """``(protocol, package)`` of a remote filesystem fsspec knows but whose package is not installed
    here (``("s3", "s3fs")`` on a machine without s3fs); the test is skipped when all of them are."""
    import importlib.util

    import pytest
    from fsspec.registry import known_implementations

    for protocol in ("s3", "gcs", "az", "oci", "oss"):
        package = known_implementations[protocol]["class"].split(".")[0]
        if importlib.util.find_spec(package) is None:
            return protocol, package
    pytest.skip("every remote filesystem package tried (s3fs, gcsfs, adlfs, ocifs, ossfs) is installed")


class BudgetAroundTraining(Callback):
    """The independent measurement: a MemoryBudget entered at train start, left at train end."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.budget: Optional[MemoryBudget] = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.budget = MemoryBudget(self.cap_bytes, existing=(pl_module, *trainer.optimizers), device="cpu")
        self.budget.__enter__()

    def _leave(self) -> None:
        if self.budget is not None:
            budget, self.budget = self.budget, None
            budget.__exit__(None, None, None)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._leave()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self._leave()


def fits_independently(
    tmp_path: Any, name: str, batch_size: int, cap_bytes: int, steps: int = 2, samples: int = 4096
) -> bool:
    """Do ``steps`` real training steps of a fresh model at ``batch_size`` fit in ``cap_bytes``?"""
    from models_memory import make_model

    model = make_model(name, num_samples=samples, batch_size=batch_size)
    trainer = quiet_trainer(tmp_path / f"check{batch_size}", [BudgetAroundTraining(cap_bytes)], max_steps=steps)
    try:
        trainer.fit(model)
    except Exception as error:
        if is_out_of_memory_error(error):
            return False
        raise
    return True


def run_ddp(out: Path, mode: str, timeout: float = 150) -> subprocess.CompletedProcess:
    # Lightning's own variables (PL_GLOBAL_SEED, MASTER_PORT, ...) set by earlier in-process runs stay out
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PL_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))
    }
    # the ranks import this checkout's package, as the tests do (not an install of another checkout)
    paths = [str(TESTS), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**inherited, "PYTHONPATH": os.pathsep.join(paths)}
    result = subprocess.run(
        [sys.executable, str(TESTS / "ddp_script.py"), str(out), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def rank_json(result: subprocess.CompletedProcess, path: Path) -> dict:
    """A rank's output file; when a rank wrote none (it failed after rank 0 exited with 0), its
    processes' output says why, in the failure."""
    assert path.exists(), f"{path.name} missing; the ranks' output:\n{(result.stdout + result.stderr)[-6000:]}"
    return json.loads(path.read_text())
