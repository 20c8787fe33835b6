"""MemoryFill: mixed precision, activation checkpointing and gradient accumulation, so memory stays full.

The user names the global batch (samples per optimizer step over all devices; by default the
batch size x ``accumulate_grad_batches`` x devices the run already has). MemoryFill decides, in
this order and from measurements:

1. **mixed precision** (in ``setup``, before the strategy wraps the model): ``bf16-mixed`` on a
   GPU with bfloat16, else ``16-mixed`` with a gradient scaler; on CPU only with ``amp=True``;
   only when the run was left at ``32-true``;
2. **activation checkpointing** on the model's repeated blocks (see
   :mod:`lightning_gpuopt.core.checkpointing`): with ``checkpointing=True`` or a list of classes
   always; with ``"auto"`` when the largest micro-batch that fits would be below
   ``min_micro_batch_size`` -- predicted in ``setup`` by the calibrated estimate (a traced step on
   fake tensors), or, when the estimate was wrong or unavailable, found by the trials in
   ``on_fit_start`` (then the blocks are checkpointed there and searched again). A HuggingFace
   model (``supports_gradient_checkpointing``) is checkpointed with its own switch
   (``activation_checkpointing_enable()``, ``use_cache`` off); other blocks with
   ``torch.utils.checkpoint``, their key/value caches cleared. Before anything trains, each group
   of blocks is checked: one step with it must give the plain step's loss, gradients and buffers
   (same RNG state, a slice of a real batch); a group that does not is refused with the reason
   (a model's own switch that fails is replaced by ours first). ``checkpointing=True`` on a model
   without repeated blocks, or whose every group is refused, raises; ``"auto"`` (the presets)
   goes on without and says so (a reason in the plan and a ``rank_zero_info`` line);
3. **the largest micro-batch** that fits, with real training steps (:class:`BatchSizeSearch`'s
   search, capped at what each rank contributes to the global batch);
4. **gradient accumulation**: ``accumulate_grad_batches = ceil(samples per rank / largest fit)``
   and the micro-batch evened out over the steps, so the effective batch stays the one asked for.

The optimizer steps once per accumulation group. When an epoch ends in a shorter group (its
batch count is not a multiple of the accumulation), Lightning still divides each loss by the
full accumulation; MemoryFill scales that group's gradients back to a mean over the micro-batches
it had. When the batch size or the accumulation changed and the model has LR schedulers, the
optimizers and schedulers are built again (``configure_optimizers``), so schedulers sized with
``trainer.estimated_stepping_batches`` count the real number of optimizer steps.

With ``on_oom="adapt"`` an out-of-memory error in a real training step (a rare long sample,
fragmentation after hours, a cap that shrinks) no longer ends the run: the same batch is trained
again as smaller micro-batches accumulated inside the step, so the optimizer update, the global
batch and the LR schedule stay the ones asked for, and that micro-batch is kept from then on for
samples of that size (see :mod:`lightning_gpuopt.callbacks._oom_recovery` for how, what it costs
and what it assumes: a loss that is a mean over the batch's samples). Each adaptation is in
``plan.oom_adaptations``, logged with ``rank_zero_warn`` and as metrics. Manual optimization
is not adapted (a warning says so; errors are raised as before).

Levers that cannot apply are refused with the reason: accumulation under manual optimization,
mixed precision and checkpointing under FSDP/DeepSpeed (they have their own), and a precision or
accumulation the user set explicitly (respected, and said so). At ``teardown``, and after an
exception, Ctrl+C or SIGTERM (``on_exception``), the Trainer and the model get their precision,
accumulation, batch size and forward methods back (every change is registered in one undo stack,
:mod:`lightning_gpuopt.callbacks._changes`); the plan stays in :attr:`MemoryFill.plan`.
Checkpoints saved during training keep the batch size the user set in their
``hyper_parameters`` (a resume with MemoryFill plans the same global batch from it). The
estimates in ``setup`` and ``on_fit_start`` draw nothing from the random generators training
reads: a run equals its plan written by hand, bit for bit.

Logged metrics, once when training starts (to every logger of the Trainer, and to
``trainer.callback_metrics`` so ``EarlyStopping``/``ModelCheckpoint`` can monitor them):

* ``gpuopt/micro_batch_size``: the batch size each step trains on.
* ``gpuopt/accumulate_grad_batches``: micro-batches per optimizer step.
* ``gpuopt/global_batch_size``: samples per optimizer step over all ranks.
* ``gpuopt/mixed_precision``: 1 when the run trains in a mixed precision, else 0.
* ``gpuopt/checkpointed_blocks``: how many blocks are checkpointed.
* ``gpuopt/fill_measured_peak_bytes``: the peak the trial of the largest fitting micro-batch measured.
* ``gpuopt/fill_predicted_peak_bytes``: the estimate's peak at the micro-batch (when it could be traced).

Logged at each out-of-memory adaptation (``on_oom="adapt"``), at the step it happened:

* ``gpuopt/oom_adaptations``: how many out-of-memory errors were absorbed so far.
* ``gpuopt/oom_micro_batch_size``: the micro-batch the failed batch was trained in (and samples of
  its size are from then on).

Rank 0 logs the plan with ``rank_zero_info`` and writes it as the ``"memory_fill"`` section of
``gpuopt_report.json`` (the search's trials go to ``"batch_size_search"``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, Literal, Optional, Sequence, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._changes import Changes, raise_failed_undos, rng_preserved, warn_failed_undos
from lightning_gpuopt.callbacks._namespace import check_trainer_namespace
from lightning_gpuopt.callbacks._oom_recovery import ON_OOM, OnOom, OomRecovery, adaptation_reporter
from lightning_gpuopt.callbacks._reporting import log_metrics, report_file, write_report_section
from lightning_gpuopt.callbacks._signals import sigterm_stops_our_work
from lightning_gpuopt.callbacks._training_step import loss_function
from lightning_gpuopt.callbacks.batch_size_search import (
    BatchSizeSearch,
    NoBatchSizeFitsError,
    TrainingStateRestored,
    first_train_loader,
    samples_per_rank,
)
from lightning_gpuopt.core.checkpointing import (
    BlockSpec,
    CheckpointedBlocks,
    check_recomputation,
    enable_checkpointing,
    enable_native_checkpointing,
    find_repeated_blocks,
    native_checkpointing_owners,
    select_blocks,
)
from lightning_gpuopt.core.checks import check_bool, check_choice, check_int
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep, host_step_context, sliced_batch
from lightning_gpuopt.core.fill import MIXED_PRECISIONS, MemoryFillPlan, choose_precision, split_global_batch
from lightning_gpuopt.core.loader import batch_samples
from lightning_gpuopt.core.report import format_bytes, render_table, to_dict

#: section of ``gpuopt_report.json`` this callback writes
REPORT_SECTION = "memory_fill"
OBJECTIVES = ("throughput", "memory")
Objective = Literal["throughput", "memory"]
_SHARDED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")
#: samples of the batch on which a checkpointed step is checked against a plain one
CHECK_SAMPLES = 2


class MemoryFill(Callback):
    r"""Keep the global batch you want and fill the memory: AMP, activation checkpointing, gradient accumulation.

    Needs what :class:`BatchSizeSearch` needs: a batch size the model, its hparams or the
    datamodule holds (``batch_arg_name``) and reads in ``train_dataloader()``.

    Example::

        from lightning import Trainer
        from lightning_gpuopt import MemoryFill

        fill = MemoryFill(global_batch_size=512, max_memory="20GiB")
        trainer = Trainer(callbacks=[fill])
        trainer.fit(model, datamodule=dm)
        fill.plan.micro_batch_size, fill.plan.accumulate_grad_batches, fill.plan.changes

    Args:
        global_batch_size: samples per optimizer step over all devices. ``None``: the run's
            batch size x ``accumulate_grad_batches`` x devices. Must divide by the device count.
        amp: mixed precision: ``"auto"`` (on GPUs), ``True`` (also on CPU, as bf16-mixed), ``False``.
        checkpointing: ``"auto"`` (when the micro-batch would fall below ``min_micro_batch_size``),
            ``True`` (the repeated blocks, always), ``False``, or a list of module classes, class
            names or qualified module names to checkpoint.
        accumulation: ``"auto"`` (as many steps as the global batch needs) or ``False`` (the
            whole global batch must fit in one step).
        max_memory: the memory a step may use: bytes, ``"20GiB"``, or a fraction of the device.
            ``None``: what the GPU has free; required on CPU (a simulated budget).
        margin: headroom: a size fits only if its peak stays within ``max_memory * (1 - margin)``.
        min_micro_batch_size: below this micro-batch ``checkpointing="auto"`` switches
            checkpointing on (capped at the samples each rank contributes).
        objective: ``"throughput"``: the largest micro-batch that fits (fewest accumulation
            steps); ``"memory"``: the smallest footprint: micro-batch ``min_micro_batch_size``,
            checkpointing on with ``"auto"``.
        batch_arg_name: where the batch size lives (model attribute, hparams key or datamodule).
        steps_per_trial: real training steps per trial of the search.
        max_trials: at most this many trials per search.
        verbose: log the plan (and the search's trials) with ``rank_zero_info``.
        on_oom: an out-of-memory error in a training step: ``"raise"`` (as without MemoryFill) or
            ``"adapt"`` (train the batch again in smaller micro-batches, keep them; see the module docstring).

    Raises:
        ValueError: an argument out of range (the message names it, its value and what works).
        MisconfigurationException: in ``setup`` for a lever that cannot apply (see the module docstring).
        NoBatchSizeFitsError: when not even a micro-batch of 1 fits with every allowed lever.
    """

    def __init__(
        self,
        global_batch_size: Optional[int] = None,
        amp: Union[Literal["auto"], bool] = "auto",
        checkpointing: Union[str, bool, Sequence[BlockSpec]] = "auto",
        accumulation: Literal["auto", False] = "auto",
        max_memory: Optional[Union[int, float, str]] = None,
        margin: float = 0.1,
        min_micro_batch_size: int = 8,
        objective: Objective = "throughput",
        batch_arg_name: str = "batch_size",
        steps_per_trial: int = 2,
        max_trials: int = 10,
        verbose: bool = True,
        on_oom: OnOom = "raise",
    ) -> None:
        check_int(
            "global_batch_size",
            global_batch_size,
            1,
            "global_batch_size=512 (or None: your batch size x accumulate_grad_batches x devices)",
            allow_none=True,
        )
        check_choice("amp", amp, ("auto", True, False), "amp='auto' (bf16-mixed / 16-mixed on GPUs, off on CPU)")
        check_choice("accumulation", accumulation, ("auto", False), "accumulation='auto' (or False: never accumulate)")
        checkpointing = _checked_checkpointing(checkpointing)
        check_int("min_micro_batch_size", min_micro_batch_size, 1, "min_micro_batch_size=8")
        check_choice(
            "objective",
            objective,
            OBJECTIVES,
            "objective='throughput' (largest micro-batch that fits) or objective='memory' (smallest footprint)",
        )
        check_bool("verbose", verbose, "verbose=False")
        check_choice(
            "on_oom",
            on_oom,
            ON_OOM,
            "on_oom='adapt' (smaller micro-batches after an out-of-memory error in training) or on_oom='raise'",
        )
        self._search_options: dict[str, Any] = dict(
            max_memory=max_memory,
            margin=margin,
            steps_per_trial=steps_per_trial,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
        )
        BatchSizeSearch(**self._search_options)
        self.global_batch_size = global_batch_size
        self.amp = amp
        self.checkpointing = checkpointing if isinstance(checkpointing, (str, bool)) else list(checkpointing)
        self.accumulation = accumulation
        self.max_memory = max_memory
        self.margin = float(margin)
        self.min_micro_batch_size = min_micro_batch_size
        self.objective = objective
        self.batch_arg_name = batch_arg_name
        self.verbose = verbose
        self.on_oom = on_oom
        #: report each batch-size trial as it ends (a line, or a bar when the Trainer shows one); follows ``verbose``
        self.progress = verbose
        #: what was decided and measured (the same on every rank); ``None`` before ``fit``
        self.plan: Optional[MemoryFillPlan] = None
        #: the search of the last ``fit`` (its ``.result`` has the trials)
        self.search: Optional[BatchSizeSearch] = None
        self._reset()

    def _reset(self) -> None:
        self._checkpointed: Optional[CheckpointedBlocks] = None
        #: every change made to the Trainer and the model, undone at teardown and on an exception
        self._changes = Changes()
        self._unchecked: list[tuple[CheckpointedBlocks, list]] = []  # groups switched on, not checked yet
        self._checkpoint_reason = ""
        self._checkpoint_handles: list[CheckpointedBlocks] = []  # every group switched on, for the undo
        self._reasons: list[str] = []
        self._started = 0.0
        self._fixed_accumulation: Optional[int] = None
        self._samples_per_rank = 0
        self._initial: dict[str, Any] = {}
        self._micro_batches_in_group = 0
        self._correct_short_groups = False
        self._oom_recovery: Optional[OomRecovery] = None

    # ------------------------------------------------------------------ setup: precision and checkpointing

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_trainer_namespace(trainer, type(self).__name__)
        self._changes.undo()  # a fit that ended without teardown or on_exception: nothing of it stays
        self._reset()
        self.plan = None
        self._started = time.perf_counter()
        self.search = BatchSizeSearch(**self._search_options, verbose=self.verbose)
        self.search.progress = self.progress
        self.search.check_usable(trainer, pl_module)
        initial_batch = int(cast(Any, lightning_getattr(pl_module, self.batch_arg_name)))  # checked usable above
        self._initial = dict(
            precision=trainer.precision, batch_size=initial_batch, accumulate=trainer.accumulate_grad_batches
        )
        self._register_undos(trainer, pl_module)
        with sigterm_stops_our_work(trainer, self._changes):
            self._plan_batch(trainer, pl_module, initial_batch)
            self._decide_precision(trainer)
            self._decide_checkpointing_early(trainer, pl_module)

    def _register_undos(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """What MemoryFill may change, registered before it changes anything: the batch size, the
        accumulation and the precision plugin go back to the values they have now."""
        name, batch_size = self.batch_arg_name, self._initial["batch_size"]
        accumulate, plugin = self._initial["accumulate"], trainer.strategy.precision_plugin
        self._changes.add("the batch size", lambda: lightning_setattr(pl_module, name, batch_size))
        self._changes.add("accumulate_grad_batches", lambda: setattr(trainer, "accumulate_grad_batches", accumulate))
        self._changes.add("the precision plugin", lambda: setattr(trainer.strategy, "precision_plugin", plugin))

    def _plan_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, initial_batch: int) -> None:
        world, accumulate = trainer.world_size, trainer.accumulate_grad_batches
        requested = self.global_batch_size or initial_batch * accumulate * world
        if requested % world:
            raise ValueError(
                f"`global_batch_size`={requested} does not divide over the {world} devices; expected "
                f"a multiple of {world}, e.g. {max(1, requested // world) * world}."
            )
        self._samples_per_rank = requested // world
        self._requested = requested
        if not pl_module.automatic_optimization and self.on_oom == "adapt":
            self._reasons.append(
                "on_oom='adapt' needs automatic optimization: out-of-memory errors are raised as before"
            )
            rank_zero_warn(
                "MemoryFill: on_oom='adapt' cannot adapt manual optimization (your training_step runs the "
                "backward and the optimizer); out-of-memory errors are raised as before."
            )
        if not pl_module.automatic_optimization:
            self._fix_accumulation(
                1,
                "manual optimization: Lightning cannot accumulate gradients for it (accumulate "
                "in your training_step); the whole global batch must fit in one step",
            )
        elif accumulate != 1:
            self._fix_accumulation(accumulate, f"accumulate_grad_batches={accumulate} was set explicitly: kept")
        elif self.accumulation is False:
            self._fix_accumulation(1, "accumulation=False: the whole global batch must fit in one step")

    def _fix_accumulation(self, steps: int, reason: str) -> None:
        if self._samples_per_rank % steps:
            raise MisconfigurationException(
                f"MemoryFill: global_batch_size={self._requested} is {self._samples_per_rank} samples per device, "
                f"which does not divide into the accumulate_grad_batches={steps} you set; pass a global_batch_size "
                f"that is a multiple of {steps * (self._requested // self._samples_per_rank)}."
            )
        self._fixed_accumulation = steps
        self._reasons.append(reason)

    def _decide_precision(self, trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        sharded = type(trainer.strategy).__name__ in _SHARDED_STRATEGIES
        if sharded and self.amp is True:
            raise MisconfigurationException(
                f"MemoryFill: amp=True cannot swap the precision plugin of {type(trainer.strategy).__name__}: it "
                "needs its own precision class. Set Trainer(precision='bf16-mixed') instead and amp=False."
            )
        if sharded and self.amp == "auto":
            self._reasons.append(f"{type(trainer.strategy).__name__}: mixed precision left to the strategy")
            return
        card = device_for(device)
        # native bfloat16 only (compute capability >= 8.0): is_bf16_supported() also counts emulation
        bf16 = card.capabilities.native_bf16 if card.is_cuda else True
        precision, reason = choose_precision(self.amp, card.type, current=str(trainer.precision), bf16_supported=bf16)
        if self.amp is not False:
            self._reasons.append(reason)
        if precision is None:
            if self.amp is True and str(trainer.precision) not in (*MIXED_PRECISIONS, "32-true"):
                rank_zero_warn(f"MemoryFill: amp=True but {reason}.")
            return
        if type(trainer.strategy.precision_plugin) is not Precision:
            raise MisconfigurationException(
                f"MemoryFill: cannot switch to {precision}: the run uses the precision plugin "
                f"{type(trainer.strategy.precision_plugin).__name__}. Pass amp=False, or set the precision yourself."
            )
        trainer.strategy.precision_plugin = MixedPrecision(precision, device=card.autocast_device_type)  # type: ignore[arg-type]

    def _decide_checkpointing_early(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checkpointing is False:
            return
        sharded = type(trainer.strategy).__name__ in _SHARDED_STRATEGIES
        if sharded:
            if self.checkpointing != "auto":
                raise MisconfigurationException(
                    f"MemoryFill: checkpointing={self.checkpointing!r} is not applied under "
                    f"{type(trainer.strategy).__name__}: use the strategy's own activation checkpointing option "
                    "and checkpointing=False."
                )
            self._reasons.append(f"{type(trainer.strategy).__name__}: activation checkpointing left to the strategy")
            self.checkpointing = False
            return
        if self.checkpointing is True or isinstance(self.checkpointing, list):
            blocks = (
                find_repeated_blocks(pl_module)
                if self.checkpointing is True
                else select_blocks(pl_module, self.checkpointing)
            )
            if not blocks:
                raise MisconfigurationException(_no_blocks_message(pl_module))
            self._apply_checkpointing(pl_module, blocks, f"checkpointing={self.checkpointing!r}")
            return
        blocks = find_repeated_blocks(pl_module)
        if not blocks:
            self._fall_back(
                f"no repeated blocks to checkpoint in {type(pl_module).__name__} (pass checkpointing="
                "[classes] to choose some)",
                loud=self.objective == "memory",
            )
            return
        if self.objective == "memory":
            self._apply_checkpointing(pl_module, blocks, "objective='memory': the smallest footprint")
            return
        predicted = _smallest_over_ranks(trainer, self._predicted_largest_fit(trainer, pl_module))
        wanted = self._wanted_micro()
        if predicted is not None and predicted < wanted:  # every rank checkpoints, or none
            ranks = " (the tightest rank's)" if trainer.world_size > 1 else ""
            self._apply_checkpointing(
                pl_module,
                blocks,
                f"the estimate predicts a largest micro-batch of {predicted}{ranks} < {wanted} without it",
            )

    def _wanted_micro(self) -> int:
        """The micro-batch below which checkpointing pays: ``min_micro_batch_size``, at most what is needed."""
        needed = self._samples_per_rank // (self._fixed_accumulation or 1)
        return min(self.min_micro_batch_size, needed) if self._fixed_accumulation is None else needed

    def _predicted_largest_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[int]:
        """The calibrated estimate's largest micro-batch, from a step traced on fake tensors (``None``
        when the step cannot be traced: the trials decide then)."""
        assert self.search is not None
        try:
            budget = self.search.budget_bytes(trainer.strategy.root_device)
            loader = compat.train_source(trainer).dataloader()
            # an iterator draws its seeds from the global RNG and the loader's generators, and the
            # traced step may draw from numpy and ``random``: training must not see either
            with rng_preserved(loader):
                batch = next(iter(loader))
                optimizers, _ = compat.init_optimizers_and_lr_schedulers(pl_module)
                step = TrainingStep(
                    pl_module,
                    batch,
                    loss_function(pl_module),
                    optimizers=optimizers if len(optimizers) == 1 else [],
                    batch_size=batch_samples(batch),
                    step_context=_setup_step_context(trainer, pl_module),
                    device=trainer.strategy.root_device,
                )
                estimate = StepEstimator(step).estimate(budget)
        except Exception as error:  # noqa: BLE001 - no prediction: the trials decide
            self._reasons.append(f"no estimate in setup ({type(error).__name__}: {error}); the trials decide")
            return None
        if estimate.method != "traced":
            return None
        return estimate.max_batch_size or 0

    def _apply_checkpointing(self, pl_module: pl.LightningModule, blocks: list, reason: str) -> None:
        """Switch checkpointing on for ``blocks``, in groups :meth:`_check_checkpointing` checks before
        anything trains: a model that checkpoints itself (HuggingFace) with its own switch, unless
        the user named the blocks; the other blocks one group per class with ``torch.utils.checkpoint``."""
        native = [] if isinstance(self.checkpointing, list) else native_checkpointing_owners(pl_module)
        groups: list[tuple[CheckpointedBlocks, list]] = []
        for owner_name, owner in native:
            inside = [(n, m) for n, m in blocks if not owner_name or n.startswith(owner_name + ".")]
            if not inside:
                continue
            handle = enable_native_checkpointing([(owner_name, owner)])
            if handle.names:
                groups.append((handle, inside))
                blocks = [block for block in blocks if block not in inside]
            else:  # its switch flagged no layer (an old-style model): ours on its blocks
                handle.remove()
        by_class: dict[type, list] = {}
        for name, module in blocks:
            by_class.setdefault(type(module), []).append((name, module))
        groups.extend((enable_checkpointing(members), []) for members in by_class.values())
        self._unchecked = [(handle, fallback) for handle, fallback in groups if handle.names or fallback]
        if not self._checkpoint_handles:
            self._changes.add("activation checkpointing", self._remove_checkpointing)
        self._checkpoint_handles.extend(handle for handle, _ in groups)
        self._checkpointed = CheckpointedBlocks.joined([handle for handle, _ in self._unchecked])
        self._checkpoint_reason = reason

    def _remove_checkpointing(self) -> None:
        """Every group of checkpointed blocks switched on in this fit, off (removing one twice is harmless)."""
        handles, self._checkpoint_handles, self._checkpointed = self._checkpoint_handles, [], None
        for handle in reversed(handles):
            handle.remove()

    def _check_checkpointing(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep each group of checkpointed blocks only when a step with it gives the plain step's
        loss and gradients (one step each on a slice of a real batch, same RNG state; every rank
        must agree); a model's own checkpointing that fails is replaced by ours on its blocks."""
        groups, self._unchecked = self._unchecked, []
        if not groups:
            return
        if not pl_module.automatic_optimization:
            self._keep_checked(
                [handle for handle, _ in groups], "not checked: manual optimization steps the optimizers itself"
            )
            return
        problems = self._recomputation_problems(trainer, pl_module, [handle for handle, _ in groups])
        kept, refused, retry = [], [], []
        for (handle, fallback), problem in zip(groups, problems):
            if problem is None:
                kept.append(handle)
                continue
            own_switch = handle.native
            handle.remove()
            if own_switch and fallback:  # the model's own switch failed: ours on the same blocks
                retry.append(enable_checkpointing(fallback))
                self._checkpoint_handles.append(retry[-1])
                self._reasons.append(
                    f"{handle.method or type(pl_module).__name__ + ' own checkpointing'} refused: "
                    f"{problem}; torch.utils.checkpoint on its blocks instead"
                )
            else:
                refused.append((handle, problem))
        if retry:
            others = [*kept, *retry]
            for handle, problem in zip(retry, self._recomputation_problems(trainer, pl_module, retry, others)):
                if problem is None:
                    kept.append(handle)
                else:
                    handle.remove()
                    refused.append((handle, problem))
        self._keep_checked(kept, "recomputation checked: same loss and gradients as a plain step")
        self._refuse(pl_module, refused, kept)

    def _recomputation_problems(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        groups: list[CheckpointedBlocks],
        switched_on: Optional[list[CheckpointedBlocks]] = None,
    ) -> list[Optional[str]]:
        """For each group, why a step with it alone differs from a plain step (``None``: it does not)."""
        switched_on = groups if switched_on is None else switched_on
        problems: list[Optional[str]] = []
        # parameters, buffers, gradients, RNG states (the loader's draws among them) and attributes put back
        with TrainingStateRestored(trainer, pl_module):
            try:
                try:
                    batch = trainer.strategy.batch_to_device(next(iter(first_train_loader(trainer))))
                    batch = sliced_batch(batch, batch_samples(batch), CHECK_SAMPLES)
                except Exception as error:  # noqa: BLE001 - no batch to check on: refuse with the reason
                    problems = [f"no batch to check the recomputation on ({type(error).__name__}: {error})"] * len(
                        groups
                    )
                    batch = None
                for group in groups if batch is not None else []:
                    with contextlib.ExitStack() as others:
                        for other in switched_on:
                            if other is not group:
                                others.enter_context(other.paused())
                        problems.append(
                            check_recomputation(
                                pl_module,
                                loss_function(pl_module),
                                batch,
                                group,
                                step_context=trainer.precision_plugin.train_step_context,
                            )
                        )
            finally:
                compat.reset_train_loader(trainer)
        # every rank keeps a group, or none
        agreed = [trainer.strategy.reduce_boolean_decision(problem is None, all=True) for problem in problems]
        return [
            problem if problem is not None or ok else "another rank's recomputation differs"
            for problem, ok in zip(problems, agreed)
        ]

    def _keep_checked(self, kept: list[CheckpointedBlocks], check: str) -> None:
        self._checkpointed = CheckpointedBlocks.joined(kept) if kept else None
        if self._checkpointed is None:
            return
        self._reasons.append(
            f"activation checkpointing on {len(self._checkpointed.names)} "
            f"{'/'.join(self._checkpointed.classes)} blocks ({self._checkpointed.method}; {check}): "
            f"{self._checkpoint_reason}"
        )

    def _refuse(self, pl_module: pl.LightningModule, refused: list, kept: list) -> None:
        if not refused:
            return
        for handle, problem in refused:
            self._reasons.append(
                f"activation checkpointing refused for {len(handle.names)} "
                f"{'/'.join(handle.classes)} blocks: a checkpointed step differs from a plain one "
                f"({problem})"
            )
        explicit = self.checkpointing is True or isinstance(self.checkpointing, list)
        if explicit and not kept:
            handle, problem = refused[0]
            raise MisconfigurationException(
                f"MemoryFill: checkpointing={self.checkpointing!r} on {type(pl_module).__name__}: a training step "
                f"with its {'/'.join(handle.classes)} blocks checkpointed differs from the plain step ({problem}). "
                "Pass checkpointing=[classes] naming blocks whose forward has no side effects, or "
                "checkpointing=False."
            )
        if explicit:
            rank_zero_warn(f"MemoryFill: {self._reasons[-1]}")
        else:
            rank_zero_info(f"MemoryFill: {self._reasons[-1]}")

    def _fall_back(self, reason: str, loud: bool) -> None:
        """A lever the settings asked for does not apply to this model: say so and go on without it."""
        if loud:
            reason = f"{reason}: the smallest footprint falls back to the smallest micro-batch and accumulation"
            rank_zero_info(f"MemoryFill: {reason}")
        self._reasons.append(reason)

    # ------------------------------------------------------------------ on_fit_start: micro-batch and accumulation

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with sigterm_stops_our_work(trainer, self._changes):
            self._fill(trainer, pl_module)

    def _fill(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.search is not None
        self._check_enough_samples(trainer)
        self._check_checkpointing(trainer, pl_module)
        wanted = self._wanted_micro()
        needed = self._samples_per_rank // (self._fixed_accumulation or 1)
        upper = wanted if self.objective == "memory" and self._fixed_accumulation is None else needed
        largest = self._search_largest(trainer, pl_module, upper)
        if (largest is None or largest < wanted) and self.checkpointing == "auto" and self._checkpointed is None:
            blocks = find_repeated_blocks(pl_module)
            if blocks:
                found = "no micro-batch" if largest is None else f"a largest micro-batch of {largest}"
                self._apply_checkpointing(pl_module, blocks, f"the trials found {found} < {wanted} without it")
                self._check_checkpointing(trainer, pl_module)
                if self._checkpointed is not None:
                    largest = self._search_largest(trainer, pl_module, upper)
        if largest is not None and largest < needed and self._fixed_accumulation is None:
            largest = self._search_accumulating(trainer, pl_module, largest)
        if largest is None or (self._fixed_accumulation is not None and largest < needed):
            raise NoBatchSizeFitsError(self._nothing_fits_message(largest, needed))
        if self._fixed_accumulation is not None:
            micro, accumulate = needed, self._fixed_accumulation
        else:
            micro, accumulate = split_global_batch(self._samples_per_rank, largest)
        lightning_setattr(pl_module, self.batch_arg_name, micro)
        trainer.accumulate_grad_batches = accumulate
        self._correct_short_groups = accumulate > 1 and self._fixed_accumulation is None
        compat.reset_train_loader(trainer)
        if trainer.lr_scheduler_configs and (micro, accumulate) != (
            self._initial["batch_size"],
            self._initial["accumulate"],
        ):
            trainer.strategy.setup_optimizers(trainer)  # schedulers sized by estimated_stepping_batches
            self._reasons.append("optimizers and LR schedulers built again for the new steps per epoch")
        self.plan = self._make_plan(trainer, pl_module, micro, accumulate, largest)
        self._report(trainer)

    def _check_enough_samples(self, trainer: pl.Trainer) -> None:
        """Refuse a global batch larger than the data: every optimizer step would see fewer samples than
        the plan says (5 samples a step under a "4 x 16 = 64" plan)."""
        samples = samples_per_rank(trainer)
        if samples is not None and samples < self._samples_per_rank:
            world = trainer.world_size
            raise MisconfigurationException(
                f"MemoryFill: global_batch_size={self._requested} asks {self._samples_per_rank} samples per device for "
                f"each optimizer step, but the train loader holds {samples} per device"
                f"{f' ({world} devices)' if world > 1 else ''}: every step would see {samples}. Pass a "
                f"global_batch_size of at most {samples * world}, or train on more data."
            )

    def _search_largest(self, trainer: pl.Trainer, pl_module: pl.LightningModule, upper: int) -> Optional[int]:
        assert self.search is not None
        self.search.max_batch_size = max(1, upper)
        self.search.min_batch_size = 1
        lightning_setattr(pl_module, self.batch_arg_name, self._initial["batch_size"])
        try:
            return self.search.find_batch_size(trainer, pl_module).batch_size
        except NoBatchSizeFitsError:
            return None

    def _search_accumulating(self, trainer: pl.Trainer, pl_module: pl.LightningModule, largest: int) -> Optional[int]:
        """The trials again, now accumulating: training will keep the gradients of earlier
        micro-batches alive through the next backward pass, so the trials must too (a peak
        measured accumulating 2 micro-batches is the peak of any longer accumulation)."""
        trainer.accumulate_grad_batches = 2
        try:
            accumulating = self._search_largest(trainer, pl_module, largest)
        finally:
            trainer.accumulate_grad_batches = self._initial["accumulate"]
        if accumulating != largest:
            self._reasons.append(
                f"largest micro-batch {largest} without accumulation, {accumulating} when "
                "accumulating (earlier micro-batches' gradients stay alive)"
            )
        return accumulating

    def _nothing_fits_message(self, largest: Optional[int], needed: int) -> str:
        levers = ", ".join(self._reasons) or "none"
        if largest is None:
            found = "not even a micro-batch of 1 fits"
        else:
            found = f"the largest micro-batch that fits is {largest}, but {needed} per step is needed"
        return (
            f"MemoryFill: {found} in max_memory={self.max_memory!r} (margin {self.margin}). Decisions so far: "
            f"{levers}. Allow more levers (amp=True, checkpointing=True, accumulation='auto'), a smaller "
            "global_batch_size, or more memory."
        )

    def _make_plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: int, accumulate: int, largest: int
    ) -> MemoryFillPlan:
        assert self.search is not None and self.search.result is not None
        checkpointed = self._checkpointed
        plan = MemoryFillPlan(
            precision=str(trainer.precision),
            checkpointing=checkpointed is not None,
            micro_batch_size=micro,
            accumulate_grad_batches=accumulate,
            global_batch_size=micro * accumulate * trainer.world_size,
            requested_global_batch_size=self._requested,
            world_size=trainer.world_size,
            checkpointed_modules=list(checkpointed.names) if checkpointed else [],
            checkpointed_classes=list(checkpointed.classes) if checkpointed else [],
            initial_precision=str(self._initial["precision"]),
            initial_batch_size=self._initial["batch_size"],
            initial_accumulate_grad_batches=self._initial["accumulate"],
            largest_fit=largest,
            budget_bytes=self.search.result.budget_bytes,
            predicted_peak_bytes=_predicted_peak(trainer, pl_module),
            measured_peak_bytes=self.search.result.peak_bytes,
            reasons=list(self._reasons),
            on_oom=self.on_oom,
        )
        if plan.global_batch_size != plan.requested_global_batch_size:
            plan.reasons.append(
                f"{self._samples_per_rank} samples per device do not split evenly into micro-batches "
                f"of at most {largest}: the global batch is {plan.global_batch_size}"
            )
        return replace(plan, seconds=time.perf_counter() - self._started)

    # ------------------------------------------------------------------ training: the last accumulation group

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._micro_batches_in_group += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        counted, self._micro_batches_in_group = self._micro_batches_in_group, 0
        accumulate = trainer.accumulate_grad_batches
        if not self._correct_short_groups or not 0 < counted < accumulate:
            return
        scale = accumulate / counted  # Lightning divided each loss by the full accumulation
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(scale)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._micro_batches_in_group = 0
        if self.search is not None and self.plan is not None:
            self.search.hold_memory_cap(pl_module)  # training reserves no more than the trials could
        if self.plan is not None and self.on_oom == "adapt" and pl_module.automatic_optimization:
            self._oom_recovery = OomRecovery(trainer, pl_module, adaptation_reporter(trainer, self.plan))
            self._oom_recovery.install()
        if self.plan is not None:
            log_metrics(trainer, logged_metrics(self.plan))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._micro_batches_in_group = 0

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._oom_recovery is not None:
            self._oom_recovery.zero_grad_called()

    def _remove_oom_recovery(self, trainer: pl.Trainer) -> None:
        recovery, self._oom_recovery = self._oom_recovery, None
        if recovery is not None:
            recovery.remove()
            if self.plan is not None and self.plan.oom_adaptations:
                path = report_file(trainer)
                if trainer.is_global_zero:
                    write_report_section(path, REPORT_SECTION, {**to_dict(self.plan), "changes": self.plan.changes})

    # ------------------------------------------------------------------ undoing and reporting

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """Checkpoints keep the batch size the user set (in the model's and the datamodule's
        hyperparameters), not the micro-batch: a model rebuilt from them, trained with MemoryFill
        again, plans the same global batch (written by hand, the plan's micro-batch and
        accumulation stand in the table MemoryFill logs)."""
        if self.plan is None:
            return
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            hparams = checkpoint.get(key)
            if hparams is not None and self.batch_arg_name in hparams:
                hparams[self.batch_arg_name] = self._initial["batch_size"]

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._oom_recovery is not None:
            self._oom_recovery.remove()  # no collective here: the other ranks may not be in this hook
            self._oom_recovery = None
        failed = self.search.undo_changes() if self.search is not None else []
        warn_failed_undos("MemoryFill", failed + self._changes.undo())
        self._checkpointed = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_oom_recovery(trainer)
        if stage != "fit":
            return
        failed = self.search.finish_changes() if self.search is not None else []
        failed += self._changes.finish()
        self._checkpointed = None
        raise_failed_undos("MemoryFill", failed)

    def _report(self, trainer: pl.Trainer) -> None:
        assert self.plan is not None
        path = report_file(trainer)  # a collective under DDP: asked on every rank
        if trainer.is_global_zero:
            if self.verbose:
                rank_zero_info(plan_table(self.plan))
            write_report_section(path, REPORT_SECTION, {**to_dict(self.plan), "changes": self.plan.changes})


