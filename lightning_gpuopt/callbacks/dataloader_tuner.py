"""``DataLoaderTuner``: choose the train loader's worker settings by timing copies of it, each batch through the
module's step, in ``on_fit_start`` (:func:`~lightning_gpuopt.core.loader.tune_loader`); Lightning then builds the
chosen setting until ``teardown``. Under DDP rank 0's choice is broadcast. See docs/dataloader-tuner.md.

Logged once when training starts: ``gpuopt/loader_num_workers`` (chosen), ``gpuopt/loader_samples_per_second``
(with the chosen setting) and ``gpuopt/loader_speedup`` (that throughput over the user's setting's)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine import (
    FitSession,
    TrainingState,
    Undo,
    rebuild_loader,
    rng_kept,
    signals_stop_our_work,
)
from lightning_gpuopt.callbacks._engine.session import EngineCallback
from lightning_gpuopt.callbacks._engine.steps import loss_function
from lightning_gpuopt.callbacks._progress import WorkProgress
from lightning_gpuopt.callbacks._reporting import log_metrics, report_section
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_gpuopt.core._torch_compat import tree_leaves
from lightning_gpuopt.core.checks import check_bool, check_int, check_number
from lightning_gpuopt.core.device import Device, device_for
from lightning_gpuopt.core.loader import (
    LoaderSetting,
    LoaderTiming,
    LoaderTuneResult,
    oversubscription,
    tune_loader,
    usable_cpu_count,
)
from lightning_gpuopt.core.report import format_seconds, loader_summary, loader_tune_table, to_dict


class DataLoaderTuner(EngineCallback):
    """Time the real train loader over worker settings before training, and apply the best.

    Args:
        max_seconds: no new candidate is timed after this long (one candidate stops after a quarter of it).
        batches_per_candidate: batches timed per candidate at least (``W`` more with ``W`` workers).
        tolerance: the cheapest setting within this fraction of the best throughput is chosen.
        target_samples_per_second: what training consumes (``None``: a DataWaitMonitor's earlier measurement).
        max_num_workers: at most this many workers (default: 4 x the usable cores per process).
        persistent_workers: keep workers alive between epochs (not with pinned memory and reloaded loaders).
        verbose: log the table of timed settings (the JSON report is written either way).

    Example::

        tuner = DataLoaderTuner(max_seconds=10)
        Trainer(callbacks=[tuner]).fit(model, datamodule=dm)
        tuner.result.num_workers, tuner.result.speedup
    """

    def __init__(
        self,
        max_seconds: float = 10.0,
        batches_per_candidate: int = 16,
        tolerance: float = 0.05,
        target_samples_per_second: Optional[float] = None,
        max_num_workers: Optional[int] = None,
        persistent_workers: bool = True,
        verbose: bool = True,
    ) -> None:
        check_number("max_seconds", max_seconds, "max_seconds=10", low=0, low_inclusive=False)
        check_int("batches_per_candidate", batches_per_candidate, 2, "batches_per_candidate=16")
        check_number("tolerance", tolerance, "tolerance=0.05", low=0, high=1, high_inclusive=False)
        if target_samples_per_second is not None:
            example = "target_samples_per_second=5000, or None to measure it"
            check_number("target_samples_per_second", target_samples_per_second, example, low=0, low_inclusive=False)
        check_int("max_num_workers", max_num_workers, 0, "max_num_workers=8", allow_none=True)
        check_bool("persistent_workers", persistent_workers, "persistent_workers=False")
        check_bool("verbose", verbose, "verbose=False")
        self.max_seconds, self.tolerance = float(max_seconds), float(tolerance)
        self.batches_per_candidate = batches_per_candidate
        self.target_samples_per_second, self.max_num_workers = target_samples_per_second, max_num_workers
        self.persistent_workers, self.verbose = persistent_workers, verbose
        self.progress = verbose  # report each candidate as it is timed
        self.result: Optional[LoaderTuneResult] = None  #: the measurement and the choice; ``None`` if not tuned
        self.message: str = ""  #: what the tuner did, or why it left the loader alone
        self._undo = Undo()
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    def _reset(self) -> None:
        self.result, self.message = None, ""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with signals_stop_our_work(trainer, self._undo):
            self.decide(trainer)
            if self.result is not None:
                FitSession.of(trainer).apply(self._undo, rebuild=self.rebuild)
        self._report(trainer)

    def rebuild(self, loader: DataLoader) -> DataLoader:
        """``loader`` with the chosen worker settings (as it is when it cannot be rebuilt or nothing was chosen)."""
        if self.result is None or _why_not_tunable(loader) is not None:
            return loader
        return rebuild_loader(loader, **self.result.setting.loader_kwargs())

    def decide(self, trainer: Trainer, batch_size: Optional[int] = None) -> Optional[LoaderTuneResult]:
        """Time the loader (at ``batch_size`` when given) and set :attr:`result`; the caller applies it."""
        self.result, self.message = None, ""
        if not compat.train_source(trainer).is_defined():
            return None
        session = FitSession.of(trainer)
        loader = session.probe_loader()
        refusal = _why_not_tunable(loader)
        if refusal is None and batch_size is not None and batch_size != loader.batch_size:
            loader = session.loader(batch_size=batch_size)
        card = device_for(trainer.strategy.root_device)
        on_gpu = card.is_cuda
        if refusal is None and on_gpu:
            with rng_kept(loader):  # reading a sample may draw random augmentations
                refusal = _samples_on_device(loader, card)
        if refusal is not None:
            self.message = f"DataLoaderTuner left the train loader alone: {refusal}"
            rank_zero_warn(self.message)
            return None
        cores = max(1, usable_cpu_count() // (trainer.num_devices if trainer.world_size > 1 else 1))
        reloads = cast(Any, trainer).reload_dataloaders_every_n_epochs  # set by Lightning, not declared on Trainer
        persistent = self.persistent_workers and not (on_gpu and reloads > 0)
        yours = (loader.num_workers, loader.prefetch_factor, loader.persistent_workers, loader.pin_memory)
        baseline = LoaderSetting(*yours)
        seen: list[LoaderSetting] = []  # every timing's setting, in order: the contenders are timed again
        with (
            _training_step(trainer, loader) as step,
            rng_kept(loader),
            signals_stop_our_work(trainer, raise_at_once=True),
            WorkProgress(trainer, "DataLoaderTuner timing", None, self.progress) as progress,
        ):
            result = tune_loader(
                lambda setting: rebuild_loader(loader, **setting.loader_kwargs()),
                usable_cpus=cores,
                batches=self.batches_per_candidate,
                max_seconds=self.max_seconds,
                tolerance=self.tolerance,
                target_samples_per_second=self.target_samples_per_second or _measured_ceiling(trainer),
                pin_memory=on_gpu or bool(loader.pin_memory),
                persistent_workers=persistent,
                max_workers=self.max_num_workers,
                baseline=baseline,
                on_timed=lambda timing: progress.done(_candidate_line(timing, baseline, seen)),
                consume=step,
            )
        self.result = res = trainer.strategy.broadcast(result, src=0)
        timed = f"{len(res.candidates)} settings in {len(seen)} timings (the fastest of each kept), {res.seconds:.1f} s"
        self.message = f"DataLoaderTuner: {loader_summary(res)}; {timed}"
        chosen = next((t for t in res.candidates if t.setting == res.setting), None)
        busy = chosen.worker_cpu_fraction if chosen else None
        if res.num_workers > cores and busy is not None:
            # PyTorch's DataLoader warns past the CPU affinity alone, not past a cgroup quota
            warns = "PyTorch will warn that " if res.num_workers > usable_cpu_count(within_quota=False) else ""
            measured = f"they were measured busy only {busy:.0%} of the time (waiting on I/O), so more workers than cores is what keeps up here"
            self.message += f". {warns}{res.num_workers} workers exceed the {cores} usable cores: {measured}"
        if not res.settled:
            uncertain = f"the choice is uncertain ({res.reason.rsplit('; ', 1)[-1]}); set `num_workers` yourself, or tune again when the machine is quieter (`max_seconds` gives it longer)"
            rank_zero_warn(f"DataLoaderTuner: {uncertain}")
        on_cpu = trainer.strategy.root_device.type == "cpu"
        if warning := on_cpu and oversubscription(torch.get_num_threads(), res.num_workers, busy, cores):
            rank_zero_warn(f"DataLoaderTuner: {warning}")
        return res

    def _report(self, trainer: Trainer) -> None:
        if (result := self.result) is not None:
            table = functools.partial(loader_tune_table, result, self.message) if self.verbose else None
            report_section(trainer, "dataloader", {"message": self.message, **to_dict(result)}, table)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (r := self.result) is None:
            return
        metrics = {"gpuopt/loader_num_workers": r.num_workers, "gpuopt/loader_samples_per_second": r.samples_per_second}
        log_metrics(trainer, {**metrics, "gpuopt/loader_speedup": r.speedup})


@contextlib.contextmanager
def _training_step(trainer: Trainer, loader: DataLoader) -> Iterator[Optional[Callable[[Any], None]]]:
    """The module's forward and backward for each timed batch (``None`` where it cannot run); put back after."""
    module, strategy, loss_of = trainer.lightning_module, trainer.strategy, loss_function(trainer.lightning_module)
    state = TrainingState(trainer) if module.automatic_optimization and trainer.world_size == 1 else None

    def step(batch: Any) -> None:
        with trainer.precision_plugin.train_step_context():
            loss_of(strategy.batch_to_device(batch)).backward()

    checked = state is not None
    try:
        if checked:
            step(next(iter(loader)))
    except Exception:  # noqa: BLE001 - a step that fails here fails in training: the loader is timed alone
        checked = False
    try:
        yield step if checked else None
    finally:
        if state is not None:
            state.restore()


def _why_not_tunable(loader: Any) -> Optional[str]:
    """``None`` when ``loader`` can be rebuilt with other worker settings, else the reason."""
    if isinstance(loader, (list, tuple, dict)):
        return "there are several train loaders; tune each by hand or pass one loader."
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch.utils.data.DataLoader: its worker settings cannot be rebuilt."
    if isinstance(loader.dataset, IterableDataset):
        split = "unless the dataset splits it with torch.utils.data.get_worker_info(). Set num_workers yourself once it does."
        return f"its dataset is an IterableDataset ({type(loader.dataset).__name__}): with more workers each would yield the whole stream {split}"
    return None


def _samples_on_device(loader: Any, device: Device) -> Optional[str]:
    """Why a loader whose first sample has tensors on ``device`` must be left alone (``None``: it has none)."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    try:
        sample = dataset[0] if len(dataset) else None
    except Exception:  # noqa: BLE001 - a dataset that cannot be indexed so is not ours to judge
        return None
    on_device = [leaf for leaf in tree_leaves(sample) if isinstance(leaf, torch.Tensor) and device.holds(leaf)]
    if not on_device:
        return None
    why = "pin_memory=True fails on them (only dense CPU tensors can be pinned) and worker processes would touch CUDA after fork"
    instead = "Keep num_workers=0 and pin_memory=False for such data, or keep the dataset on the host and let the tuner choose workers."
    return f"its samples are already on {device.describe()} (the first sample holds {len(on_device)} device tensor(s)): {why}. {instead}"


def _measured_ceiling(trainer: Trainer) -> Optional[float]:
    """Samples/s training would reach with no data wait, from a DataWaitMonitor's last report."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        report = getattr(callback, "report", None) if isinstance(callback, DataWaitMonitor) else None
        if report is not None and report.totals.samples and report.totals.wall_s > report.totals.data_wait_s:
            return report.totals.samples / report.world_size / (report.totals.wall_s - report.totals.data_wait_s)
    return None


def _candidate_line(timing: LoaderTiming, baseline: Optional[LoaderSetting], seen: list) -> str:
    """One timing of a loader setting in words, for progress reporting (``seen``: the settings timed before; appended).

    >>> _candidate_line(LoaderTiming(LoaderSetting(2, 2, True), 8, 256, 0.21, 0.5, 5063.6, 0.25), None, [LoaderSetting(2, 2, True)])
    '2 workers, prefetch 2, persistent, again: 5,064 samples/s (start-up 210.0 ms)'
    """
    yours = (", again" if timing.setting in seen else "") + (" [yours]" if timing.setting == baseline else "")
    seen.append(timing.setting)
    early = ", stopped early: slower than the best" if timing.stopped_early else ""
    speed, startup = f"{timing.samples_per_second:,.0f} samples/s", format_seconds(timing.startup_s)
    return f"{timing.setting.short()}{yours}: {speed} (start-up {startup}{early})"
