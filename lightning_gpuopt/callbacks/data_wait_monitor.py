"""``DataWaitMonitor``: is the GPU waiting for data, or busy?

Every training step is split into data wait (the dataloader ``next()``, timed exactly
through the Trainer's profiler), batch transfer, compute and other host work; validation,
checkpoint saving and loader start-up at epoch starts are totalled apart. On CUDA, events
recorded at step start and end (read lazily, never synchronising) give GPU busy and idle
time, and an NVML thread samples the utilisation and memory of every GPU. At the end of
``fit`` the figures of all ranks are gathered; rank 0 logs a table with the verdict
(``input-bound``, ``compute-bound``, ``host-bound`` or ``balanced``) and recommendations,
and writes the ``"data_wait"`` section of ``gpuopt_report.json`` in the trainer's log dir. Its
``timeline`` keeps the split step by step over training (rank 0's steps, binned to at most 200
points), which ``gpuopt plot`` draws.

Logged metrics, every ``log_every_n_steps`` measured steps, each over the steps since the
previous log (rank 0's figures; to every logger of the Trainer, and each rank's own to
``trainer.callback_metrics`` so ``EarlyStopping``/``ModelCheckpoint`` can monitor them):

+-------------------------------------+---------------------------------------------------------+
| Key                                 | Meaning                                                 |
+=====================================+=========================================================+
| ``gpuopt/data_wait_fraction``       | share of step time spent waiting for the next batch     |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/transfer_fraction``        | share of step time copying the batch to the device      |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/compute_fraction``         | share of step time from step start to step end          |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/other_fraction``           | share of step time in hooks, logging, schedulers, ...   |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/step_time_ms``             | mean wall time of a training step (validation excluded) |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/data_wait_ms``             | mean data wait per step                                 |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/samples_per_second``       | samples trained per second on this rank                 |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/gpu_idle_fraction``        | CUDA only: share of GPU time idle between steps         |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/gpu_util``                 | NVML only: mean utilisation (%) of this rank's GPU      |
+-------------------------------------+---------------------------------------------------------+
| ``gpuopt/gpu_memory_used_fraction`` | NVML only: peak memory used / total of this rank's GPU  |
+-------------------------------------+---------------------------------------------------------+

Once, at the end of ``fit`` (``find_patterns=True``), when slow patterns were found (``report.findings``, see
:mod:`lightning_gpuopt.core.findings` for the kinds and their figures):

+----------------------------------------+------------------------------------------------------+
| Key                                    | Meaning                                              |
+========================================+======================================================+
| ``gpuopt/findings``                    | number of slow patterns found on this rank           |
+----------------------------------------+------------------------------------------------------+
| ``gpuopt/finding/<kind>/<figure>``     | each finding's measured figures (``-`` in the kind   |
|                                        | becomes ``_``: ``gpuopt/finding/host_sync/...``)     |
+----------------------------------------+------------------------------------------------------+
| ``gpuopt/dataset_read_mb_s``           | MB/s reading a sample of the training dataset's      |
|                                        | files, page cache dropped first (at most 32 files,   |
|                                        | 64 MiB, 2 s; each host's first process; logged       |
|                                        | whenever the dataset names files)                    |
+----------------------------------------+------------------------------------------------------+
| ``gpuopt/dataset_needed_mb_s``         | MB/s training consumed those files at                |
+----------------------------------------+------------------------------------------------------+
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Optional, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks import _profiler_tap
from lightning_gpuopt.callbacks._detectors import (
    Probe,
    listens_to_actions,
    make_probes,
    run_probe_findings,
    stop_probes,
)
from lightning_gpuopt.callbacks._reporting import log_metrics, report_file, write_report_section
from lightning_gpuopt.core.checks import check_bool, check_int, check_number, check_path
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.diagnosis import (
    DataWaitReport,
    RankFigures,
    RunSettings,
    Thresholds,
    build_data_wait_report,
)
from lightning_gpuopt.core.findings import findings_metrics
from lightning_gpuopt.core.loader import batch_samples, usable_cpu_count
from lightning_gpuopt.core.nvml import NvmlSampler
from lightning_gpuopt.core.report import data_wait_table, to_dict
from lightning_gpuopt.core.storage import Location, as_location
from lightning_gpuopt.core.timing import CudaStepTimer, GpuTotals, StepClock, StepTotals

#: section of ``gpuopt_report.json`` this callback writes
REPORT_SECTION = "data_wait"


class DataWaitMonitor(Callback):
    r"""Measure dataloader wait against step compute and say, with numbers, what bounds the run.

    Example::

        from lightning import Trainer
        from lightning_gpuopt import DataWaitMonitor

        monitor = DataWaitMonitor()
        trainer = Trainer(callbacks=[monitor])
        trainer.fit(model, datamodule=dm)
        monitor.report.verdict            # 'input-bound'
        monitor.report.recommendations    # ['num_workers=0 → 2 (2 usable CPU cores): ...']

    Args:
        warmup_steps: training steps at the start of ``fit`` that are not measured
            (allocator growth, cuDNN autotuning, lazy initialisation). The first step of
            every epoch is never measured as a step: the time to its batch is reported as
            loader start-up.
        log_every_n_steps: log the ``gpuopt/*`` metrics every this many measured steps;
            ``None`` follows ``Trainer(log_every_n_steps=...)``.
        nvml_interval_s: seconds between NVML samples of GPU utilisation and memory.
        data_wait_high: data wait share of a step from which the run is input-bound.
        data_wait_low: data wait share up to which the run is compute-bound.
        gpu_idle_high: GPU idle share from which the GPU counts as starved.
        host_overhead_high: on CPU, share of transfer + other host work from which the run
            is host-bound.
        straggler_slowdown: under DDP, a rank this much slower (0.2 = 20%) than the median
            of the others to reach the gradient sync is named a straggler.
        report_path: where to write the JSON report, a local path or a URL of any fsspec filesystem
            (``s3://bucket/run/report.json``); ``None`` writes ``gpuopt_report.json`` into
            ``trainer.log_dir`` (or ``default_root_dir``), a URL there too when it is one.
        verbose: log the report table with ``rank_zero_info`` (the JSON report is written either way).
        find_patterns: look for known slow patterns on a few sampled steps (``report.findings``,
            see :mod:`lightning_gpuopt.core.findings`).
    """

    def __init__(
        self,
        warmup_steps: int = 3,
        log_every_n_steps: Optional[int] = None,
        nvml_interval_s: float = 0.5,
        data_wait_high: float = 0.2,
        data_wait_low: float = 0.05,
        gpu_idle_high: float = 0.15,
        host_overhead_high: float = 0.25,
        straggler_slowdown: float = 0.2,
        report_path: Optional[str | os.PathLike] = None,
        verbose: bool = True,
        find_patterns: bool = True,
    ) -> None:
        check_int("warmup_steps", warmup_steps, 0, "warmup_steps=3")
        check_int(
            "log_every_n_steps",
            log_every_n_steps,
            1,
            "log_every_n_steps=50 (None follows the Trainer)",
            allow_none=True,
        )
        check_number("nvml_interval_s", nvml_interval_s, "nvml_interval_s=0.5", low=0, low_inclusive=False)
        check_path(
            "report_path",
            report_path,
            "report_path='logs/gpuopt_report.json' (None: the Trainer's log dir)",
            allow_none=True,
        )
        check_bool("verbose", verbose, "verbose=False")
        check_bool("find_patterns", find_patterns, "find_patterns=False")
        self.warmup_steps = warmup_steps
        self.log_every_n_steps = log_every_n_steps
        self.nvml_interval_s = float(nvml_interval_s)
        self.thresholds = Thresholds(
            data_wait_high=data_wait_high,
            data_wait_low=data_wait_low,
            gpu_idle_high=gpu_idle_high,
            host_overhead_high=host_overhead_high,
            straggler_slowdown=straggler_slowdown,
        )
        self.report_path = report_path
        self.verbose = verbose
        self.find_patterns = find_patterns
        #: the result of the last ``fit`` (on every rank); ``None`` before one ended
        self.report: Optional[DataWaitReport] = None
        #: where the JSON report was written (rank 0): a ``Path``, or a URL string for a remote log dir
        self.report_file: Optional[Location] = None
        self._clock: Optional[StepClock] = None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._tap: Optional[_profiler_tap.ProfilerTap] = None
        self._gpu: Optional[CudaStepTimer] = None
        self._gpu_logged = GpuTotals()
        self._sampler: Optional[NvmlSampler] = None
        self._nvml_uuid: Optional[str] = None
        self._settings: Optional[RunSettings] = None
        self._log_every = 50
        self._in_validation = False
        self._validation_wrapper: Any = None
        self._report_target: Optional[Location] = None
        self._probes: list[Probe] = []
        self._action_probes: list[Probe] = []
        self._steps_started = 0

    # -- set up and tear down -------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        compat.check_trainer_namespace(trainer, self)
        self._reset_run_state()
        self.report = None
        self._clock = StepClock(self.warmup_steps)
        self._probes = make_probes() if self.find_patterns else []
        self._action_probes = [probe for probe in self._probes if listens_to_actions(probe)]
        self._tap = _profiler_tap.install(
            trainer,
            {
                compat.fetch_action(trainer): self._on_fetched,
                compat.strategy_action(trainer, "batch_to_device"): self._clock.add_transfer,
                compat.strategy_action(trainer, "training_step"): self._clock.add_forward,
                compat.SAVE_CHECKPOINT_ACTION: self._on_checkpoint_saved,
            },
            any_action=self._on_action if self._action_probes else None,
        )
        self._time_validation(trainer)

    def _on_fetched(self, seconds: float, cpu_seconds: float) -> None:
        if self._clock is not None:
            self._clock.add_fetch(seconds, cpu_seconds)
        if self._gpu is not None:  # the copy to the device that follows is device work, not idle time
            self._gpu.before_transfer()

    def _on_checkpoint_saved(self, seconds: float, cpu_seconds: float) -> None:
        if self._clock is not None and not self._in_validation:
            self._clock.add_excluded("checkpoint", seconds)

    def _on_action(self, action: str, seconds: float) -> None:
        """Every profiled action (each hook call): to the probes that listen (advice never costs the run)."""
        for probe in self._action_probes:
            try:
                probe.action_timed(action, seconds, self._in_validation)
            except Exception as error:  # noqa: BLE001
                self._drop_probe(probe, error)

    def _drop_probe(self, probe: Probe, error: BaseException) -> None:
        probe.stop()
        if probe in self._probes:
            self._probes.remove(probe)
        if probe in self._action_probes:
            self._action_probes.remove(probe)
        rank_zero_warn(f"DataWaitMonitor: the {type(probe).__name__} check failed and was skipped: {error!r}")

    def _time_validation(self, trainer: Trainer) -> None:
        """Time whole validation runs inside fit (loader start-up included), sanity check excluded."""
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run = val_loop.run

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            if trainer.sanity_checking or self._clock is None or self._validation_wrapper is not timed_run:
                return run(*args, **kwargs)
            self._in_validation = True
            started = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self._in_validation = False
                self._clock.add_excluded("validation", time.perf_counter() - started)

        val_loop.run = timed_run  # type: ignore[method-assign]  # on the instance, for this fit; _restore deletes it
        self._validation_wrapper = timed_run

    def _restore(self, trainer: Trainer) -> None:
        _profiler_tap.uninstall(trainer, self._tap)
        self._tap = None
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if self._validation_wrapper is not None and vars(val_loop).get("run") is self._validation_wrapper:
            del val_loop.run
        self._validation_wrapper = None
        if self._sampler is not None:
            self._sampler.stop()
        stop_probes(self._probes)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(trainer)

    # -- measuring -------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is None:
            return
        self._settings = read_run_settings(trainer)
        # trainer.log_dir broadcasts under DDP: every rank must ask, and not only rank 0 at the end
        self._report_target = as_location(self.report_path) if self.report_path else report_file(trainer)
        # trainer.log_every_n_steps: set by Lightning's logger connector, not declared on Trainer
        self._log_every = self.log_every_n_steps or max(1, cast(Any, trainer).log_every_n_steps)
        card = device_for(pl_module.device)
        if card.is_cuda:
            self._gpu = CudaStepTimer(card.new_event)
            # every GPU (the report names idle ones); a MIG instance is only sampled when asked for by UUID
            mig = card.capabilities.mig and card.uuid
            self._sampler = NvmlSampler(self.nvml_interval_s, uuids=[card.uuid] if mig and card.uuid else None)
            if self._sampler.start():
                self._nvml_uuid = card.uuid
        self._call_probes("fit_start", trainer, pl_module)

    def _call_probes(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every probe; one that fails is dropped with a warning (advice never costs the run)."""
        for probe in list(self._probes):
            try:
                getattr(probe, hook)(*args)
            except Exception as error:  # noqa: BLE001
                self._drop_probe(probe, error)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._clock.epoch_start()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._clock is None:
            return
        self._call_probes("step_start", trainer, pl_module, batch, self._steps_started)
        start = self._clock.step_start()
        if self._gpu is not None:
            self._gpu.step_start(start)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        self._clock.step_end(self._batch_size(batch))
        if self._gpu is not None:
            self._gpu.step_end()
        self._call_probes("step_end", trainer, pl_module, batch, self._steps_started)
        self._steps_started += 1
        if self._clock.window.steps >= self._log_every:
            self._log_window(trainer, self._clock.take_window())

    def _batch_size(self, batch: Any) -> int:
        # an opaque batch object: fall back to the loader's batch size
        return batch_samples(batch) or (self._settings.batch_size if self._settings else None) or 0

    def _log_window(self, trainer: Trainer, window: StepTotals) -> None:
        if not window.steps:
            return
        metrics = {
            "gpuopt/data_wait_fraction": window.fraction(window.data_wait_s),
            "gpuopt/transfer_fraction": window.fraction(window.transfer_s),
            "gpuopt/compute_fraction": window.fraction(window.compute_s),
            "gpuopt/other_fraction": window.fraction(window.other_s),
            "gpuopt/step_time_ms": 1e3 * window.wall_s / window.steps,
            "gpuopt/data_wait_ms": 1e3 * window.data_wait_s / window.steps,
            "gpuopt/samples_per_second": window.samples_per_second,
        }
        if self._gpu is not None:
            totals = self._gpu.poll()
            metrics["gpuopt/gpu_idle_fraction"] = totals.minus(self._gpu_logged).idle_fraction
            self._gpu_logged = replace(totals)
        if self._sampler is not None and self._nvml_uuid is not None:
            util, memory = self._sampler.take_window(self._nvml_uuid)
            metrics["gpuopt/gpu_util"] = util
            metrics["gpuopt/gpu_memory_used_fraction"] = memory
        log_metrics(trainer, {key: value for key, value in metrics.items() if value is not None})

    # -- reporting -------------------------------------------------------------------------
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is None or self._settings is None:
            return
        gpu_totals = self._gpu.finish() if self._gpu is not None else GpuTotals()
        gpus = self._sampler.stop() if self._sampler is not None else []
        own_util = next((gpu.util_mean for gpu in gpus if gpu.uuid == self._nvml_uuid), None)
        clock = self._clock
        figures = RankFigures(
            rank=trainer.global_rank,
            steps=clock.totals.steps,
            samples=clock.totals.samples,
            wall_s=clock.totals.wall_s,
            data_wait_s=clock.totals.data_wait_s,
            data_wait_cpu_s=clock.totals.data_wait_cpu_s,
            transfer_s=clock.totals.transfer_s,
            compute_s=clock.totals.compute_s,
            forward_s=clock.totals.forward_s,
            validation_s=clock.excluded_s.get("validation", 0.0),
            checkpoint_s=clock.excluded_s.get("checkpoint", 0.0),
            worker_startup_s=sum(clock.worker_startup_s),
            gpu_busy_s=gpu_totals.busy_s,
            gpu_idle_s=gpu_totals.idle_s,
            gpu_util_mean=own_util,
        )
        ranks = gather_rank_figures(trainer, figures, pl_module.device)
        settings = replace(self._settings, epochs=clock.epochs_seen, worker_startup_s=list(clock.worker_startup_s))
        self.report = build_data_wait_report(
            ranks,
            settings,
            self.thresholds,
            gpus,
            warmup_steps=self.warmup_steps,
            device=device_for(pl_module.device).describe(),
        )
        self.report.timeline = clock.timeline(self._gpu.idle_series if self._gpu is not None else None)
        stop_probes(self._probes)
        for probe in self._probes:
            probe.report = self.report
        self.report.findings = run_probe_findings(self._probes, trainer, pl_module, rank_zero_warn)
        if self.report.findings:
            log_metrics(trainer, findings_metrics(self.report.findings))
        if self.report.steps == 0:
            rank_zero_warn(
                f"DataWaitMonitor measured no training step: the run had {clock.steps_seen} step(s), of which"
                f" {self.warmup_steps} warm-up and the first of each epoch are not measured. Train longer or lower"
                " `warmup_steps`."
            )
        if trainer.is_global_zero:
            if self.verbose:
                rank_zero_info(data_wait_table(self.report))
            target = cast(Location, self._report_target)  # set in on_train_start
            self.report_file = write_report_section(target, REPORT_SECTION, to_dict(self.report))
            if self.verbose and self.report_file is not None:
                rank_zero_info(f"gpuopt: report written to {self.report_file}")


def gather_rank_figures(trainer: Trainer, figures: RankFigures, device: torch.device) -> list[RankFigures]:
    """Every rank's figures, on every rank (one all-gather; a no-op on a single device)."""
    dtype = torch.float32 if device.type == "mps" else torch.float64
    vector = torch.tensor(figures.to_vector(), dtype=dtype, device=device)
    gathered = trainer.strategy.all_gather(vector)
    if gathered.dim() == 1:
        gathered = gathered.unsqueeze(0)
    return [RankFigures.from_vector(row) for row in gathered.detach().cpu().double().tolist()]


def first_dataloader(loaders: Any) -> Optional[DataLoader]:
    """The first ``DataLoader`` in what ``trainer.train_dataloader`` returns (loader or collection)."""
    if isinstance(loaders, DataLoader):
        return loaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        for item in loaders:
            found = first_dataloader(item)
            if found is not None:
                return found
    return None


def read_run_settings(trainer: Trainer) -> RunSettings:
    """The loader and run settings the recommendations compare against."""
    loader = first_dataloader(trainer.train_dataloader)
    batch_size = None
    if loader is not None:
        batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    return RunSettings(
        device_type=device_for(trainer.strategy.root_device).type,
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        persistent_workers=loader.persistent_workers if loader is not None else None,
        prefetch_factor=loader.prefetch_factor if loader is not None else None,
        batch_size=batch_size,
        usable_cpus=usable_cpu_count(),
        processes_per_host=trainer.num_devices if trainer.world_size > 1 else 1,
        precision=str(trainer.precision),
        num_devices=trainer.num_devices,
    )
