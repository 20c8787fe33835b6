"""Probes of the ``"slow-hook"``, ``"checkpoint-time"`` and ``"slow-disk"`` findings (:mod:`lightning_gpuopt.core.findings` decides).

:class:`HookTimes` totals every hook call and ``trainer.save_checkpoint`` from train start to end, as the profiler
tap times them (the hooks of every step, between steps too: in the steps :data:`HOOK_SAMPLE_EVERY` says, scaled). :class:`DatasetDisk` finds the training dataset's files and, at train end, reads a sample of them
with the page cache dropped, against the rate training consumed them (``gpuopt/dataset_read_mb_s``,
``gpuopt/dataset_needed_mb_s``)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterable, NamedTuple, Optional

import psutil
from torch.utils.data import ConcatDataset, Subset

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._detectors import Probe, first_dataloader
from lightning_gpuopt.callbacks._reporting import log_metrics
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.findings import CheckpointSaver, Finding, checkpoint_time, slow_disk, slow_hook
from lightning_gpuopt.core.op_memory import storage_bytes

#: hooks on the step's compute or data path (split by the monitor), run once per fit, or run inside a
#: checkpoint save (``"checkpoint-time"``): never a ``"slow-hook"``
# fmt: off
_NOT_USER_WORK = frozenset((
    "training_step", "backward", "optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping",
    "clip_gradients", "lr_scheduler_step", "transfer_batch_to_device", "on_before_batch_transfer",
    "on_after_batch_transfer", "batch_to_device", "forward", "setup", "teardown", "prepare_data",
    "configure_optimizers", "configure_model", "configure_callbacks", "configure_sharded_model", "on_fit_start",
    "on_fit_end", "on_train_start", "on_train_end", "on_exception", "train_dataloader", "val_dataloader",
    "on_sanity_check_start", "on_sanity_check_end", "on_save_checkpoint", "on_load_checkpoint", "state_dict",
    "load_state_dict",
))
#: hooks Lightning calls every step (and the fetch, the transfer, ``training_step``): timed in the first ``warmup_steps``
#: + ``HOOK_SAMPLED_FIRST`` steps and then one in ``HOOK_SAMPLE_EVERY`` at random, scaled (calls exact if the same
#: every step); other hooks: every call
HOOK_SAMPLE_EVERY, HOOK_SAMPLED_FIRST = 32, 4
_PER_STEP = ("on_train_batch_start", "on_train_batch_end", "on_before_zero_grad", "on_before_backward",
             "on_after_backward", "on_before_optimizer_step")
# fmt: on


class HookTimes(Probe):
    """``"slow-hook"`` and ``"checkpoint-time"``: every hook's total time and calls (training part), every
    checkpoint save, and the one hook each save ran in."""

    #: actions not to report to this probe: in sampled steps; in the others (its per-step hooks too)
    quiet_sampled = quiet = _per_step = frozenset[str]()

    def __init__(self) -> None:
        self._started_at: Optional[float] = None  # train start and end: the probe listens in between
        self._ended_at: Optional[float] = None
        self.in_sample = False  #: whether this step's hook calls are timed (fetch to fetch; the monitor decides)
        self._callbacks: dict[str, Any] = {}
        #: action name -> (seconds outside checkpoint saves, calls), validation excluded: outside steps, in sampled steps
        self._hooks: dict[str, tuple[float, int]] = {}
        self._sampled: dict[str, tuple[float, int]] = {}
        #: action name of the hook the saves ran in ("" when none) -> [saves, seconds], validation included
        self._saves: dict[str, list[float]] = {}
        self._pending_saves = [0.0, 0.0]

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        for callback in trainer.callbacks:
            with contextlib.suppress(Exception):  # a failing state_key only loses the callback's class name
                self._callbacks[callback.state_key] = callback
        data = [compat.DATAMODULE_ACTION + type(trainer.datamodule).__name__] if trainer.datamodule is not None else []
        owners = [compat.MODULE_ACTION + type(pl_module).__name__, *data]
        owners += [compat.CALLBACK_ACTION + key for key in self._callbacks]
        never = [compat.strategy_action(trainer, hook) for hook in ("on_train_batch_start", *_NOT_USER_WORK)]
        never += [compat.fetch_action(trainer), compat.TRAINING_BATCH_ACTION]
        # per-step hooks never slow, not timed even in sampled steps: Lightning's no-ops, and ours
        own = [hook for hook in _PER_STEP if compat.overrides(pl_module, hook, ("", "LightningModule"))]
        never += [f"{compat.MODULE_ACTION}{type(pl_module).__name__}.{hook}" for hook in _PER_STEP if hook not in own]
        never += [f"{compat.CALLBACK_ACTION}{key}.{hook}" for key, callback in self._callbacks.items()
                  for hook in _PER_STEP if _ours(callback) or not compat.overrides(callback, hook)]  # fmt: skip
        self.quiet_sampled = frozenset(never + [f"{owner}.{hook}" for owner in owners for hook in _NOT_USER_WORK])
        self._per_step = frozenset(f"{owner}.{hook}" for owner in owners for hook in _PER_STEP)
        self.quiet = self.quiet_sampled | self._per_step
        self._started_at = time.perf_counter()

    def _add_saves(self, action: str) -> None:
        saved = self._saves.get(action, [0.0, 0.0])
        self._saves[action] = [total + pending for total, pending in zip(saved, self._pending_saves)]
        self._pending_saves = [0.0, 0.0]

    def saved_in(self, action: str) -> None:
        """The saves just made ran in hook ``action`` (``""``: none), which began before the tap was in the path."""
        if self._pending_saves[0]:
            self._add_saves(action)

    def action_timed(self, action: str, seconds: float, in_validation: bool) -> None:
        if self._started_at is None or self._ended_at is not None:
            return
        pending = self._pending_saves
        if action == compat.SAVE_CHECKPOINT_ACTION:
            self._pending_saves = [pending[0] + 1, pending[1] + seconds]
            return
        if not action.startswith(compat.HOOK_ACTION_PREFIXES):
            return
        if pending[0] and not action.endswith((".on_save_checkpoint", ".state_dict")):
            # the first hook to end after a save is the one it ran in (its own on_save_checkpoint hooks end inside)
            seconds = max(0.0, seconds - pending[1])
            self._add_saves(action)
        if not in_validation:  # a per-step hook is seen in sampled steps (else only after a save: counted as is)
            hooks = self._sampled if self.in_sample and action in self._per_step else self._hooks
            total_s, calls = hooks.get(action, (0.0, 0))
            hooks[action] = (total_s + seconds, calls + 1)

    def stop(self) -> None:
        if self._started_at is not None and self._ended_at is None:
            self._ended_at = time.perf_counter()

    def _owner(self, action: str) -> tuple[Optional[Any], str, str, bool]:
        """(the callback or ``None``, its shown name, the hook name, whether a LightningModule hook)."""
        prefix = action[: action.index("]") + 1]
        owner, _, hook = action[len(prefix) :].rpartition(".")
        if prefix == compat.CALLBACK_ACTION:
            callback = self._callbacks.get(owner)
            return callback, (type(callback).__name__ if callback is not None else owner), hook, False
        return None, owner, hook, prefix == compat.MODULE_ACTION

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        if self._started_at is None or self._ended_at is None:
            return []
        fit_s = train_s = report.totals.train_s or self._ended_at - self._started_at  # the table's denominator
        epochs = max(1, report.settings.epochs)
        found: list[Optional[Finding]] = []
        scale, hooks = self.steps_seen / max(1, self.sampled_steps), dict(self._hooks)
        for action, (seconds, calls) in self._sampled.items():
            total_s, total = hooks.get(action, (0.0, 0))
            hooks[action] = (total_s + seconds * scale, total + round(calls * scale))
        for action, (seconds, calls) in hooks.items():
            callback, owner, hook, in_module = self._owner(action)
            if hook not in _NOT_USER_WORK and not _ours_or_builtin(callback):
                sampled = (self.sampled_steps, self.steps_seen) if action in self._sampled else None
                found.append(slow_hook(f"{owner}.{hook}", seconds, calls, train_s, epochs, in_module, sampled=sampled))
        if self._pending_saves[0]:
            self._add_saves("")
        savers: dict[Any, CheckpointSaver] = {}  # one a ModelCheckpoint (by id), else one a hook
        sizes: list[int] = []
        for action, (saves, seconds) in self._saves.items():
            callback, owner, hook, _ = self._owner(action) if action else (None, "trainer.save_checkpoint", "", False)
            if isinstance(callback, compat.any_namespace("callbacks", "ModelCheckpoint")):
                if id(callback) not in savers:
                    savers[id(callback)] = _model_checkpoint_saver(callback)
                    sizes.append(_last_saved_bytes(callback))
                savers[id(callback)].saves += int(saves)
                savers[id(callback)].seconds += seconds
            else:
                savers[action] = CheckpointSaver(f"{owner}.{hook}" if hook else owner, int(saves), seconds, False)
        if savers:
            optimizer = storage_bytes(*trainer.optimizers)
            parameters = sum(parameter.numel() * parameter.element_size() for parameter in pl_module.parameters())
            size = max(sizes, default=0) or None
            found.append(checkpoint_time(list(savers.values()), fit_s, self.steps_seen, size, optimizer, parameters))
        return [finding for finding in found if finding is not None]


def _ours(callback: Any) -> bool:
    return type(callback).__module__.startswith("lightning_gpuopt")


def _ours_or_builtin(callback: Any) -> bool:
    """lightning_gpuopt's callbacks, Lightning's progress bars, model summaries and ModelCheckpoint (its saves
    are ``"checkpoint-time"``)."""
    if callback is None:
        return False
    builtin = ("ProgressBar", "ModelSummary", "ModelCheckpoint")
    return _ours(callback) or any(isinstance(callback, compat.any_namespace("callbacks", name)) for name in builtin)


def _model_checkpoint_saver(callback: Any) -> CheckpointSaver:
    steps, epochs, interval = compat.checkpoint_schedule(callback)
    settings = [f"every_n_train_steps={steps}" if steps else "", f"train_time_interval={interval}" if interval else ""]
    settings.append(f"every_n_epochs={epochs}" if epochs and not steps and not interval else "")
    name = f"ModelCheckpoint({', '.join(setting for setting in settings if setting)})"
    seconds, weights_only = interval.total_seconds() if interval else None, bool(callback.save_weights_only)
    return CheckpointSaver(name, 0, 0.0, True, steps, epochs, seconds, callback.save_last, weights_only)


def _last_saved_bytes(callback: Any) -> int:
    for path in (compat.last_checkpoint_saved(callback), callback.last_model_path, callback.best_model_path):
        with contextlib.suppress(OSError, TypeError):
            if path and os.path.isfile(path):
                return os.path.getsize(path)
    return 0


#: the most files read, bytes read and seconds spent reading at train end
READ_FILES, READ_BYTES, READ_SECONDS = 32, 64 * 2**20, 2.0
#: the most entries looked at in one list attribute, files walked in a directory (in at most a second), files
#: stat-ed for their size; the read size
_MAX_LISTED, _MAX_WALKED, _MAX_STAT, _CHUNK = 1_000_000, 20_000, 256, 2**20


class DatasetDisk(Probe):
    """``"slow-disk"``: read throughput of a sample of the training dataset's files against the rate training
    consumed them, decided only when the run was input-bound-ish."""

    def __init__(self) -> None:
        self._dataset: Any = None

    def fit_start(self, trainer: Any, pl_module: Any) -> None:
        loader = first_dataloader(trainer.train_dataloader)
        self._dataset = loader.dataset if loader is not None else None

    def findings(self, trainer: Any, pl_module: Any, report: DataWaitReport) -> list[Finding]:
        samples_per_second = report.totals.samples_per_second
        if self._dataset is None or not samples_per_second or trainer.local_rank != 0:
            return []
        files = dataset_files(self._dataset)
        measured = read_sample(files.sample) if files is not None else None
        if files is None or measured is None:
            return []
        # samples_per_second is every rank's together; this host's disk feeds this host's processes
        rate = samples_per_second * trainer.num_devices / max(1, trainer.world_size)
        read, needed = measured.read_mb_s, files.bytes_per_sample * rate / 1e6
        log_metrics(trainer, {"gpuopt/dataset_read_mb_s": read, "gpuopt/dataset_needed_mb_s": needed})
        wait, high, where = report.data_wait_fraction, report.thresholds.data_wait_high, files.directory
        done = (measured.files, measured.bytes / 1e6, filesystem_type(where), files.bytes_per_sample, rate)
        finding = slow_disk(read, needed, wait, high, where, *done)
        return [finding] if finding is not None else []


class DatasetFiles(NamedTuple):
    """The files a dataset names: a spread sample of them, their directory and bytes per sample."""

    sample: list[str]
    directory: str
    bytes_per_sample: float


class DiskRead(NamedTuple):
    """Files and bytes read, and the seconds it took."""

    files: int
    bytes: int
    seconds: float

    @property
    def read_mb_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def _leaves(dataset: Any, depth: int = 0) -> list[Any]:
    """The datasets under ``Subset`` and ``ConcatDataset`` wrappers."""
    if depth > 8:
        return []
    if isinstance(dataset, Subset):
        return _leaves(dataset.dataset, depth + 1)
    if isinstance(dataset, ConcatDataset):
        return [leaf for part in dataset.datasets for leaf in _leaves(part, depth + 1)]
    return [dataset]


def _as_path(value: Any) -> Optional[str]:
    if isinstance(value, (list, tuple)) and value:  # (path, label) entries of ImageFolder's samples/imgs
        value = value[0]
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    return path if isinstance(path, str) and path else None


def _isfile(path: Optional[str]) -> bool:
    return path is not None and os.path.isfile(path)  # False for an unreadable or malformed path


def _named_files(dataset: Any) -> tuple[list[str], list[str]]:
    """Files named by ``dataset``'s attributes (paths, lists of paths or of (path, label)), and directories."""
    files: dict[str, None] = {}
    directories: list[str] = []
    for value in getattr(dataset, "__dict__", {}).values():
        if isinstance(value, (list, tuple)):
            entries = value[:_MAX_LISTED]
            if entries and _isfile(_as_path(entries[0])) and _isfile(_as_path(entries[-1])):
                files.update(dict.fromkeys(path for path in map(_as_path, entries) if path is not None))
        elif (path := _as_path(value)) is not None:
            if _isfile(path):
                files[path] = None
            elif os.path.isdir(path):
                directories.append(path)
    return list(files), directories


