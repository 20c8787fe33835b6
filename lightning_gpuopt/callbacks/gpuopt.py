"""GpuOpt: one callback composed from a preset (name or YAML) plus keyword overrides.

It runs, in the hooks where each belongs and in this order:

1. :class:`MemoryFill` -- mixed precision in ``setup``, activation checkpointing, the micro-batch
   (real trials) and gradient accumulation in ``on_fit_start``;
2. :class:`DataLoaderTuner` -- in ``on_fit_start``, timed at the micro-batch MemoryFill chose, so the
   loader is tuned for the batch size that trains; both decisions are then applied at once, as a run by
   hand has them (``configure_optimizers()`` again only when the batch or the accumulation changed);
3. :class:`MemoryEstimator` -- the estimate before the first step, checked against the real
   peak of the first steps;
4. :class:`DataWaitMonitor` -- data wait vs compute, GPU idle and utilisation, the verdict.

The parts stay quiet (``verbose=False``); at the end of ``fit`` rank 0 logs one combined report
-- what was changed, then each part's figures -- and writes the ``"gpuopt"`` section of
``gpuopt_report.json`` (preset, settings, changes) beside the parts' own sections. The combined
result is :attr:`GpuOpt.report`. With ``plots=True`` it also draws the report's pictures as PNGs
beside it (:mod:`lightning_gpuopt.core.plot`) and logs them to a TensorBoard or W&B logger. Batch-size
trials and loader candidates are reported as they end (a line each, or a bar with the Trainer's
progress bar). Metrics are logged by the parts under their documented
``gpuopt/…`` keys (see each callback's module docstring).

Presets (``lightning_gpuopt/presets/*.yaml``; ``gpuopt presets`` lists them): ``diagnose``
(measure, change nothing), ``fill-memory``, ``max-throughput``, ``low-memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine import FitSession, Undo, raise_failed, signals_stop_our_work, warn_failed
from lightning_gpuopt.callbacks._engine.oom_recovery import OnOom
from lightning_gpuopt.callbacks._reporting import report_file, save_report_plots, write_report_section
from lightning_gpuopt.callbacks.data_wait_monitor import DataWaitMonitor
from lightning_gpuopt.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_gpuopt.callbacks.memory_estimator import MemoryEstimator, render_estimate
from lightning_gpuopt.callbacks.memory_fill import MemoryFill, Objective, plan_table
from lightning_gpuopt.core.checks import check_bool, check_number
from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.fill import MemoryFillPlan
from lightning_gpuopt.core.loader import LoaderTuneResult
from lightning_gpuopt.core.report import (
    batch_search_table,
    data_wait_table,
    loader_tune_table,
    render_table,
)
from lightning_gpuopt.core.search import BatchSizeSearchResult
from lightning_gpuopt.presets import check_keys, load_preset_with_sources

#: section of ``gpuopt_report.json`` GpuOpt writes
REPORT_SECTION = "gpuopt"
_FILL_KEYS = (
    "global_batch_size",
    "amp",
    "checkpointing",
    "accumulation",
    "max_memory",
    "margin",
    "min_micro_batch_size",
    "objective",
    "batch_arg_name",
    "on_oom",
)


@dataclass
class GpuOptReport:
    """Everything one ``fit`` with GpuOpt measured and changed (a part that did not run is ``None``)."""

    preset: Optional[str]
    settings: dict[str, Any]
    #: the settings GpuOpt changed, as ``"name: before → after"`` lines (empty: nothing changed)
    changes: list[str] = field(default_factory=list)
    memory_fill: Optional[MemoryFillPlan] = None
    batch_size_search: Optional[BatchSizeSearchResult] = None
    dataloader: Optional[LoaderTuneResult] = None
    memory: Optional[MemoryEstimate] = None
    data_wait: Optional[DataWaitReport] = None


class GpuOpt(Callback):
    r"""The whole checklist in one callback: a preset, plus any of its settings overridden by keyword.

    Example::

        from lightning import Trainer
        from lightning_gpuopt import GpuOpt

        trainer = Trainer(callbacks=[GpuOpt("fill-memory", global_batch_size=256)])
        trainer = Trainer(callbacks=[GpuOpt("my-team.yaml", amp=False)])   # a YAML file extending a preset
        trainer.fit(model, datamodule=dm)
        trainer.callbacks[0].report.changes

    Args:
        preset: a shipped preset (``"diagnose"``, ``"fill-memory"``, ``"max-throughput"``,
            ``"low-memory"``) or the path of a YAML file of settings (which may say
            ``preset: NAME`` to extend one). ``None``: no preset, only the settings given here.
        monitor, estimate, tune_loader, fill_memory: run DataWaitMonitor, MemoryEstimator,
            DataLoaderTuner, MemoryFill.
        max_memory, margin, global_batch_size, amp, checkpointing, accumulation, objective,
            min_micro_batch_size, batch_arg_name, on_oom: MemoryFill's arguments (``max_memory`` also
            MemoryEstimator's; ``on_oom="adapt"`` in the fill-memory, max-throughput and low-memory presets).
        loader_max_seconds: DataLoaderTuner's time budget.
        plots: at the end of ``fit``, draw the report's pictures (step time over training, memory vs
            batch size, loader settings) as PNGs beside ``gpuopt_report.json`` and log them to a
            TensorBoard or W&B logger of the Trainer; needs matplotlib (``pip install
            lightning-gpuopt[plot]``), and warns instead of failing the run when it cannot draw. ``None``
            (the default) is ``False``: drawing costs seconds (importing matplotlib), so it is asked for.

        Every setting left at ``None`` comes from the preset (or the part's own default).

    Raises:
        ValueError: an unknown preset or key (the message lists the valid ones), or a bad value
            (the part that takes it names it).
    """

    def __init__(
        self,
        preset: Optional[str] = "diagnose",
        monitor: Optional[bool] = None,
        estimate: Optional[bool] = None,
        tune_loader: Optional[bool] = None,
        fill_memory: Optional[bool] = None,
        max_memory: Optional[Union[int, float, str]] = None,
        margin: Optional[float] = None,
        global_batch_size: Optional[int] = None,
        amp: Optional[Union[bool, Literal["auto"]]] = None,
        checkpointing: Optional[Union[bool, str, list[str]]] = None,
        accumulation: Optional[Literal["auto", False]] = None,
        objective: Optional[Objective] = None,
        min_micro_batch_size: Optional[int] = None,
        batch_arg_name: Optional[str] = None,
        loader_max_seconds: Optional[float] = None,
        on_oom: Optional[OnOom] = None,
        plots: Optional[bool] = None,
    ) -> None:
        overrides = {
            key: value for key, value in locals().items() if key not in ("self", "preset", "plots", "__class__")
        }
        if plots is not None and not isinstance(plots, bool):
            raise ValueError(
                f"`plots`={plots!r} is not a bool; expected plots=True (draw PNGs at the end of fit) "
                "or plots=False (the default)."
            )
        self.plots = bool(plots)
        check_keys(overrides, source="GpuOpt's keyword arguments")
        overrides = {key: value for key, value in overrides.items() if value is not None}
        self.preset = preset
        from_preset, sources = load_preset_with_sources(preset) if preset is not None else ({}, {})
        self.settings = {**from_preset, **overrides}
        settings = self.settings
        for key, value in settings.items():  # every setting, also of the parts that do not run
            check_setting(key, value, source=None if key in overrides else sources.get(key))
        self.fill = (
            MemoryFill(**{k: settings[k] for k in _FILL_KEYS if k in settings}, verbose=False)
            if settings.get("fill_memory")
            else None
        )
        tuner_options = {"max_seconds": settings["loader_max_seconds"]} if "loader_max_seconds" in settings else {}
        self.tuner = DataLoaderTuner(**tuner_options, verbose=False) if settings.get("tune_loader") else None
        self.estimator = (
            MemoryEstimator(max_memory=settings.get("max_memory"), verbose=False) if settings.get("estimate") else None
        )
        self.monitor = DataWaitMonitor(verbose=False) if settings.get("monitor") else None
        for part in (self.fill, self.tuner):  # quiet parts (one combined report), but long work shows progress
            if part is not None:
                part.progress = True
        #: the combined result of the last ``fit``; ``None`` before one ended
        self.report: Optional[GpuOptReport] = None
        #: what GpuOpt applied for its parts (batch size, accumulation, loader settings) and the SIGINT handler
        self._undo = Undo()

    @property
    def parts(self) -> list[Callback]:
        """The callbacks GpuOpt runs, in hook order."""
        return [part for part in (self.fill, self.tuner, self.estimator, self.monitor) if part is not None]

    # ------------------------------------------------------------------ hooks with an order of their own

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
        warn_failed("GpuOpt", self._undo.undo())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Each part puts back what it changed, last part first; the first failure is raised after all ran."""
        try:
            _each_part(reversed(self.parts), "teardown", trainer, pl_module, stage)
        finally:
            FitSession.close(trainer)
            failed = self._undo.finish()
        raise_failed("GpuOpt", failed)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_fit_end(trainer, pl_module)
        self.report = self._combined_report()
        path = report_file(trainer)  # a collective under DDP: asked on every rank
        if trainer.is_global_zero:
            rank_zero_info(render_report(self.report))
            written = write_report_section(
                path, REPORT_SECTION, {"preset": self.preset, "settings": self.settings, "changes": self.report.changes}
            )
            if self.plots and written is not None:
                save_report_plots(trainer, written)

    # ------------------------------------------------------------------ hooks each part gets in turn

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_train_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for part in self.parts:
            part.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_zero_grad(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for part in self.parts:
            part.on_before_zero_grad(trainer, pl_module, optimizer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for part in self.parts:
            part.on_before_optimizer_step(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for part in self.parts:
            part.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for part in self.parts:
            part.on_save_checkpoint(trainer, pl_module, checkpoint)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_train_end(trainer, pl_module)

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


_SWITCHES = ("monitor", "estimate", "tune_loader", "fill_memory")


def check_setting(key: str, value: Any, source: Optional[Path] = None) -> None:
    """Refuse a bad value of one GpuOpt setting with the message of the part that takes it (which
    names the setting and the value), prefixed by the preset file that set it, if one did.

    Example::

        >>> check_setting("fill_memory", "false")
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
    """``part.name(*args)`` for every part, even when an earlier one raised (the first error is raised
    at the end; during ``on_exception`` a second error would hide the user's, so it is only warned)."""
    errors: list[Exception] = []
    for part in parts:
        try:
            getattr(part, name)(*args)
        except Exception as error:  # noqa: BLE001 - the other parts must still undo their changes
            errors.append(error)
    if errors and name == "on_exception":
        for failure in errors:
            rank_zero_warn(
                f"GpuOpt: a part failed to undo its changes after the failed fit: {type(failure).__name__}: {failure}"
            )
    elif errors:
        raise errors[0]


def render_report(report: GpuOptReport) -> str:
    """The combined report: what changed, then each part's table."""
    changes = report.changes or ["nothing (measured only)"]
    sections = [
        render_table(f"gpuopt · preset {report.preset} · changed", [(str(i + 1), c) for i, c in enumerate(changes)])
    ]
    if report.memory_fill is not None:
        sections.append(plan_table(report.memory_fill))
    if report.batch_size_search is not None:
        sections.append(batch_search_table(report.batch_size_search))
    if report.dataloader is not None:
        sections.append(loader_tune_table(report.dataloader, ""))
    if report.memory is not None:
        sections.append(render_estimate(report.memory))
    if report.data_wait is not None:
        sections.append(data_wait_table(report.data_wait))
    return "\n".join(sections)
