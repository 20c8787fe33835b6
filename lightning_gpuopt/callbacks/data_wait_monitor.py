"""``DataWaitMonitor``: is the GPU waiting for data, or busy?

Each training step is split into data wait, transfer, compute and other host work (``core.timing``); on CUDA
device events give GPU idle time and NVML the utilisation. At the end of ``fit`` the ranks' totals are all-gathered
and every rank builds the same ``DataWaitReport`` (``core.diagnosis``); rank 0 logs it and writes it to
``gpuopt_report.json``. Steps :data:`SAMPLE_EVERY` says are timed part by part, fetch to fetch (the fetch, the copy
to the device, ``training_step``, the hooks). Off CUDA, in the others the profiler tap is out of the profiler's path
and neither batch hook is called: the clock notes the fetch's start and end (the compute is estimated from the rest
of the step): see docs/data-wait-monitor.md.

Logged every ``log_every_n_steps`` measured steps (``None``: the Trainer's, and at most once in
:data:`LOG_EVERY_S`), over the steps since the previous log (this rank's):

* ``gpuopt/data_wait_fraction`` -- share of step time spent waiting for the next batch
* ``gpuopt/transfer_fraction`` -- share of step time copying the batch to the device
* ``gpuopt/compute_fraction`` -- share of step time from step start to step end (estimated where not sampled)
* ``gpuopt/other_fraction`` -- share of step time in hooks, logging, schedulers, ...
* ``gpuopt/step_time_ms`` -- mean wall time of a training step (validation excluded)
* ``gpuopt/data_wait_ms`` -- mean data wait per step
* ``gpuopt/samples_per_second`` -- samples trained per second on this rank
* ``gpuopt/gpu_idle_fraction`` -- CUDA only: share of GPU time idle between steps
* ``gpuopt/gpu_util`` -- NVML only: mean utilisation (%) of this rank's GPU
* ``gpuopt/gpu_memory_used_fraction`` -- NVML only: peak memory used / total of this rank's GPU

Logged once, at the end of ``fit``, with ``find_patterns=True``:

* ``gpuopt/findings`` -- the number of slow patterns found on this rank, when any
* ``gpuopt/finding/<kind>/<figure>`` -- each finding's figures (:mod:`lightning_gpuopt.core.findings`)
* ``gpuopt/dataset_read_mb_s`` -- MB/s reading a sample of the training dataset's files, page cache dropped
* ``gpuopt/dataset_needed_mb_s`` -- MB/s training consumed those files at"""

from __future__ import annotations

import inspect
import math
import os
import random
import sys
import time
from dataclasses import astuple, replace
from typing import Any, Optional, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks import _profiler_tap
from lightning_gpuopt.callbacks._detect_hooks import HOOK_SAMPLE_EVERY as SAMPLE_EVERY
from lightning_gpuopt.callbacks._detect_hooks import HOOK_SAMPLED_FIRST, DatasetDisk, HookTimes
from lightning_gpuopt.callbacks._detectors import (
    PROBE_STEPS,
    HostSyncProbe,
    KeptGraphProbe,
    ModuleAndDeviceChecks,
    Probe,
    first_dataloader,
)
from lightning_gpuopt.callbacks._reporting import log_metrics, report_file, write_report_section
from lightning_gpuopt.core.checks import check_bool, check_int, check_number, check_path
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.diagnosis import DataWaitReport, RunSettings, Thresholds, data_wait_report
from lightning_gpuopt.core.loader import batch_samples, usable_cpu_count
from lightning_gpuopt.core.nvml import NvmlSampler, same_device
from lightning_gpuopt.core.report import data_wait_table, to_dict
from lightning_gpuopt.core.storage import Location, as_location
from lightning_gpuopt.core.timing import CudaStepTimer, StepClock, StepTotals

#: section of ``gpuopt_report.json`` this callback writes
REPORT_SECTION = "data_wait"
#: with the Trainer's ``log_every_n_steps``, logs are at least this many seconds apart (fast steps: fewer, wider windows)
LOG_EVERY_S = 1.0
#: the probes of ``find_patterns=True``, made fresh for every ``fit``
_PROBES = (ModuleAndDeviceChecks, HookTimes, DatasetDisk, KeptGraphProbe, HostSyncProbe)