def _walk(directories: Iterable[str], max_seconds: float = 1.0) -> list[str]:
    found: list[str] = []
    stack = list(directories)
    started = time.perf_counter()
    while stack and len(found) < _MAX_WALKED and time.perf_counter() - started < max_seconds:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file():
                    found.append(entry.path)
                    if len(found) >= _MAX_WALKED:
                        break
    return found


def _spread(items: list[str], count: int) -> list[str]:
    return list(items) if len(items) <= count else [items[(index * len(items)) // count] for index in range(count)]


def dataset_files(dataset: Any) -> Optional[DatasetFiles]:
    """The regular files ``dataset`` names (in its attributes, under ``Subset``/``ConcatDataset``; a directory
    attribute such as ``root`` is walked when it names no file), or ``None``."""
    total_bytes, samples, every = 0.0, 0, []
    for leaf in _leaves(dataset):
        files, directories = _named_files(leaf)
        files = files or _walk(directories)
        sizes = []
        for path in _spread(files, _MAX_STAT):
            with contextlib.suppress(OSError):
                sizes.append(os.stat(path).st_size)
        if not sizes:
            continue
        try:
            leaf_samples = len(leaf)
        except TypeError:
            leaf_samples = len(files)  # an iterable dataset: a file a sample
        total_bytes += sum(sizes) / len(sizes) * len(files)
        samples += max(1, leaf_samples)
        every.extend(files)
    if not every or samples == 0:
        return None
    sample = _spread(every, READ_FILES)
    try:
        directory = os.path.commonpath([os.path.abspath(path) for path in sample])
    except ValueError:
        directory = os.path.dirname(os.path.abspath(sample[0]))
    if os.path.isfile(directory):
        directory = os.path.dirname(directory)
    return DatasetFiles(sample, directory, total_bytes / samples)


def read_sample(paths: list[str]) -> Optional[DiskRead]:
    """Read ``paths`` (:data:`READ_BYTES` in all, shared evenly; for about :data:`READ_SECONDS` at most), each after
    dropping its pages from the page cache where the OS allows (``posix_fadvise``), timed from the first open."""
    per_file = max(_CHUNK, READ_BYTES // max(1, len(paths)))
    read = files = 0
    started = time.perf_counter()
    for path in paths:
        with contextlib.suppress(OSError), open(path, "rb", buffering=0) as handle:
            with contextlib.suppress(OSError, AttributeError):  # AttributeError: no posix_fadvise (macOS)
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            left = per_file
            while left > 0 and (chunk := handle.read(min(_CHUNK, left))):
                read, left = read + len(chunk), left - len(chunk)
            files += 1
        if time.perf_counter() - started > READ_SECONDS:
            break
    seconds = time.perf_counter() - started
    return DiskRead(files, read, seconds) if files and read else None


def filesystem_type(path: str) -> Optional[str]:
    """The type (``ext4``, ``tmpfs``, ``nfs``, ...) of the filesystem holding ``path`` (``None``: unknown)."""
    target = os.path.realpath(path)
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return None
    mounts = [m for m in partitions if target == m.mountpoint or target.startswith(m.mountpoint.rstrip("/") + "/")]
    # the longest mount point holding the path; of several mounts there, the last one (the visible one)
    return max(reversed(mounts), key=lambda mount: len(mount.mountpoint)).fstype if mounts else None