def _setup_step_context(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The autocast of the run, acting where the module is in ``setup``: before the strategy moves
    it to a CUDA card, a CUDA autocast would do nothing to its host tensors, so the estimate would
    count float32 activations and switch checkpointing on where mixed precision alone fits."""
    if pl_module.device.type == "cpu" and trainer.strategy.root_device.type != "cpu":
        return host_step_context(str(trainer.precision))
    return trainer.strategy.precision_plugin.train_step_context


def _predicted_peak(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[int]:
    """The estimate's peak at the micro-batch now set, with every lever in place."""
    try:
        # the loader as the source gives it: Lightning's own setup of it (``setup_data``) builds an
        # iterator, which draws its seeds from the global RNG and the loader's generators
        loader = compat.train_source(trainer).dataloader()
        with rng_preserved(loader):  # the traced step may draw from numpy and ``random`` too
            batch = trainer.strategy.batch_to_device(next(iter(loader)))
            step = TrainingStep(
                pl_module,
                batch,
                loss_function(pl_module),
                optimizers=trainer.optimizers if len(trainer.optimizers) == 1 else [],
                batch_size=batch_samples(batch),
                step_context=trainer.precision_plugin.train_step_context,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
            )
            estimate = StepEstimator(step).estimate()
        return estimate.predicted_peak_bytes if estimate.method == "traced" else None
    except Exception:  # noqa: BLE001 - a prediction is optional here
        return None
    finally:
        compat.reset_train_loader(trainer)


def _smallest_over_ranks(trainer: pl.Trainer, predicted: Optional[int]) -> Optional[int]:
    """The smallest prediction over the ranks (``None``: no rank could predict)."""
    if trainer.world_size <= 1:
        return predicted
    mine = torch.tensor([-1 if predicted is None else predicted], device=trainer.strategy.root_device)
    known = [int(value) for value in trainer.strategy.all_gather(mine).flatten().tolist() if value >= 0]
    return min(known) if known else None


#: strings that mean a switch, not a module name: ``checkpointing: "true"`` is refused, not read as a class
_SWITCH_WORDS = ("true", "false", "yes", "no", "on", "off", "none", "null", "1", "0")


def _checked_checkpointing(value: Any) -> Any:
    """``"auto"``, ``True``, ``False`` or a non-empty list of module classes / class names / module
    names (one name alone becomes a list of one), else a ``ValueError`` naming the value."""
    works = (
        "'auto', True, False or a list of module classes / class names / module names, e.g. ['TransformerEncoderLayer']"
    )
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        if not value.strip() or value.strip().lower() in _SWITCH_WORDS:
            raise ValueError(
                f"`checkpointing` must be {works}, got {value!r} (a str, not a switch: write "
                "True or False without quotes)."
            )
        return [value]  # one class or module name
    if not _is_block_list(value):
        raise ValueError(f"`checkpointing` must be {works}, got {value!r}.")
    return value


def _no_blocks_message(pl_module: pl.LightningModule) -> str:
    """The refusal of ``checkpointing=True`` on a model without repeated blocks, with the classes
    that could be named instead (submodules with parameters and submodules of their own)."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    candidates = list(
        dict.fromkeys(
            type(module).__name__
            for name, module in pl_module.named_modules()
            if name
            and not isinstance(module, containers)
            and next(module.parameters(), None) is not None
            and next(module.children(), None) is not None
        )
    )
    instead = (
        f"Pass the module classes or qualified module names to checkpoint, e.g. checkpointing={candidates[:2]}, "
        if candidates
        else "It has no submodule with parameters and submodules of its own to checkpoint: "
    )
    return (
        f"MemoryFill: checkpointing=True found no repeated blocks in {type(pl_module).__name__} (same-class children "
        f"of an nn.ModuleList/nn.Sequential with parameters and submodules). {instead}or checkpointing='auto' "
        "(checkpoints the blocks it finds, else goes on without and says so), or checkpointing=False."
    )


def _is_block_list(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(v, type) or (isinstance(v, str) and v.strip() != "") for v in value)
    )


def logged_metrics(plan: MemoryFillPlan) -> dict[str, float]:
    """The metrics the callback logs for ``plan`` (see the module docstring)."""
    metrics = {
        "gpuopt/micro_batch_size": float(plan.micro_batch_size),
        "gpuopt/accumulate_grad_batches": float(plan.accumulate_grad_batches),
        "gpuopt/global_batch_size": float(plan.global_batch_size),
        "gpuopt/mixed_precision": float(plan.precision in MIXED_PRECISIONS),
        "gpuopt/checkpointed_blocks": float(len(plan.checkpointed_modules)),
    }
    if plan.measured_peak_bytes is not None:
        metrics["gpuopt/fill_measured_peak_bytes"] = float(plan.measured_peak_bytes)
    if plan.predicted_peak_bytes is not None:
        metrics["gpuopt/fill_predicted_peak_bytes"] = float(plan.predicted_peak_bytes)
    return metrics


def plan_table(plan: MemoryFillPlan) -> str:
    """The plan as a text table (rich) for ``rank_zero_info``."""
    rows = [
        (
            "precision",
            f"{plan.initial_precision} → {plan.precision}"
            if plan.precision != plan.initial_precision
            else plan.precision,
        ),
        (
            "activation checkpointing",
            f"{len(plan.checkpointed_modules)} blocks ({', '.join(plan.checkpointed_classes)})"
            if plan.checkpointing
            else "off",
        ),
        ("micro-batch", f"{plan.initial_batch_size} → {plan.micro_batch_size} (largest that fits: {plan.largest_fit})"),
        ("accumulate_grad_batches", f"{plan.initial_accumulate_grad_batches} → {plan.accumulate_grad_batches}"),
        (
            "global batch",
            f"{plan.global_batch_size} (asked: {plan.requested_global_batch_size}, "
            f"{plan.world_size} device{'s' if plan.world_size > 1 else ''})",
        ),
        ("budget", format_bytes(plan.budget_bytes)),
        (
            "peak: predicted / measured",
            f"{format_bytes(plan.predicted_peak_bytes)} / "
            f"{format_bytes(plan.measured_peak_bytes)} (at {plan.largest_fit})",
        ),
    ]
    if plan.on_oom == "adapt" or plan.oom_adaptations:
        rows.append(("on out of memory", oom_summary(plan)))
    return render_table("MemoryFill plan", rows, notes=plan.reasons)


def oom_summary(plan: MemoryFillPlan) -> str:
    """``on_oom`` and each adaptation as ``step S: old → new (why)``."""
    if not plan.oom_adaptations:
        return f"{plan.on_oom} (no out-of-memory error so far)"
    steps = "; ".join(
        f"step {a.step}: {a.old_micro_batch_size} → {a.new_micro_batch_size} ({a.reason})" for a in plan.oom_adaptations
    )
    return f"{plan.on_oom}: {len(plan.oom_adaptations)} adaptation(s): {steps}"