class DataWaitMonitor(Callback):
    r"""Measure dataloader wait against step compute and say, with numbers, what bounds the run.

    Example::

        Trainer(callbacks=[monitor := DataWaitMonitor()]).fit(model, datamodule=dm)
        monitor.report.verdict, monitor.report.recommendations  # 'input-bound', ['num_workers=0 → 2 (...): ...']

    Args:
        warmup_steps: training steps at the start of ``fit`` not measured (nor is each epoch's first step).
        log_every_n_steps: log the metrics every this many measured steps; ``None``: the Trainer's.
        nvml_interval_s: seconds between NVML samples of GPU utilisation and memory.
        data_wait_high: data wait share of a step from which the run is input-bound.
        data_wait_low: data wait share up to which the run is compute-bound.
        gpu_idle_high: GPU idle share from which the GPU counts as starved.
        host_overhead_high: on CPU, share of transfer + other host work from which the run is host-bound.
        straggler_slowdown: under DDP, a rank this much slower than the median of the others is a straggler.
        report_path: the JSON report's path or fsspec URL; ``None``: ``gpuopt_report.json`` in the log dir.
        verbose: log the report table with ``rank_zero_info`` (the JSON report is written either way).
        find_patterns: look for known slow patterns on a few sampled steps (``report.findings``)."""

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
        check_int("log_every_n_steps", log_every_n_steps, 1, "log_every_n_steps=50 (None follows the Trainer)", True)
        check_number("nvml_interval_s", nvml_interval_s, "nvml_interval_s=0.5", low=0, low_inclusive=False)
        example = "report_path='logs/gpuopt_report.json' (None: the Trainer's log dir)"
        check_path("report_path", report_path, example, allow_none=True)
        check_bool("verbose", verbose, "verbose=False")
        check_bool("find_patterns", find_patterns, "find_patterns=False")
        self.warmup_steps, self.log_every_n_steps = warmup_steps, log_every_n_steps
        self.nvml_interval_s = float(nvml_interval_s)
        limits = (data_wait_high, data_wait_low, gpu_idle_high, host_overhead_high, straggler_slowdown)
        self.thresholds = Thresholds(*limits)
        self.report_path, self.verbose, self.find_patterns = report_path, verbose, find_patterns
        #: the result of the last ``fit`` (on every rank); ``None`` before one ended
        self.report: Optional[DataWaitReport] = None
        #: where rank 0 wrote the JSON report: a ``Path``, or a URL string
        self.report_file: Optional[Location] = None
        self._clock: Optional[StepClock] = None
        self._reset_run_state()
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    def _reset_run_state(self) -> None:
        self._tap: Optional[_profiler_tap.ProfilerTap] = None
        self._gpu: Optional[CudaStepTimer] = None
        self._gpu_logged = (0.0, 0.0)
        self._sampler: Optional[NvmlSampler] = None
        self._nvml_uuid: Optional[str] = None
        self._settings: Optional[RunSettings] = None
        self._log_every = self._next_log = 50
        self._last_log = (0.0, 0)  # when, and after how many steps
        self._steps_ended = self._next_log_check = self._sampled_steps = 0  # the clock's counts lag while it has notes
        self._in_validation = self._pulls = self._every_fetch = self._noting = self._step_open = False
        self._fast_left = 0  # fetch starts to come that end a noted step and start another, nothing else due
        self._plugin: Any = None  # the precision plugin whose convert_input notes a noted step's batch
        self._sampled = self._next_sampled = True
        self._wrappers: dict[Any, Any] = {}  # our functions on Lightning's objects (the validation run, the saves)
        self._report_target: Optional[Location] = None
        self._probes: list[Probe] = []
        self._action_probes: list[HookTimes] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        compat.check_trainer_namespace(trainer, self)
        self._reset_run_state()
        self.report = None
        clock = self._clock = StepClock(self.warmup_steps)
        self._probes = [probe() for probe in _PROBES] if self.find_patterns else []
        self._action_probes = [probe for probe in self._probes if isinstance(probe, HookTimes)]
        self._gaps = random.Random(0)  # between sampled steps after the first warmup_steps + HOOK_SAMPLED_FIRST
        self._next_sample = 0

        def fetched(seconds: float, cpu_seconds: float) -> None:
            clock.add_fetch(seconds, cpu_seconds)  # the step's transfer, training_step and hooks: when sampled
            sampled = self._sampled = self._next_sampled  # (a fetch the tap misses: this one and the last not)
            if self._tap is not None and self._action_probes:  # not reported to the probe until the next fetch
                hooks = self._action_probes[0]
                hooks.in_sample, self._tap.quiet = sampled, hooks.quiet_sampled if sampled else hooks.quiet
            if self._gpu is not None:  # the copy to the device that follows is device work, not idle time
                self._gpu.before_transfer()
            if not (sampled or self._pulls):  # back at the batch's end
                _profiler_tap.bypass(trainer, self._tap, out=True)

        def saved(seconds: float, cpu_seconds: float) -> None:
            clock.add_excluded("checkpoint", seconds)  # in validation too: taken out of its time below
            if self._tap is not None:  # the hook the save ran in ends after it: reported in any step
                self._tap.quiet = ()

        listeners: dict[str, _profiler_tap.Listener] = {
            compat.fetch_action(trainer): fetched,
            compat.strategy_action(trainer, "batch_to_device"): clock.add_transfer,
            compat.strategy_action(trainer, "training_step"): clock.add_forward,
            compat.SAVE_CHECKPOINT_ACTION: saved,
        }
        self._tap = _profiler_tap.install(trainer, listeners, self._on_action if self._action_probes else None)
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run, save, epoch_end = val_loop.run, trainer.save_checkpoint, trainer.fit_loop.on_advance_end

        def timed_run(*args: Any, **kwargs: Any) -> Any:  # whole validation runs in fit, loader start-up included
            if trainer.sanity_checking or self._wrappers.get((val_loop, "run")) is not timed_run:
                return run(*args, **kwargs)
            self._in_validation = True
            _profiler_tap.bypass(trainer, self._tap)  # its hooks are timed (the next fetch takes the tap out again)
            started, saved_s = time.perf_counter(), clock.excluded_s["checkpoint"]
            try:
                return run(*args, **kwargs)
            finally:
                self._in_validation = False
                saved_s = clock.excluded_s["checkpoint"] - saved_s
                clock.add_excluded("validation", time.perf_counter() - started - saved_s)

        def tapped(call: Any, saves: bool = False) -> Any:  # a save, the epoch's end hooks: the tap back in first
            def in_path(*args: Any, **kwargs: Any) -> Any:
                if self._step_open and not saves and compat.step_completed(trainer):  # the epoch's last step (not -1)
                    self._end_open_step(trainer, clock)
                unseen = _profiler_tap.bypass(trainer, self._tap)  # a step left it: the hook running began unseen
                try:
                    return call(*args, **kwargs)
                finally:
                    if saves and unseen and self._action_probes:  # the save's hook, from the stack
                        self._action_probes[0].saved_in(compat.running_hook(sys._getframe()))

            return in_path

        wrappers = ((val_loop, "run", timed_run), (trainer, "save_checkpoint", tapped(save, saves=True)))
        for owner, name, wrapper in (*wrappers, (trainer.fit_loop, compat.EPOCH_END_HOOKS, tapped(epoch_end))):
            self._wrap(owner, name, wrapper)

    def _on_action(self, action: str, seconds: float) -> None:
        for probe in self._action_probes:  # on every action the tap times: no _call_probes (a list, a getattr)
            try:
                probe.action_timed(action, seconds, self._in_validation)
            except Exception as error:  # noqa: BLE001 - advice never costs the run
                self._drop(probe, error)

    def _call_probes(self, hook: str, *args: Any) -> list[Any]:
        """Call ``hook`` on every probe and return what they return; one that fails is dropped."""
        results = []
        for probe in self._probes:  # a dropped probe leaves a new list
            try:
                results.append(getattr(probe, hook)(*args))
            except Exception as error:  # noqa: BLE001 - advice never costs the run
                self._drop(probe, error)
        return results

    def _drop(self, probe: Probe, error: Exception) -> None:
        """Stop a probe that failed and skip it from now on, with a warning (advice never costs the run)."""
        probe.stop()
        self._probes = [other for other in self._probes if other is not probe]
        self._action_probes = [other for other in self._action_probes if other is not probe]
        rank_zero_warn(f"DataWaitMonitor: the {type(probe).__name__} check failed and was skipped: {error!r}")

    def _restore(self, trainer: Trainer) -> None:
        self._batch_hooks(on=True)
        _profiler_tap.uninstall(trainer, self._tap)
        self._tap = None
        for (owner, name), wrapper in self._wrappers.items():
            if vars(owner).get(name) is wrapper:
                delattr(owner, name)
        self._wrappers = {}
        if self._sampler is not None:
            self._sampler.stop()
        for probe in self._probes:
            probe.stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is None:
            return
        loader = first_dataloader(trainer.train_dataloader)  # the loader settings the recommendations compare against
        names = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
        run = {name: getattr(loader, name) for name in names} if loader is not None else {}
        if loader is not None:
            run["batch_size"] = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        devices = trainer.num_devices
        run |= {"usable_cpus": usable_cpu_count(), "precision": str(trainer.precision), "num_devices": devices}
        run["processes_per_host"] = devices if trainer.world_size > 1 else 1
        self._settings = RunSettings(device_for(trainer.strategy.root_device).type, **run)
        # trainer.log_dir broadcasts under DDP: every rank must ask, and not only rank 0 at the end
        self._report_target = as_location(self.report_path) if self.report_path else report_file(trainer)
        # trainer.log_every_n_steps: set by Lightning's logger connector, not declared on Trainer
        self._log_every = self._next_log = self.log_every_n_steps or max(1, cast(Any, trainer).log_every_n_steps)
        self._last_log = (time.perf_counter(), 0)
        card = device_for(pl_module.device)
        if card.is_cuda:
            self._gpu = CudaStepTimer(card.new_event)
            # every GPU (the report names idle ones); a MIG instance is only sampled when asked for by UUID
            mig = card.capabilities.mig and card.uuid
            self._sampler = NvmlSampler(self.nvml_interval_s, uuids=[card.uuid] if mig and card.uuid else None)
            if self._sampler.start():
                self._nvml_uuid = card.uuid
        self._pulls = "dataloader_iter" in inspect.signature(pl_module.training_step).parameters  # fetches in it
        self._every_fetch = self._pulls or self._gpu is not None  # timed: a fetch in a step; the copy's start
        if not self._every_fetch:
            self._note_fetches(trainer, self._clock)
        self._call_probes("fit_start", trainer, pl_module)

    def _note_fetches(self, trainer: Trainer, clock: StepClock) -> None:
        """Wrap, on the instances, the training fetch's start and the batch's first use after it: in steps not
        sampled they note the step's boundary and its fetched batch (no hook of ours is called then)."""
        loop, strategy = trainer.fit_loop.epoch_loop, trainer.strategy
        before_fetch = getattr(loop, compat.BEFORE_FETCH)

        def fetch_starts() -> None:  # the hot path: a noted step ends, another starts (its batch to our convert)
            if self._fast_left and not self._noting and strategy.precision_plugin is self._plugin:
                self._fast_left -= 1
                self._steps_ended += 1
                clock.note_boundary()
                self._noting = True
                _profiler_tap.bypass(trainer, self._tap, out=True)  # where a save or validation put it back
            else:
                self._choose_fetch_start(trainer, clock, fetched)
            before_fetch()

        def fetched(convert_input: Any) -> Any:
            def convert(batch: Any) -> Any:  # also validation's: noted only just after a noted step's fetch start
                if self._noting:
                    self._noting, self._step_open = False, True
                    clock.note_fetched(self._samples(batch))
                return convert_input(batch)

            return convert

        self._wrap(loop, compat.BEFORE_FETCH, fetch_starts)

    def _choose_fetch_start(self, trainer: Trainer, clock: StepClock, fetched: Any) -> None:
        """The open step ends; the next is sampled (hooks on, the tap in) or noted (neither; ``_fast_left`` set)."""
        self._fast_left = 0
        if self._step_open:
            self._end_open_step(trainer, clock)
        elif not self._next_sampled:
            clock.note_boundary()
        self._noting = not self._next_sampled
        self._batch_hooks(on=self._next_sampled)
        _profiler_tap.bypass(trainer, self._tap, out=self._noting)
        if self._noting:
            self._plugin = trainer.precision_plugin  # where a callback swapped it, the new one's too
            if (self._plugin, "convert_input") not in self._wrappers:
                self._wrap(self._plugin, "convert_input", fetched(self._plugin.convert_input))
            # the steps that end before the next log, sampled step or probe's step take the hot path
            self._sampled, step = False, self._steps_ended
            due = [self._next_sample, self._next_log_check, *(later for later in PROBE_STEPS if later > step)]
            self._fast_left = max(0, min(due) - step - 1)

    def _end_open_step(self, trainer: Trainer, clock: StepClock) -> None:
        """The step open (noted, or sampled and past its compute) ends; after a log, the next fetch starts later."""
        self._step_open = False
        clock.note_boundary()
        if self._ended(trainer, clock, self._sampled):
            clock.note_boundary()

    def _wrap(self, owner: Any, name: str, wrapper: Any) -> None:
        setattr(owner, name, wrapper)  # on the instance; _restore deletes it
        self._wrappers[owner, name] = wrapper

    def _batch_hooks(self, on: bool) -> None:
        """Our batch hooks as the class has them, or ``None`` on the instance (Lightning then skips them)."""
        if on == ("on_train_batch_end" in vars(self)):
            for name in ("on_train_batch_start", "on_train_batch_end"):
                vars(self).pop(name) if on else setattr(self, name, None)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._clock.epoch_start()
            self._step_open, self._fast_left = False, 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._clock is None:
            return
        if self._probes and self._steps_ended in PROBE_STEPS:
            self._call_probes("step_start", trainer, pl_module, batch, self._steps_ended)
        start = self._clock.step_start()  # every step on CUDA and with dataloader_iter, else the sampled ones
        if self._gpu is not None:
            self._gpu.step_start(start)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        clock = self._clock
        if clock is None:
            return
        if not self._every_fetch:  # the step ends at the next fetch's start, as noted steps do
            clock.compute_end(self._samples(batch))
            self._step_open = True
        else:
            clock.step_end(self._samples(batch))
        if self._gpu is not None:
            self._gpu.step_end()
        if self._probes and self._steps_ended in PROBE_STEPS:
            self._call_probes("step_end", trainer, pl_module, batch, self._steps_ended)
        if self._every_fetch:
            self._ended(trainer, clock, self._sampled)
            _profiler_tap.bypass(trainer, self._tap)

    def _samples(self, batch: Any) -> int:
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch  # the common case, not recursing
        samples = first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else batch_samples(batch)
        return samples or (self._settings.batch_size if self._settings else None) or 0  # opaque: the loader's

    def _ended(self, trainer: Trainer, clock: StepClock, sampled: bool) -> bool:
        """A step ended: count it, log when due (whether it did), and choose whether the next is sampled: the first
        warmup_steps + HOOK_SAMPLED_FIRST, the probes' steps, then one in SAMPLE_EVERY at random."""
        step = self._steps_ended = self._steps_ended + 1
        self._sampled_steps += sampled
        logged = step >= self._next_log_check and self._log_when_due(trainer, clock)
        self._next_sampled = step >= self._next_sample  # the fetch to fetch of the next step is timed
        if self._next_sampled:
            always = step + 1 < self.warmup_steps + HOOK_SAMPLED_FIRST
            self._next_sample = step + (1 if always else self._gaps.randint(1, 2 * SAMPLE_EVERY - 1))
        self._next_sampled |= bool(self._probes) and step in PROBE_STEPS
        return logged

    def _log_when_due(self, trainer: Trainer, clock: StepClock) -> bool:
        """Log the window if ``log_every`` more steps were measured and, following the Trainer, :data:`LOG_EVERY_S`
        passed (whether it did; its time kept out of the steps); check again when that can first happen."""
        clock.settle()
        (logged_at, logged_after), now = self._last_log, time.perf_counter()
        wait_s = logged_at + LOG_EVERY_S - now if self.log_every_n_steps is None else 0.0
        due = clock.measured_steps >= self._next_log
        if due and wait_s <= 0:
            self._next_log = clock.measured_steps + self._log_every
            self._log_window(trainer, clock.take_window())
            self._last_log = (time.perf_counter(), self._steps_ended)
            clock.add_excluded("monitor", self._last_log[0] - now)
        step_s = (now - logged_at) / max(1, self._steps_ended - logged_after)  # a step, as the steps since the log
        steps = max(1, math.ceil(wait_s / step_s)) if due and wait_s > 0 else self._next_log - clock.measured_steps
        self._next_log_check = self._steps_ended + steps
        return due and wait_s <= 0

    def _log_window(self, trainer: Trainer, win: StepTotals) -> None:
        parts = ("data_wait", "transfer", "compute", "other")
        metrics = {f"gpuopt/{part}_fraction": win.share(getattr(win, f"{part}_s")) for part in parts}
        metrics |= {"gpuopt/step_time_ms": 1e3 * win.step_time_s, "gpuopt/data_wait_ms": 1e3 * win.data_wait_per_step_s}
        metrics["gpuopt/samples_per_second"] = win.samples_per_second
        if self._gpu is not None:
            gpu = self._gpu.poll()
            busy, idle = gpu.busy_s - self._gpu_logged[0], gpu.idle_s - self._gpu_logged[1]
            metrics["gpuopt/gpu_idle_fraction"] = idle / (busy + idle) if busy + idle > 0 else None
            self._gpu_logged = (gpu.busy_s, gpu.idle_s)
        if self._sampler is not None and self._nvml_uuid is not None:
            util, memory = self._sampler.take_window(self._nvml_uuid)
            metrics |= {"gpuopt/gpu_util": util, "gpuopt/gpu_memory_used_fraction": memory}
        log_metrics(trainer, metrics)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clock = self._clock
        if clock is None or self._settings is None:
            return
        gpu = self._gpu.finish() if self._gpu is not None else None
        gpus = self._sampler.stop() if self._sampler is not None else []
        busy, idle = (gpu.busy_s, gpu.idle_s) if gpu is not None else (0.0, 0.0)
        util = next((usage.util_mean for usage in gpus if same_device(usage.uuid, self._nvml_uuid)), None)
        own = replace(clock.totals(), gpu_busy_s=busy, gpu_idle_s=idle, gpu_util_mean=util)
        ranks = gather_totals(trainer, own, pl_module.device)
        settings = replace(self._settings, epochs=clock.epochs_seen, worker_startup_s=list(clock.worker_startup_s))
        timeline = clock.timeline(gpu.idle_series if gpu is not None else None)
        device = device_for(pl_module.device).describe()
        report = data_wait_report(ranks, settings, self.thresholds, gpus, self.warmup_steps, device, timeline)
        for probe in self._probes:
            probe.steps_seen, probe.sampled_steps = clock.steps_seen, self._sampled_steps
        self._call_probes("stop")
        findings = [finding for found in self._call_probes("findings", trainer, pl_module, report) for finding in found]
        self.report = replace(report, findings=findings)
        if findings:  # their count, and every figure of each (of several of one kind, the last one's)
            figures = [(f.kind.replace("-", "_"), name, value) for f in findings for name, value in f.figures.items()]
            metrics = {f"gpuopt/finding/{kind}/{name}": float(value) for kind, name, value in figures}
            log_metrics(trainer, {"gpuopt/findings": float(len(findings)), **metrics})
        if report.totals.steps == 0:
            rank_zero_warn(
                f"DataWaitMonitor measured no training step of {clock.steps_seen}: the first {self.warmup_steps} (warm-up)"
                " and each epoch's first are not measured. Train longer or lower `warmup_steps`."
            )
        if trainer.is_global_zero:
            if self.verbose:
                rank_zero_info(data_wait_table(self.report))
            target = cast(Location, self._report_target)  # set in on_train_start
            self.report_file = write_report_section(target, REPORT_SECTION, to_dict(self.report))
            if self.verbose and self.report_file is not None:
                rank_zero_info(f"gpuopt: report written to {self.report_file}")


def gather_totals(trainer: Trainer, totals: StepTotals, device: torch.device) -> list[StepTotals]:
    """Every rank's totals in rank order, on every rank (one all-gather; a no-op on a single device)."""
    row = [math.nan if value is None else float(value) for value in astuple(totals)]
    dtype = torch.float32 if device.type == "mps" else torch.float64
    gathered = trainer.strategy.all_gather(torch.tensor(row, dtype=dtype, device=device)).reshape(-1, len(row))
    rows = gathered.detach().cpu().double().tolist()  # each: steps, samples, the seconds in field order, the util
    ranks = [StepTotals(round(steps), round(samples), *seconds) for steps, samples, *seconds, _ in rows]
    return [replace(rank, gpu_util_mean=None if math.isnan(row[-1]) else row[-1]) for rank, row in zip(ranks, rows)]
