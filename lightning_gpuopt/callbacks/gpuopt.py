"""GpuOpt: one callback composed from a preset (name or YAML) plus keyword overrides.

It runs its parts quietly (MemoryFill, DataLoaderTuner, MemoryEstimator, DataWaitMonitor; each logs its own
``gpuopt/...`` metrics); at the end of ``fit`` rank 0 logs one combined report and writes the ``"gpuopt"`` section
of ``gpuopt_report.json``. See docs/gpuopt.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine import FitSession, Undo, signals_stop_our_work
from lightning_gpuopt.callbacks._engine.oom_recovery import OnOom
from lightning_gpuopt.callbacks._reporting import report_section, save_report_plots
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_gpuopt.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator, render_estimate
from lightning_gpuopt.callbacks.memory_fill import MemoryFill, Objective, plan_table
from lightning_gpuopt.core.checks import check_bool, check_number
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.fill import MemoryFillPlan
from lightning_gpuopt.core.loader import LoaderTuneResult
from lightning_gpuopt.core.report import batch_search_table, data_wait_table, loader_tune_table, render_table
from lightning_gpuopt.core.search import BatchSizeSearchResult
from lightning_gpuopt.presets import PRESET_KEYS, check_keys, load_preset_with_sources

_SWITCHES = ("monitor", "estimate", "tune_loader", "fill_memory")
_FILL_KEYS = tuple(key for key in PRESET_KEYS if key not in (*_SWITCHES, "loader_max_seconds"))  # MemoryFill's


@dataclass
class GpuOptReport:
    """Everything one ``fit`` with GpuOpt measured and changed (a part that did not run is ``None``)."""

    preset: Optional[str]
    settings: dict[str, Any]
    changes: list[str] = field(default_factory=list)  #: ``"name: before → after"`` lines (empty: nothing changed)
    memory_fill: Optional[MemoryFillPlan] = None
    batch_size_search: Optional[BatchSizeSearchResult] = None
    dataloader: Optional[LoaderTuneResult] = None
    memory: Optional[MemoryEstimate] = None
    data_wait: Optional[DataWaitReport] = None


def _to_parts(hook: str) -> Any:
    """A GpuOpt hook that calls ``hook`` of each part, in order."""

    def forward(self: GpuOpt, *args: Any) -> None:
        for part in self.parts:
            if callable(part_hook := getattr(part, hook)):  # None: skipped, as Lightning skips it
                part_hook(*args)

    forward.__name__ = forward.__qualname__ = hook
    return override(forward)


class GpuOpt(Callback):
    """The whole checklist in one callback: a preset, plus its settings overridden by keyword (``None``: the preset's).

    Example::

        trainer = Trainer(callbacks=[GpuOpt("fill-memory", global_batch_size=256)])
        trainer.fit(model, datamodule=dm)
        trainer.callbacks[0].report.changes

    Args:
        preset: a shipped preset or a YAML file of settings (``preset: NAME`` extends one); ``None``: no preset.
        monitor, estimate, tune_loader, fill_memory: run DataWaitMonitor, MemoryEstimator, DataLoaderTuner, MemoryFill.
        max_memory, margin, global_batch_size, precision, activation_checkpointing, accumulation, objective,
            min_micro_batch_size, batch_arg_name, on_oom, scale_lr: MemoryFill's (``max_memory`` also MemoryEstimator's).
        loader_max_seconds: DataLoaderTuner's time budget.
        verbose: progress lines and the combined report (``None``: ``True``; the JSON report is written either way).
        plots: draw the report's PNGs beside ``gpuopt_report.json`` at the end of ``fit`` and log them to a
            TensorBoard or W&B logger (needs the ``plot`` extra; a warning when it cannot draw).

        A setting left at ``None`` comes from the preset (or the part's default).

    Raises:
        ValueError: an unknown preset or key, or a bad value (named by the part that takes it).
    """

    def __init__(
        self,
        preset: Optional[str] = "diagnose",
        monitor: Optional[bool] = None,
        estimate: Optional[bool] = None,
        tune_loader: Optional[bool] = None,
        fill_memory: Optional[bool] = None,
        max_memory: Optional[Union[int, float, str]] = None,
        margin: Optional[Union[float, Literal["auto"]]] = None,
        global_batch_size: Optional[int] = None,
        precision: Optional[str] = None,
        activation_checkpointing: Optional[Union[bool, str, list[str]]] = None,
        accumulation: Optional[Literal["auto", False]] = None,
        objective: Optional[Objective] = None,
        min_micro_batch_size: Optional[int] = None,
        batch_arg_name: Optional[str] = None,
        loader_max_seconds: Optional[float] = None,
        on_oom: Optional[OnOom] = None,
        scale_lr: Optional[Literal["linear", "sqrt"]] = None,
        verbose: Optional[bool] = None,
        plots: Optional[bool] = None,
    ) -> None:
        overrides = {k: v for k, v in locals().items() if k not in ("self", "preset", "verbose", "plots", "__class__")}
        check_bool("verbose", verbose, "verbose=False (quiet) or verbose=True (the default)", allow_none=True)
        check_bool("plots", plots, "plots=True (draw PNGs at the end of fit) or plots=False", allow_none=True)
        self.verbose, self.plots = verbose is not False, bool(plots)
        check_keys(overrides, source="GpuOpt's keyword arguments")
        overrides = {key: value for key, value in overrides.items() if value is not None}
        self.preset = preset
        from_preset, sources = load_preset_with_sources(preset) if preset is not None else ({}, {})
        self.settings = settings = {**from_preset, **overrides}
        for key, value in settings.items():  # every setting, also of the parts that do not run
            _check_setting(key, value, source=None if key in overrides else sources.get(key))
        fill_options = {k: settings[k] for k in _FILL_KEYS if k in settings}
        self.fill = MemoryFill(**fill_options, verbose=False) if settings.get("fill_memory") else None
        tuner_options = {"max_seconds": settings["loader_max_seconds"]} if "loader_max_seconds" in settings else {}
        self.tuner = DataLoaderTuner(**tuner_options, verbose=False) if settings.get("tune_loader") else None
        estimate = settings.get("estimate")
        self.estimator = MemoryEstimator(max_memory=settings.get("max_memory"), verbose=False) if estimate else None
        self.monitor = DataWaitMonitor(verbose=False) if settings.get("monitor") else None
        for part in (self.fill, self.tuner, self.estimator):  # quiet parts, but long work shows progress
            if part is not None:
                part.progress = self.verbose
        self.report: Optional[GpuOptReport] = None  #: the combined result of the last ``fit``
        self._undo = Undo()  # what GpuOpt applied for its parts, and the SIGINT handler
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    @property
    def parts(self) -> list[Callback]:
        """The callbacks GpuOpt runs, in hook order."""
        return [part for part in (self.fill, self.tuner, self.estimator, self.monitor) if part is not None]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        compat.check_trainer_namespace(trainer, self)
        self.report = None
        if stage == "fit":
            self._undo.undo()
            FitSession.of(trainer)
        with signals_stop_our_work(trainer, self._undo):
            for part in self.parts:
                part.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """MemoryFill decides, the tuner times at its micro-batch, both are applied at once."""
        with signals_stop_our_work(trainer, self._undo):
            plan = self.fill.decide(trainer) if self.fill is not None else None
            tuned = self.tuner.decide(trainer, plan.micro_batch_size if plan else None) if self.tuner else None
            FitSession.of(trainer).apply(
                self._undo,
                batch_size=(self.fill.batch_arg_name, plan.micro_batch_size, False) if self.fill and plan else None,
                accumulate_grad_batches=plan.accumulate_grad_batches if plan else None,
                rebuild=self.tuner.rebuild if self.tuner is not None and tuned is not None else None,
            )
            if self.fill is not None:
                self.fill.follow_lr(trainer, self._undo)
        for part in self.parts:
            if part is self.fill or part is self.tuner:
                part._report(trainer)
            else:
                part.on_fit_start(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Each part undoes its changes, last part first; one that fails does not stop the others."""
        _each_part(reversed(self.parts), "on_exception", trainer, pl_module, exception)
        FitSession.close(trainer)
        self._undo.after_failure("GpuOpt")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Each part puts back what it changed, last part first; the first failure is raised after all ran."""
        try:
            _each_part(reversed(self.parts), "teardown", trainer, pl_module, stage)
        finally:
            FitSession.close(trainer)
            self._undo.after_success("GpuOpt")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_fit_end(trainer, pl_module)
        self.report = report = self._combined_report()
        section = {"preset": self.preset, "settings": self.settings, "changes": report.changes}
        written = report_section(trainer, "gpuopt", section, (lambda: render_report(report)) if self.verbose else None)
        if written is not None:
            where = "" if trainer.loggers else " (no logger: default_root_dir, where Lightning saves checkpoints)"
            rank_zero_info(f"gpuopt: report written to {written}{where}")
            if self.plots:
                save_report_plots(trainer, written)

    on_train_start = _to_parts("on_train_start")
    on_train_epoch_start = _to_parts("on_train_epoch_start")
    on_train_batch_start = _to_parts("on_train_batch_start")
    on_before_zero_grad = _to_parts("on_before_zero_grad")
    on_before_optimizer_step = _to_parts("on_before_optimizer_step")
    on_train_batch_end = _to_parts("on_train_batch_end")
    on_save_checkpoint = _to_parts("on_save_checkpoint")
    on_train_end = _to_parts("on_train_end")

    def _combined_report(self) -> GpuOptReport:
        changes = list(self.fill.plan.changes) if self.fill is not None and self.fill.plan is not None else []
        tuned = self.tuner.result if self.tuner is not None else None
        if tuned is not None and tuned.baseline is not None and tuned.setting != tuned.baseline.setting:
            changes.append(f"train loader: {tuned.baseline.setting.describe()} → {tuned.setting.describe()}")
        return GpuOptReport(
            preset=self.preset,
            settings=dict(self.settings),
            changes=changes,
            memory_fill=self.fill.plan if self.fill is not None else None,
            batch_size_search=self.fill.search.result if self.fill is not None and self.fill.search else None,
            dataloader=tuned,
            memory=self.estimator.estimate if self.estimator is not None else None,
            data_wait=self.monitor.report if self.monitor is not None else None,
        )


def _check_setting(key: str, value: Any, source: Optional[Path] = None) -> None:
    """Refuse a bad value of one setting with the message of the part that takes it (and the preset file).

    >>> _check_setting("fill_memory", "false")
    Traceback (most recent call last):
    ...
    ValueError: `fill_memory` must be True or False, got 'false' (a str); e.g. fill_memory=False.
    """
    try:
        if key in _SWITCHES:
            check_bool(key, value, f"{key}=False")
        elif key == "loader_max_seconds":
            check_number(key, value, "loader_max_seconds=10", low=0, low_inclusive=False)
        elif key == "max_memory":
            MemoryEstimator(max_memory=value, verbose=False)
        elif key in _FILL_KEYS:
            MemoryFill(**{key: value}, verbose=False)
    except (TypeError, ValueError) as error:
        if source is None:
            raise
        raise ValueError(f"in preset file {source}: {error}") from None


def _each_part(parts: Any, name: str, *args: Any) -> None:
    """``part.name(*args)`` for every part; then the first error is raised (only warned in ``on_exception``)."""
    errors: list[Exception] = []
    for part in parts:
        try:
            getattr(part, name)(*args)
        except Exception as error:  # noqa: BLE001 - the other parts must still undo their changes
            errors.append(error)
    if errors and name == "on_exception":
        for e in errors:
            rank_zero_warn(f"GpuOpt: a part failed to undo its changes after the failed fit: {type(e).__name__}: {e}")
    elif errors:
        raise errors[0]


def render_report(report: GpuOptReport) -> str:
    """The combined report: what changed, then each part's table."""
    ran = [f"{len(report.batch_size_search.trials)} batch size trial(s)"] if report.batch_size_search else []
    ran += [f"{len(report.dataloader.candidates)} loader setting(s) timed"] if report.dataloader else []
    kept = "nothing changed (measured only" + (f": {' and '.join(ran)} before training, undone)" if ran else ")")
    rows = [(str(i), change) for i, change in enumerate(report.changes or [kept], 1)]
    sections = [render_table(f"gpuopt · preset {report.preset} · changed", rows)]
    tables: list[tuple[Any, Callable[[Any], str]]] = [
        (report.memory_fill, plan_table),
        (report.batch_size_search, lambda result: batch_search_table(result, applied=False)),
        (report.dataloader, loader_tune_table),
        (report.memory, render_estimate),
        (report.data_wait, data_wait_table),
    ]
    return "\n".join(sections + [table(value) for value, table in tables if value is not None])
