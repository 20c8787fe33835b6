"""MemoryFill: mixed precision, activation checkpointing and gradient accumulation, so memory stays full.

The levers in order (mixed precision in ``setup``; checkpointing, the micro-batch and accumulation in ``on_fit_start``)
are planned by :mod:`lightning_gpuopt.core.fill` and put back at teardown. See docs/memory-fill.md.

Logged once when training starts: ``gpuopt/micro_batch_size``, ``gpuopt/accumulate_grad_batches``,
``gpuopt/global_batch_size``, ``gpuopt/mixed_precision``, ``gpuopt/checkpointed_blocks``,
``gpuopt/fill_measured_peak_bytes``, ``gpuopt/fill_predicted_peak_bytes``; at each out-of-memory adaptation
``gpuopt/oom_adaptations`` and ``gpuopt/oom_micro_batch_size``. Rank 0 writes the report's ``"memory_fill"`` section."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, Literal, Optional, Sequence, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._checkpointing import BlockSpec, Checkpointing, checked_setting
from lightning_gpuopt.callbacks._engine import FitSession, Trials, Undo, signals_stop_our_work
from lightning_gpuopt.callbacks._engine.oom_recovery import ON_OOM, OnOom, OomRecovery
from lightning_gpuopt.callbacks._engine.predict import Prediction, predicted_largest_fit
from lightning_gpuopt.callbacks._engine.session import EngineCallback
from lightning_gpuopt.callbacks._engine.trials import gather_ranks
from lightning_gpuopt.callbacks._reporting import log_metrics, report_section
from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch, NoBatchSizeFitsError, check_trained_batch_size
from lightning_gpuopt.core.checks import check_bool, check_choice, check_int
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.fill import (
    LR_RULES,
    MIXED_PRECISIONS,
    FillRequest,
    MemoryFillPlan,
    NoFit,
    checked_precision,
    choose_precision,
    lr_note,
    plan_micro_batches,
)
from lightning_gpuopt.core.report import format_bytes, format_seconds, render_table, to_dict

REPORT_SECTION = "memory_fill"  #: section of ``gpuopt_report.json`` this callback writes
Objective = Literal["throughput", "memory"]
_SCHEDULE_LISTS = ("base_lrs", "max_lrs", "_last_lr")  # a schedule's learning rates, one per param group


class MemoryFill(EngineCallback):
    r"""Keep the global batch you want and fill the memory: AMP, activation checkpointing, gradient accumulation.

    Needs a batch size as :class:`BatchSizeSearch` does. Example::

        fill = MemoryFill(global_batch_size=512, max_memory="20GiB")
        Trainer(callbacks=[fill]).fit(model, datamodule=dm)
        fill.plan.micro_batch_size, fill.plan.accumulate_grad_batches, fill.plan.changes

    Args:
        global_batch_size: samples per optimizer step over all devices; must divide by their count. ``None``: the
            largest micro-batch that fits (with ``objective="memory"``: your batch x accumulation x devices).
        precision: what a ``32-true`` run switches to: ``"auto"`` (bf16-mixed / 16-mixed on GPUs, none on CPU),
            ``"16-mixed"`` or ``"bf16-mixed"`` (also on CPU), or ``None`` / ``"32-true"`` (no switch). A precision
            set on the Trainer is always kept.
        activation_checkpointing: ``"auto"``, ``True`` (the repeated blocks), ``False``, or module classes/names.
        accumulation: ``"auto"`` (as many steps as needed) or ``False`` (the global batch in one step).
        max_memory, margin, batch_arg_name, steps_per_trial, max_trials: as :class:`BatchSizeSearch`'s.
        min_micro_batch_size: below this micro-batch, ``activation_checkpointing="auto"`` switches it on.
        objective: ``"throughput"`` (the largest micro-batch) or ``"memory"`` (the smallest footprint).
        verbose: log the plan and the trials.
        on_oom: ``"raise"``, or ``"adapt"``: retrain a batch that ran out of memory in smaller micro-batches.
        scale_lr: ``"linear"`` or ``"sqrt"``: the learning rates follow the global batch's growth over yours.
    """

    def __init__(
        self,
        global_batch_size: Optional[int] = None,
        precision: Optional[str] = "auto",
        activation_checkpointing: Union[str, bool, Sequence[BlockSpec]] = "auto",
        accumulation: Literal["auto", False] = "auto",
        max_memory: Optional[Union[int, float, str]] = None,
        margin: Union[float, Literal["auto"]] = "auto",
        min_micro_batch_size: int = 8,
        objective: Objective = "throughput",
        batch_arg_name: str = "batch_size",
        steps_per_trial: int = 2,
        max_trials: int = 10,
        verbose: bool = True,
        on_oom: OnOom = "raise",
        scale_lr: Optional[Literal["linear", "sqrt"]] = None,
    ) -> None:
        check_int("global_batch_size", global_batch_size, 1, "global_batch_size=512 (or None)", allow_none=True)
        check_choice("accumulation", accumulation, ("auto", False), "accumulation='auto' (or False: never accumulate)")
        self.activation_checkpointing = checked_setting(activation_checkpointing)
        check_int("min_micro_batch_size", min_micro_batch_size, 1, "min_micro_batch_size=8")
        check_choice("objective", objective, ("throughput", "memory"), "objective='throughput' or objective='memory'")
        check_bool("verbose", verbose, "verbose=False")
        check_choice("on_oom", on_oom, ON_OOM, "on_oom='adapt' (smaller micro-batches) or on_oom='raise'")
        check_choice("scale_lr", scale_lr, (None, *LR_RULES), "scale_lr='linear', 'sqrt' or None (keep the lr)")
        self._search_options: dict[str, Any] = dict(max_memory=max_memory, margin=margin, batch_arg_name=batch_arg_name)
        self._search_options |= dict(steps_per_trial=steps_per_trial, max_trials=max_trials)
        self._search_options["margin"] = BatchSizeSearch(**self._search_options).margin  # validates them
        self.global_batch_size, self.accumulation = global_batch_size, accumulation
        self.precision = checked_precision(precision)
        self.max_memory, self.margin, self.batch_arg_name = max_memory, self._search_options["margin"], batch_arg_name
        self.min_micro_batch_size, self.objective = min_micro_batch_size, objective
        self.verbose, self.on_oom, self.scale_lr = verbose, on_oom, scale_lr
        self.progress = verbose  #: report each trial as it ends
        self.search: Optional[BatchSizeSearch] = None  #: the last fit's search (``.result`` has the trials)
        self._undo = Undo()
        self._reset()
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    def _reset(self) -> None:
        self._blocks: Optional[Checkpointing] = None
        self._request: Optional[FillRequest] = None
        self._oom_recovery: Optional[OomRecovery] = None
        self.prediction: Optional[Prediction] = None  #: the estimate of the step as the next search runs it
        self._estimate_seconds = 0.0  # the plan's estimates took
        self._reasons: list[str] = []
        self._initial: dict[str, Any] = {}
        self.plan: Optional[MemoryFillPlan] = None  #: what was decided and measured; ``None`` before ``fit``
        self._started, self._requested, self._micro_batches_in_group, self._correct_short_groups = 0.0, 0, 0, False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._started = time.perf_counter()
        self.search = BatchSizeSearch(**self._search_options, verbose=self.verbose)
        self.search.progress = self.progress
        self.search.check_usable(trainer, pl_module)
        initial = int(cast(Any, lightning_getattr(pl_module, self.batch_arg_name)))
        self._initial = dict(
            precision=trainer.precision, batch_size=initial, accumulate=trainer.accumulate_grad_batches
        )
        self._blocks = Checkpointing(pl_module, self.activation_checkpointing, self._undo, self._reasons)
        with signals_stop_our_work(trainer, self._undo):
            self._request = self._plan_request(trainer, pl_module, initial)
            self._decide_precision(trainer)
            self._blocks.decide_in_setup(self.objective)  # a sharded strategy was refused (check_trainer_namespace)

    def _plan_request(self, trainer: pl.Trainer, pl_module: pl.LightningModule, initial: int) -> FillRequest:
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        requested = self.global_batch_size or initial * accumulate * world
        if requested % world:
            raise ValueError(
                f"`global_batch_size`={requested} does not divide over the {world} devices; expected "
                f"a multiple of {world}, e.g. {max(1, requested // world) * world}."
            )
        self._requested, samples = requested, requested // world
        manual = not pl_module.automatic_optimization
        if manual and self.on_oom == "adapt":
            self._reasons.append(
                "on_oom='adapt' cannot adapt manual optimization (your training_step runs the "
                "backward and the optimizer): out-of-memory errors are raised as before"
            )
            rank_zero_warn(f"MemoryFill: {self._reasons[-1]}.")
        fixed: Optional[int] = None
        reason = "manual optimization: Lightning cannot accumulate gradients for it (accumulate in your training_step)"
        if manual:
            fixed, reason = 1, f"{reason}; the whole global batch must fit in one step"
        elif accumulate != 1:
            fixed, reason = accumulate, f"accumulate_grad_batches={accumulate} was set explicitly: kept"
        elif self.accumulation is False:
            fixed, reason = 1, "accumulation=False: the whole global batch must fit in one step"
        if fixed is not None:
            if samples % fixed:
                raise MisconfigurationException(
                    f"MemoryFill: global_batch_size={requested} is {samples} samples per device, which does not "
                    f"divide into the accumulate_grad_batches={fixed} you set; pass a global_batch_size that is a "
                    f"multiple of {fixed * world}."
                )
            self._reasons.append(reason)
        fill = self.global_batch_size is None and self.objective == "throughput"
        return FillRequest(samples, self.min_micro_batch_size, fixed, self.objective, fill=fill)

    def _decide_precision(self, trainer: pl.Trainer) -> None:
        card = device_for(trainer.strategy.root_device)
        bf16 = card.capabilities.native_bf16 if card.is_cuda else True  # is_bf16_supported counts emulation
        current, asked = str(trainer.precision), compat.precision_as_asked(trainer)
        precision, reason = choose_precision(
            self.precision, card.type, current=current, bf16_supported=bf16, asked=asked
        )
        if self.precision is not None:
            self._reasons.append(reason)
        if precision is None:
            if self.precision not in (None, "auto") and current not in (*MIXED_PRECISIONS, "32-true"):
                rank_zero_warn(f"MemoryFill: precision={self.precision!r} but {reason}.")
            return
        if type(trainer.strategy.precision_plugin) not in compat.any_namespace("plugins.precision", "Precision"):
            raise MisconfigurationException(
                f"MemoryFill: cannot switch to {precision}: the run uses the precision plugin "
                f"{type(trainer.strategy.precision_plugin).__name__}. Pass precision=None, or set the precision yourself."
            )
        mixed = compat.of_namespace(trainer, "plugins.precision", "MixedPrecision")
        self._undo.set(trainer.strategy, "precision_plugin", mixed(precision, card.autocast_device_type))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with signals_stop_our_work(trainer, self._undo):
            plan = self.decide(trainer)
            FitSession.of(trainer).apply(
                self._undo,
                batch_size=(self.batch_arg_name, plan.micro_batch_size, False),
                accumulate_grad_batches=plan.accumulate_grad_batches,
            )
            self.follow_lr(trainer, self._undo)
        self._report(trainer)

    def decide(self, trainer: pl.Trainer) -> MemoryFillPlan:
        """Measure and plan (sets :attr:`plan`); applying it is the caller's (``on_fit_start``, or GpuOpt)."""
        assert self.search is not None and self._request is not None and self._blocks is not None
        session, search, request, blocks = FitSession.of(trainer), self.search, self._request, self._blocks
        samples = session.samples_per_rank()
        if request.fill:  # as large as fits, up to the loader's samples
            request = replace(
                request, samples_per_rank=(samples or search.max_batch_size) * (request.fixed_accumulation or 1)
            )
        elif samples is not None and samples < request.samples_per_rank:
            world = trainer.world_size
            raise MisconfigurationException(
                f"MemoryFill: global_batch_size={self._requested} asks {request.samples_per_rank} samples per device "
                f"for each optimizer step, but the train loader holds {samples} per device"
                f"{f' ({world} devices)' if world > 1 else ''}: every step would see {samples}. Pass a "
                f"global_batch_size of at most {samples * world}, or train on more data."
            )
        blocks.check(session)

        def checkpoint(reason: str) -> bool:
            self.prediction = None  # of the step without checkpointing
            blocks.switch_on(reason)
            blocks.check(session)
            return blocks.on is not None

        if blocks.may_switch_on and request.objective == "throughput":
            mine = self._predicted(trainer)[0]
            known = [int(row[0]) for row in gather_ranks(trainer, [-1 if mine is None else mine]) if row[0] >= 0]
            if known and (predicted := min(known)) < request.wanted:  # the tightest rank's: all checkpoint, or none
                ranks = " (the tightest rank's)" if trainer.world_size > 1 else ""
                checkpoint(
                    f"the estimate predicts a largest micro-batch of {predicted}{ranks} < {request.wanted} without it"
                )
        request = replace(request, may_checkpoint=blocks.may_switch_on)
        try:
            decision = plan_micro_batches(request, functools.partial(self._largest_fit, trainer), checkpoint)
        except NoFit as missed:
            raise NoBatchSizeFitsError(self._nothing_fits_message(missed)) from None
        self._reasons.extend(decision.reasons)
        self._correct_short_groups = decision.accumulate_grad_batches > 1 and request.fixed_accumulation is None
        self.plan = self._make_plan(trainer, decision)
        if self.progress and trainer.is_global_zero:
            spent, estimates = self.plan.seconds, self._estimate_seconds
            phases = f"estimate {format_seconds(estimates)}, trials and the rest {format_seconds(spent - estimates)}"
            rank_zero_info(f"MemoryFill: planned in {format_seconds(spent)} ({phases})")
        return self.plan

    def _largest_fit(self, trainer: pl.Trainer, upper: int, accumulating: bool) -> Optional[int]:
        """The search's largest micro-batch up to ``upper``; ``accumulating``: with gradients kept across 2."""
        assert self.search is not None
        previous, start = trainer.accumulate_grad_batches, upper if accumulating else None
        prediction = Prediction(None, None, []) if accumulating else self._predicted(trainer)
        if accumulating:  # up to the largest fit without accumulation: the search starts there
            trainer.accumulate_grad_batches = 2
        try:
            return self.search.search(trainer, 1, max(1, upper), prediction, start).batch_size
        except NoBatchSizeFitsError:
            return None
        finally:
            trainer.accumulate_grad_batches = previous

    def _predicted(self, trainer: pl.Trainer) -> Prediction:
        """This rank's estimate of the step as planned so far (traced once, then shared)."""
        if self.prediction is None:
            assert self.search is not None
            budget, started = self.search.budget_bytes(trainer.strategy.root_device), time.perf_counter()
            with Trials(FitSession.of(trainer), self.search.steps_per_trial, self.batch_arg_name) as trials:
                self.prediction = predicted_largest_fit(trials, self._initial["batch_size"], budget)
            seconds = time.perf_counter() - started
            self._estimate_seconds += seconds
            if self.progress and trainer.is_global_zero:
                rank_zero_info(
                    f"MemoryFill estimate: a trace of the step predicts a largest micro-batch of "
                    f"{self.prediction.largest} ({format_seconds(seconds)})"
                )
        return self.prediction

    def _nothing_fits_message(self, missed: NoFit) -> str:
        levers = ", ".join(self._reasons) or "none"
        found = f"the largest micro-batch that fits is {missed.largest}, but {missed.needed} per step is needed"
        found = "not even a micro-batch of 1 fits" if missed.largest is None else found
        return (
            f"MemoryFill: {found} in max_memory={self.max_memory!r} (margin {self.margin}). Decisions so far: "
            f"{levers}. Allow more levers (precision='bf16-mixed', activation_checkpointing=True, accumulation='auto'), a smaller "
            "global_batch_size, or more memory."
        )

    def _make_plan(self, trainer: pl.Trainer, decision: Any) -> MemoryFillPlan:
        assert self.search is not None and self.search.result is not None and self._request is not None
        micro, accumulate, largest = decision.micro_batch_size, decision.accumulate_grad_batches, decision.largest_fit
        blocks = self._blocks.on if self._blocks is not None else None
        plan = MemoryFillPlan(
            precision=str(trainer.precision),
            checkpointing=blocks is not None,
            micro_batch_size=micro,
            accumulate_grad_batches=accumulate,
            global_batch_size=micro * accumulate * trainer.world_size,
            requested_global_batch_size=self._requested,
            world_size=trainer.world_size,
            checkpointed_modules=list(blocks.names) if blocks else [],
            checkpointed_classes=list(blocks.classes) if blocks else [],
            initial_precision=str(self._initial["precision"]),
            initial_batch_size=self._initial["batch_size"],
            initial_accumulate_grad_batches=self._initial["accumulate"],
            largest_fit=largest,
            budget_bytes=self.search.result.budget_bytes,
            predicted_peak_bytes=self.prediction.peak_bytes(micro) if self.prediction else None,
            measured_peak_bytes=self.search.result.peak_bytes,
            reasons=list(self._reasons),
            on_oom=self.on_oom,
        )
        if self._request.fill:
            plan.reasons.append(f"global_batch_size=None: the micro-batch is the largest that trained, {largest}")
        elif plan.global_batch_size != plan.requested_global_batch_size:
            plan.reasons.append(
                f"{self._request.samples_per_rank} samples per device do not split evenly into micro-batches "
                f"of at most {largest}: the global batch is {plan.global_batch_size}"
            )
        return replace(plan, seconds=time.perf_counter() - self._started)

    def follow_lr(self, trainer: pl.Trainer, undo: Undo) -> None:
        """Once the plan is applied: the learning rates follow the global batch (``scale_lr``)."""
        plan = self.plan
        assert plan is not None
        users = plan.initial_batch_size * plan.initial_accumulate_grad_batches * plan.world_size
        lrs = [float(group["lr"]) for optimizer in trainer.optimizers for group in optimizer.param_groups]
        if plan.global_batch_size != users and lrs:
            factor, note = lr_note(self.scale_lr, plan.global_batch_size / users, lrs[0])
            plan.reasons.append(note)
            if factor != 1.0:
                scale_learning_rates(trainer, factor, undo)
                plan.lr_change = (lrs[0], float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan is None or self.search is None:
            return
        check_trained_batch_size(trainer, type(self).__name__, self.batch_arg_name, self.plan.micro_batch_size)
        self.search.hold_memory_cap(pl_module)  # training reserves no more than the trials could
        if self.on_oom == "adapt" and pl_module.automatic_optimization:
            self._oom_recovery = OomRecovery(trainer, pl_module, self.plan, self._undo)
        p = self.plan
        metrics: dict[str, Optional[float]] = {"mixed_precision": p.precision in MIXED_PRECISIONS}
        metrics |= dict(micro_batch_size=p.micro_batch_size, accumulate_grad_batches=p.accumulate_grad_batches)
        metrics |= dict(global_batch_size=p.global_batch_size, checkpointed_blocks=len(p.checkpointed_modules))
        metrics["fill_measured_peak_bytes"] = p.measured_peak_bytes
        metrics["fill_predicted_peak_bytes"] = p.predicted_peak_bytes
        log_metrics(trainer, {f"gpuopt/{key}": value for key, value in metrics.items()})

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._micro_batches_in_group = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._micro_batches_in_group += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """A short last group: Lightning divided each loss by the full accumulation; scale to a mean over it."""
        counted, self._micro_batches_in_group = self._micro_batches_in_group, 0
        if self._correct_short_groups and 0 < counted < trainer.accumulate_grad_batches:
            with torch.no_grad():
                for param in (p for group in optimizer.param_groups for p in group["params"] if p.grad is not None):
                    param.grad.mul_(trainer.accumulate_grad_batches / counted)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._oom_recovery is not None:
            self._oom_recovery.zero_grad_called()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """Checkpoints keep the user's batch size, not the micro-batch."""
        if self.plan is None:
            return
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if (hparams := checkpoint.get(key)) is not None and self.batch_arg_name in hparams:
                hparams[self.batch_arg_name] = self._initial["batch_size"]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._oom_recovery is not None and self.plan is not None and self.plan.oom_adaptations:
            self._report(trainer, planned=False)
        super().teardown(trainer, pl_module, stage)

    def _release(self) -> None:
        self._oom_recovery = None
        if self.search is not None:
            self.search._release()

    def _report(self, trainer: pl.Trainer, planned: bool = True) -> None:
        """The plan's report section; ``planned``: just planned, so the last search's section and the table first."""
        assert self.plan is not None and self.search is not None
        if planned:
            self.search._report(trainer, applied=False)  # the last search's trials: the "batch_size_search" section
        table = functools.partial(plan_table, self.plan) if planned and self.verbose else None
        report_section(trainer, REPORT_SECTION, {**to_dict(self.plan), "changes": self.plan.changes}, table)


def scale_learning_rates(trainer: pl.Trainer, factor: float, undo: Undo) -> None:
    """Every learning rate of the optimizers and their schedules times ``factor``, undone by dividing them back."""
    owners: list[Any] = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
    owners += [getattr(c.scheduler, name, None) for c in trainer.lr_scheduler_configs for name in _SCHEDULE_LISTS]
    places = [(owner, key) for owner in owners if isinstance(owner, (dict, list)) for key in _keys(owner)]

    def scale(up: bool) -> None:
        for owner, key in places:
            owner[key] = owner[key] * factor if up else owner[key] / factor

    scale(True)
    undo.add("the learning rates", lambda: scale(False))


def _keys(owner: Any) -> list:
    keys = range(len(owner)) if isinstance(owner, list) else ("lr", "initial_lr", "max_lr", "min_lr")
    return [key for key in keys if isinstance(owner.get(key) if isinstance(owner, dict) else owner[key], float)]


def plan_table(plan: MemoryFillPlan) -> str:
    """The plan as a text table (rich) for ``rank_zero_info``."""
    changed = plan.precision != plan.initial_precision
    blocks = f"{len(plan.checkpointed_modules)} blocks ({', '.join(plan.checkpointed_classes)})"
    world = f"{plan.world_size} device{'s' if plan.world_size > 1 else ''}"
    peak, predicted = format_bytes(plan.measured_peak_bytes), format_bytes(plan.predicted_peak_bytes)
    rows = [
        ("precision", f"{plan.initial_precision} → {plan.precision}" if changed else plan.precision),
        ("activation checkpointing", blocks if plan.checkpointing else "off"),
        ("micro-batch", f"{plan.initial_batch_size} → {plan.micro_batch_size} (largest trained: {plan.largest_fit})"),
        ("accumulate_grad_batches", f"{plan.initial_accumulate_grad_batches} → {plan.accumulate_grad_batches}"),
        ("global batch", f"{plan.global_batch_size} (asked or yours: {plan.requested_global_batch_size}, {world})"),
        ("budget", format_bytes(plan.budget_bytes)),
        ("peak: predicted / trained", f"{predicted} at {plan.micro_batch_size} / {peak} at {plan.largest_fit} (trial)"),
    ]
    steps = [
        f"step {a.step}: {a.old_micro_batch_size} → {a.new_micro_batch_size} ({a.reason})" for a in plan.oom_adaptations
    ]
    if plan.on_oom == "adapt" or steps:  # on_oom and each adaptation
        oom = f": {len(steps)} adaptation(s): {'; '.join(steps)}" if steps else " (no out-of-memory error so far)"
        rows.append(("on out of memory", plan.on_oom + oom))
    return render_table("MemoryFill plan", rows, notes=plan.reasons)
