"""BatchSizeSearch: the largest batch that fits, found with a handful of real training steps.

In ``on_fit_start`` (after the strategy set the model and optimizers up) the callback predicts the
largest batch from a calibrated estimate (:class:`lightning_gpuopt.core.estimate.StepEstimator`),
then runs trials -- ``steps_per_trial`` real training steps through the Trainer's fit loop,
strategy and precision plugin -- at the sizes :func:`lightning_gpuopt.core.search.search_largest_fit`
picks: probe the prediction, extrapolate from the measured peaks, bisect once a size misses. It
sets the largest size that fitted on the model, its hparams or the datamodule (wherever
``batch_arg_name`` lives), and training starts with it. A trial fits when it ran without running
out of memory and its peak stayed within ``max_memory * (1 - margin)``:

* CUDA (a real or a simulated card, through :mod:`lightning_gpuopt.core.device`): the allocator's
  own OOM, with reserved memory capped at ``max_memory`` during the trial (the per-process memory
  fraction), and the trial's peak of *reserved* memory (blocks in use and cached, the trial
  starting from an empty cache): a batch that fits by allocated bytes can still run out of
  memory on reserved ones. Peaks are measured without resetting the process-wide counters;
* CPU (and other devices): a :class:`~lightning_gpuopt.core.memory.MemoryBudget` of that size
  around the trial, counting the model, its gradients, the optimizer state, the batch and
  everything the step allocates (on CPU ``max_memory`` is required: there is no device to fill).

Everything a trial changes is restored in memory afterwards (no checkpoint file): parameters and
buffers, gradients, optimizer and LR-scheduler state, loop progress (global step, epoch), RNG
states, module attributes (lists, dicts and sets nested in them included) and train/eval modes.
During trials callbacks are detached, loggers replaced by a ``DummyLogger``, ``self.log`` is a
no-op, validation is off and the module's ``on_train_start``/``on_train_end`` are not called
(the user's code sees one fit; the step and epoch hooks run, as they may prepare the step), so
nothing outside sees a trial step. The batch size found stays set after the fit; a fit that
fails (an exception, Ctrl+C, SIGTERM) puts the user's back. A SIGTERM during the trials (before
Lightning installs its own handler) stops the trial after its step, restores everything and
ends ``fit`` with Lightning's ``SIGTERMException``, as a SIGTERM during training does.

Under DDP every rank runs each trial and the ranks agree: a size fits only if it fitted on every
rank (an all-gather of each rank's outcome), so all ranks train with the same batch size; the
sizes to try are planned with the tightest rank's budget, estimate and measured headroom. A
trial runs each rank's steps without the gradient all-reduce, the buffer broadcast and the
per-step SIGTERM broadcast (the DDP wrapper and that broadcast are bypassed for the trial), so a
rank that runs out of memory mid-step cannot leave the others waiting in a collective; the
memory DDP holds for its gradient buckets is allocated already on CUDA and is counted as
``baseline_bytes`` under a simulated budget.

Logged metrics, once when training starts (to every logger of the Trainer, and to
``trainer.callback_metrics`` so ``EarlyStopping``/``ModelCheckpoint`` can monitor them):

* ``gpuopt/batch_size``: the batch size found and set.
* ``gpuopt/batch_search_trials``: how many trials the search ran.
* ``gpuopt/batch_search_steps``: training steps the trials were given, trials x ``steps_per_trial``
  (a trial that ran out of memory stopped early, so at most this many ran).
* ``gpuopt/batch_search_seconds``: wall-clock seconds of the whole search (estimate, trials, restore).
* ``gpuopt/batch_search_peak_bytes``: the peak measured by the trial of the chosen size (the
  largest over ranks under DDP).
* ``gpuopt/batch_search_budget_bytes``: the cap every trial ran under, ``max_memory * (1 - margin)``
  (under DDP with different budgets per rank: the smallest, which the search plans with).
* ``gpuopt/batch_search_predicted``: the estimate's predicted largest batch (not logged when the
  step could not be estimated).

Rank 0 logs a table of the trials with ``rank_zero_info`` and writes the
:class:`~lightning_gpuopt.core.search.BatchSizeSearchResult` as the ``"batch_size_search"``
section of ``gpuopt_report.json`` in ``trainer.log_dir`` (``trainer.default_root_dir`` without a
logger).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Iterator, Literal, Optional, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._changes import Changes, FailedUndo, raise_failed_undos, warn_failed_undos
from lightning_gpuopt.callbacks._namespace import check_trainer_namespace
from lightning_gpuopt.callbacks._progress import WorkProgress, shows_progress_bar
from lightning_gpuopt.callbacks._reporting import log_metrics, report_file, write_report_section
from lightning_gpuopt.callbacks._signals import sigterm_stops_our_work
from lightning_gpuopt.callbacks._sources import RebuiltSource
from lightning_gpuopt.callbacks._training_step import logging_disabled, loss_function
from lightning_gpuopt.core.checks import check_bool, check_choice, check_int, check_name, check_number
from lightning_gpuopt.core.device import cuda_rng_in_use, device_for
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep, restored_attributes
from lightning_gpuopt.core.loader import TrialSampler, batch_samples, largest_samples_first
from lightning_gpuopt.core.memory import (
    MIN_MAX_MEMORY_BYTES,
    LiveTensorTracker,
    MemoryBudget,
    call_catching_oom,
    device_usable_memory,
    parse_memory,
    storage_bytes,
)
from lightning_gpuopt.core.report import (
    batch_search_table,
    format_bytes,
    format_seconds,
    to_dict,
)
from lightning_gpuopt.core.search import BatchSizeSearchResult, Trial, search_largest_fit

#: section of ``gpuopt_report.json`` this callback writes
REPORT_SECTION = "batch_size_search"
MODES = ("fill", "cap")
Mode = Literal["fill", "cap"]


class NoBatchSizeFitsError(RuntimeError):
    """Raised when even ``min_batch_size`` does not fit the budget (or no size tried fitted within
    ``max_trials``). The message says why the smallest size tried failed, with that trial's figures;
    ``result`` holds the search and its trials (``batch_size`` is ``None``) when a search ran."""

    def __init__(self, message: str, result: Optional[BatchSizeSearchResult] = None) -> None:
        super().__init__(message)
        self.result = result


class BatchSizeSearch(Callback):
    r"""Find the largest batch size that fits the memory budget with a few real training steps, and set it.

    The data must come from the model's or the datamodule's ``train_dataloader()``, reading the
    batch size from ``batch_arg_name`` (on the model, ``model.hparams`` or the datamodule), so that
    a new size gives a new loader. Validation is not run in trials (it needs less memory than
    training). The estimate, the trials and the restore run once, before the first real step.

    Example::

        from lightning import Trainer
        from lightning_gpuopt.callbacks.batch_size_search import BatchSizeSearch

        search = BatchSizeSearch(max_memory="20GiB", multiple_of=8)
        trainer = Trainer(callbacks=[search])
        trainer.fit(model, datamodule=dm)          # dm.batch_size is now the largest that fits
        search.result.batch_size, [(t.batch_size, t.fits) for t in search.result.trials]

    Args:
        max_memory: the memory a training step may use: bytes, a string such as ``"20GiB"``, or a
            fraction of the device such as ``0.9``. ``None``: on CUDA what is free plus what torch
            holds already; on CPU it is required (the budget is simulated there).
        margin: headroom: a trial fits only if its peak stays within ``max_memory * (1 - margin)``
            (fragmentation, longer sequences later, other processes).
        steps_per_trial: real training steps per trial; from the second on, gradients and optimizer
            state of the previous step are alive, as in training.
        max_trials: at most this many trials; the largest size that fitted is kept.
        min_batch_size: the smallest size to consider; if it does not fit, the search raises.
        max_batch_size: the largest size to consider (sizes are also capped at the samples each
            rank's loader holds).
        batch_arg_name: where the batch size lives: an attribute of the model, a key of
            ``model.hparams``, or an attribute of the datamodule.
        multiple_of: every size tried and returned is a multiple of this (e.g. 8 for tensor cores).
        mode: ``"fill"``: as large as fits; ``"cap"``: as large as fits but never above the batch
            size the user set.
        verbose: log the table of trials with ``rank_zero_info`` (the JSON report is written either way).

    Raises:
        ValueError: for an argument out of range (the message names it, its value and what works),
            and on CPU in ``on_fit_start`` when ``max_memory`` is ``None``.
        MisconfigurationException: in ``on_fit_start`` when the batch size cannot be found or the
            train loader does not come from ``train_dataloader()``.
        NoBatchSizeFitsError: when even ``min_batch_size`` does not fit (or no size tried fitted within
            ``max_trials``): the message says why the smallest size tried failed, in that trial's figures,
            and the error's ``result`` holds the trials.
    """

    def __init__(
        self,
        max_memory: Optional[int | float | str] = None,
        margin: float = 0.1,
        steps_per_trial: int = 2,
        max_trials: int = 10,
        min_batch_size: int = 1,
        max_batch_size: int = 2**16,
        batch_arg_name: str = "batch_size",
        multiple_of: int = 1,
        mode: Mode = "fill",
        verbose: bool = True,
    ) -> None:
        if max_memory is not None:
            parse_memory(
                max_memory, "cpu", name="max_memory", minimum=MIN_MAX_MEMORY_BYTES
            )  # validates early; a fraction is resolved later
        check_number("margin", margin, "margin=0.1 (10% headroom)", low=0, high=1, high_inclusive=False)
        check_int(
            "steps_per_trial", steps_per_trial, 1, "steps_per_trial=2, so that optimizer state exists in the trial"
        )
        check_int("max_trials", max_trials, 1, "max_trials=10")
        check_int("min_batch_size", min_batch_size, 1, "min_batch_size=1")
        check_int(
            "max_batch_size",
            max_batch_size,
            min_batch_size,
            f"max_batch_size=65536 (at least min_batch_size={min_batch_size})",
        )
        check_int("multiple_of", multiple_of, 1, "multiple_of=1 or multiple_of=8")
        if multiple_of > max_batch_size:
            raise ValueError(
                f"`multiple_of`={multiple_of} is above `max_batch_size`={max_batch_size}; "
                "expected a multiple_of <= max_batch_size."
            )
        check_name("batch_arg_name", batch_arg_name, "batch_arg_name='batch_size'")
        check_choice(
            "mode",
            mode,
            MODES,
            "mode='fill' (as large as fits) or mode='cap' (as large as fits, never above your batch size)",
        )
        check_bool("verbose", verbose, "verbose=False")
        self.max_memory = max_memory
        self.margin = float(margin)
        self.steps_per_trial = steps_per_trial
        self.max_trials = max_trials
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.batch_arg_name = batch_arg_name
        self.multiple_of = multiple_of
        self.mode = mode
        self.verbose = verbose
        #: report each trial as it ends (a line, or a bar when the Trainer shows one); follows ``verbose``
        self.progress = verbose
        #: what the search found (the same on every rank); ``None`` before ``fit``
        self.result: Optional[BatchSizeSearchResult] = None
        self._memory_cap: Any = None
        #: the batch size (kept after a fit that ended well) and the memory cap, undone on an exception
        self._changes = Changes()

    # ------------------------------------------------------------------ hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.find_batch_size(trainer, pl_module)

    def find_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BatchSizeSearchResult:
        """Run the search now, set the largest batch size that fits, and return :attr:`result`.

        What ``on_fit_start`` does; a callback that drives the search itself calls it instead of the
        hook (:class:`~lightning_gpuopt.callbacks.memory_fill.MemoryFill` searches its micro-batch
        with it, between ``min_batch_size`` and the ``max_batch_size`` it sets). It needs what
        ``on_fit_start`` has: a Trainer in ``fit`` whose strategy set the model and the optimizers up.
        Each call first undoes what an earlier call left, and registers the batch size it sets
        (kept by :meth:`finish_changes`, put back by :meth:`undo_changes`).

        Example::

            search = BatchSizeSearch(max_memory="20GiB", max_batch_size=64)
            search.find_batch_size(trainer, pl_module).batch_size   # in a hook from on_fit_start on

        Raises:
            MisconfigurationException: see :meth:`check_usable`.
            NoBatchSizeFitsError: when not even ``min_batch_size`` fits (see the class docstring).
        """
        check_trainer_namespace(trainer, type(self).__name__)
        self._changes.undo()  # a fit that ended without teardown or on_exception: nothing of it stays
        self.result = None
        self.check_usable(trainer, pl_module)
        holders, name = _batch_size_holders(pl_module, self.batch_arg_name), self.batch_arg_name
        self._changes.add("the batch size", lambda: _put_back_batch_size(holders, name), lasting=True)
        with sigterm_stops_our_work(trainer, self._changes):
            self._search(trainer, pl_module)
        assert self.result is not None
        return self.result

    def _search(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.perf_counter()
        device = pl_module.device
        capacity = self._capacity_bytes(device)  # asked once: free memory moves between two readings
        budget = int(capacity * (1.0 - self.margin))
        holders = _batch_size_holders(pl_module, self.batch_arg_name)
        bar = shows_progress_bar(trainer)  # asked before the trials take the trainer's callbacks away
        # the state is kept before anything runs: building a loader iterator draws from the global RNG
        with (
            TrainingStateRestored(trainer, pl_module) as state,
            _trial_settings(trainer, self.steps_per_trial),
            contextlib.ExitStack() as trial_batches,
        ):
            initial = _initial_batch_size(trainer, holders, self.batch_arg_name)
            upper, upper_note = self._upper_bound(trainer, initial)  # before the trials' own sampler is in place
            sizes_note = trial_batches.enter_context(_trial_batches(trainer, self.steps_per_trial))
            predicted, bytes_per_sample, notes = self._prediction(trainer, pl_module, budget)
            if sizes_note:
                notes.append(sizes_note)
            for note in notes:
                rank_zero_warn(f"BatchSizeSearch: {note}")
            start = predicted if predicted is not None else initial
            # every rank must try the same sizes: plan with the tightest rank's figures
            search_budget, start, bytes_per_sample, upper = _agree_plan(trainer, budget, start, bytes_per_sample, upper)
            runner = _TrialRunner(trainer, pl_module, state, budget, search_budget, self.batch_arg_name, capacity)
            with WorkProgress(trainer, "BatchSizeSearch trial", self.max_trials, self.progress, bar) as progress:
                result = search_largest_fit(
                    runner.fits,
                    budget_bytes=search_budget,
                    start=max(start, self.min_batch_size),
                    max_batch_size=upper,
                    min_batch_size=self.min_batch_size,
                    multiple_of=self.multiple_of,
                    max_trials=self.max_trials,
                    bytes_per_sample=bytes_per_sample,
                    on_trial=lambda trial: progress.done(trial_line(trial, search_budget)),
                )
            if result.batch_size is None:
                message = self._nothing_fits_message(runner, result)
        compat.reset_train_loader(trainer)
        result = replace(
            result,
            initial_batch_size=initial,
            predicted_batch_size=predicted,
            steps_per_trial=self.steps_per_trial,
            world_size=trainer.world_size,
            seconds=time.perf_counter() - started,
            notes=[*notes, *([upper_note] if upper_note and result.stop_reason == "upper bound" else [])],
        )
        if result.batch_size is None:
            _put_back_batch_size(holders, self.batch_arg_name)
            raise NoBatchSizeFitsError(message, result)
        lightning_setattr(pl_module, self.batch_arg_name, result.batch_size)
        self.result = result
        self._report(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold_memory_cap(pl_module)
        if self.result is not None:
            log_metrics(trainer, logged_metrics(self.result))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.release_memory_cap()
        if stage == "fit":
            raise_failed_undos("BatchSizeSearch", self.finish_changes())

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.release_memory_cap()
        warn_failed_undos("BatchSizeSearch", self.undo_changes())

    def finish_changes(self) -> list[FailedUndo]:
        """The fit ended well: keep the batch size found, put back everything else the search changed
        (the memory cap). Returns the undos that raised (``teardown`` raises them)."""
        return self._changes.finish()

    def undo_changes(self) -> list[FailedUndo]:
        """The fit failed (an exception, Ctrl+C, SIGTERM): put back everything the search changed, the
        user's batch size included. Returns the undos that raised (``on_exception`` warns of them)."""
        return self._changes.undo()

    def hold_memory_cap(self, pl_module: pl.LightningModule) -> None:
        """On a CUDA card with an explicit ``max_memory``: training may reserve at most that much
        (the caching allocator's per-process memory fraction), as the trials could; put back by
        :meth:`release_memory_cap` at teardown or on an exception."""
        self.release_memory_cap()
        card = device_for(pl_module.device)
        if self.max_memory is None or self.result is None or not card.is_cuda:
            return
        self._memory_cap = card.memory_cap(self._capacity_bytes(pl_module.device))
        self._memory_cap.start()
        self._changes.add("the memory cap", self.release_memory_cap)

    def release_memory_cap(self) -> None:
        """Lift the cap :meth:`hold_memory_cap` set (nothing to do without one)."""
        cap, self._memory_cap = self._memory_cap, None
        if cap is not None:
            cap.stop()

    # ------------------------------------------------------------------ preparing

    def check_usable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raise ``MisconfigurationException`` when the search cannot resize this fit's batches: no
        ``batch_arg_name`` on the model, its hparams or the datamodule, or a DataLoader passed to
        ``fit()`` directly. :meth:`find_batch_size` checks it first; a callback that will search later
        (:class:`~lightning_gpuopt.callbacks.memory_fill.MemoryFill`, in ``setup``) can fail early with it."""
        name = self.batch_arg_name
        if not lightning_hasattr(pl_module, name):
            raise MisconfigurationException(
                f"BatchSizeSearch: found no `{name}` on the model, in `model.hparams` or on the datamodule. Expose the "
                f"batch size there and read it in `train_dataloader()`: e.g. `self.{name} = {name}` in the "
                f"LightningModule's or LightningDataModule's `__init__` (or `self.save_hyperparameters()` with a "
                f"`{name}` argument), or pass `batch_arg_name=` with the name you use."
            )
        if not compat.train_source(trainer).is_module():
            raise MisconfigurationException(
                "BatchSizeSearch cannot resize a DataLoader passed to `fit()` directly: build it in the model's or "
                f"the datamodule's `train_dataloader()` with `batch_size=self.{name}`."
            )

    def _capacity_bytes(self, device: torch.device) -> int:
        """``max_memory`` in bytes; without one, what a CUDA card has free plus what torch holds."""
        if self.max_memory is None:
            if not device_for(device).is_cuda:
                raise ValueError(
                    f"`max_memory`=None on a {device.type} device: there is no device memory to fill; pass "
                    'max_memory (e.g. max_memory="300MB") to search under a simulated budget.'
                )
            return device_usable_memory(device)
        return parse_memory(self.max_memory, device, name="max_memory", minimum=MIN_MAX_MEMORY_BYTES)

    def budget_bytes(self, device: torch.device) -> int:
        """The bytes a trial's peak may reach on ``device``: ``max_memory`` less ``margin`` (without a
        ``max_memory``: what a CUDA card has free plus what torch holds, less ``margin``). Raises
        ``ValueError`` on a non-CUDA device without ``max_memory``.

        Example::

            >>> BatchSizeSearch(max_memory="100MB", margin=0.1).budget_bytes(torch.device("cpu"))
            90000000
        """
        return int(self._capacity_bytes(device) * (1.0 - self.margin))

    def _upper_bound(self, trainer: pl.Trainer, initial: int) -> tuple[int, str]:
        upper, note = self.max_batch_size, f"max_batch_size={self.max_batch_size}"
        if self.mode == "cap" and initial < upper:
            upper, note = initial, f"mode='cap': never above your batch size {initial}"
        samples = samples_per_rank(trainer)
        if samples == 0:
            raise MisconfigurationException(
                "BatchSizeSearch: the train loader holds no samples on this rank (an empty dataset, or fewer samples "
                "than ranks): there is no batch to try. Check the dataset `train_dataloader()` returns."
            )
        if samples is not None and samples < upper:
            upper, note = samples, f"each rank's loader holds {samples} samples"
        return max(upper, self.min_batch_size), note

    def _prediction(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, budget: int
    ) -> tuple[Optional[int], Optional[float], list[str]]:
        """The estimate's largest batch for ``budget`` and its bytes per sample, from traced steps."""
        try:
            batch = trainer.strategy.batch_to_device(next(iter(first_train_loader(trainer))))
            buckets = _ddp_bucket_bytes(trainer, pl_module)
            step = TrainingStep(
                pl_module,
                batch,
                loss_function(pl_module),
                optimizers=trainer.optimizers if len(trainer.optimizers) == 1 else [],
                batch_size=batch_samples(batch),
                step_context=trainer.precision_plugin.train_step_context,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
                untraced=[("DDP gradient buckets", buckets)] if buckets else [],
            )
            # kernel workspaces are learned once (on the host), for the estimate and the re-traces near the limit
            estimator = StepEstimator(step)
            estimate = estimator.estimate(budget)
            if estimate.method != "traced":
                return (
                    None,
                    None,
                    [
                        f"the step could not be traced on fake tensors ({estimate.not_traced_reason}); "
                        "started at your batch size"
                    ],
                )
            refined = estimator.refined(estimate)  # what no re-trace sees is counted: buckets, cuBLAS
            return refined.max_batch_size, refined.bytes_per_sample, []
        except Exception as error:  # noqa: BLE001 - without an estimate the search starts at the user's size
            return None, None, [f"no estimate ({type(error).__name__}: {error}); started at your batch size"]

    # ------------------------------------------------------------------ reporting

    def _nothing_fits_message(self, runner: _TrialRunner, result: BatchSizeSearchResult) -> str:
        """Why no size fitted: the smallest size tried, and why its trial failed in that trial's own
        figures (the ones the table of trials shows); on a simulated cap, also what a step at that
        size needs, measured again without the cap."""
        smallest = min(result.trials, key=lambda trial: trial.batch_size)
        size = smallest.batch_size
        if size <= result.lower_bound:
            headline = f"even min_batch_size={size} does not fit"
        else:
            count = len(result.trials)
            headline = (
                f"no size fitted in {count} trial{'s' if count != 1 else ''} (max_trials={self.max_trials}); "
                f"the smallest tried, {size}, does not fit"
            )
        trainer = runner.trainer
        if trainer.world_size > 1:  # each rank's own budget, cap and peak: the ranks' figures differ
            budget = f"the budget of the tightest rank, {_bytes(result.budget_bytes)}"
            why = f"its trial, rank by rank: {_why_each_rank_missed(trainer, runner.outcomes.get(size), runner.budget)}"
        else:
            budget = f"the budget of {_bytes(result.budget_bytes)} (max_memory={self.max_memory!r} less margin={self.margin})"
            why = f"its trial {_why_it_missed(smallest, runner.outcomes.get(size), runner.budget, 1)}"
        needs = ""
        if not device_for(runner.pl_module.device).is_cuda:  # a simulated cap: measure the step without it
            runner.fits(size, capped=False)  # on every rank (collectives); the figures told are this rank's own
            fitted, peak = runner.uncapped  # the agreed peak is relative to the tightest rank's budget
            where = "" if trainer.world_size == 1 else f" on rank {trainer.global_rank}"
            if fitted or peak is not None:
                needs = f" Measured again without the cap{where}, a step at batch size {size} needs {_bytes(peak)}."
        return (
            f"BatchSizeSearch: {headline} {budget}: {why}.{needs} Try MemoryFill (mixed precision, activation "
            "checkpointing and gradient accumulation), a smaller model, or more memory (a larger max_memory, a "
            "smaller margin, or a larger device)."
        )

    def _report(self, trainer: pl.Trainer) -> None:
        assert self.result is not None
        path = report_file(trainer)  # a collective under DDP: asked on every rank
        if trainer.is_global_zero:
            if self.verbose:
                rank_zero_info(batch_search_table(self.result))
            write_report_section(path, REPORT_SECTION, to_dict(self.result))


def logged_metrics(result: BatchSizeSearchResult) -> dict[str, float]:
    """The metrics the callback logs for ``result`` (see the module docstring)."""
    metrics = {
        "gpuopt/batch_size": float(result.batch_size or 0),
        "gpuopt/batch_search_trials": float(result.num_trials),
        "gpuopt/batch_search_steps": float(result.num_trials * result.steps_per_trial),
        "gpuopt/batch_search_seconds": result.seconds,
        "gpuopt/batch_search_budget_bytes": float(result.budget_bytes),
    }
    if result.peak_bytes is not None:
        metrics["gpuopt/batch_search_peak_bytes"] = float(result.peak_bytes)
    if result.predicted_batch_size is not None:
        metrics["gpuopt/batch_search_predicted"] = float(result.predicted_batch_size)
    return metrics


# ---------------------------------------------------------------------- trials


class _TrialRunner:
    """Runs one trial at a batch size on every rank and returns what all ranks agree on."""

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        state: TrainingStateRestored,
        budget: int,
        search_budget: int,
        batch_arg_name: str,
        capacity: int,
    ) -> None:
        self.trainer, self.pl_module, self.state, self.budget = trainer, pl_module, state, budget
        self.search_budget = search_budget
        self.capacity = capacity
        self.batch_arg_name = batch_arg_name
        self.baseline = _ddp_bucket_bytes(trainer, pl_module)
        #: this rank's outcome of the trial at each batch size (capped trials)
        self.outcomes: dict[int, _TrialOutcome] = {}
        #: this rank's own (fitted, peak) of the last uncapped run (``fits`` returns the ranks' agreed figures)
        self.uncapped: tuple[bool, Optional[int]] = (False, None)

    def fits(self, batch_size: int, capped: bool = True) -> tuple[bool, Optional[int]]:
        trainer, pl_module = self.trainer, self.pl_module
        lightning_setattr(pl_module, self.batch_arg_name, batch_size)
        compat.reset_train_loader(trainer)
        trainer.fit_loop.setup_data()  # collectives (barrier, length checks): outside the trial, on every rank
        self.state.reset_for_trial()
        device = pl_module.device
        prefetched = getattr(compat.data_fetcher(trainer), "batches", [])
        existing = (pl_module, *trainer.optimizers, prefetched)
        card = device_for(device)
        if card.is_cuda:  # the allocator's own OOM; reserved memory kept within max_memory
            card.empty_cache()  # the trial reserves from a clean cache: what it holds is its own
            meter: Any = card.memory_cap(self.capacity, existing) if capped else card.peak_meter(existing)
        elif capped:
            meter = MemoryBudget(self.budget, existing=existing, device=device, baseline_bytes=self.baseline)
        else:
            meter = LiveTensorTracker(existing=existing, device=device, baseline_bytes=self.baseline)
        outcome = call_catching_oom(_run_steps, trainer, pl_module, meter)
        _check_trial_batches(trainer, batch_size, self.batch_arg_name, outcome.out_of_memory)
        # on a card the memory taken is what the caching allocator reserved (blocks in use and cached):
        # a batch that fits by the allocated bytes can still run out of memory on the reserved ones
        reserved = meter.peak_reserved_bytes if card.is_cuda else None
        peak = reserved if reserved is not None else meter.peak_bytes
        fitted = not outcome.out_of_memory and peak is not None and peak <= self.budget
        if capped:
            cap = meter.max_bytes if isinstance(meter, MemoryBudget) else None
            self.outcomes[batch_size] = _TrialOutcome(fitted, peak, cap, outcome.error_message)
        else:
            self.uncapped = (fitted, None if peak is None else int(peak))
        return _agree(trainer, fitted, peak, self.budget, self.search_budget)


def _check_trial_batches(trainer: pl.Trainer, batch_size: int, name: str, out_of_memory: bool) -> None:
    """Stop when the trial's steps did not receive batches of the size tried: the loader does not read
    the batch size (a hard-coded ``batch_size=32``), and every figure the search would report is false."""
    seen = [size for size in _LAST_TRIAL_BATCH_SIZES if size is not None]
    if not seen or all(size == batch_size for size in seen):
        return
    if out_of_memory and seen[-1] == batch_size and all(size == batch_size for size in seen):
        return
    wrong = sorted({size for size in seen if size != batch_size})
    model = type(trainer.lightning_module).__name__
    datamodule = cast(Any, trainer).datamodule  # set by Lightning's data connector, not declared on Trainer
    source = (
        f"{type(datamodule).__name__}.train_dataloader()" if datamodule is not None else f"{model}.train_dataloader()"
    )
    raise MisconfigurationException(
        f"BatchSizeSearch set `{name}`={batch_size}, but the training steps received batches of {wrong} samples: "
        f"{source} does not build its loader with that batch size. Build it with `batch_size=self.{name}` (the "
        f"value the search sets on the model, its hparams or the datamodule), or pass `batch_arg_name=` with the "
        f"name it reads."
    )


@dataclass
class _TrialOutcome:
    """This rank's side of one trial, which the search's ``Trial`` does not keep: whether it fitted
    here, its peak, the simulated cap it ran under (``None``: the device's own memory, on CUDA) and,
    when it ran out of memory, the error's message."""

    fitted: bool
    peak_bytes: Optional[int]
    cap_bytes: Optional[int]
    oom_message: Optional[str]


def _why_it_missed(trial: Trial, outcome: Optional[_TrialOutcome], budget: int, world_size: int) -> str:
    """Why ``trial`` did not fit, in its own figures: its recorded peak, and the cap it ran out of
    memory under or the budget its peak passed (on this rank under DDP, which may not be the rank
    that failed).

    Example::

        >>> _why_it_missed(Trial(1, False, 2_000, 0.1), _TrialOutcome(False, 2_000, None, None), 1_500, 1)
        'peaked at 2.0 KiB (2000 bytes), above the budget of 1.5 KiB (1500 bytes)'
    """
    peak = trial.peak_bytes if world_size == 1 or outcome is None else outcome.peak_bytes
    where = "" if world_size == 1 else " on this rank"
    if outcome is None:
        return f"did not fit (peak {_bytes(peak)})"
    if outcome.fitted:
        return f"fitted{where} (peak {_bytes(peak)}, budget {_bytes(budget)}) but not on every rank"
    if outcome.oom_message is not None:
        cap = "the device's memory" if outcome.cap_bytes is None else f"the cap of {_bytes(outcome.cap_bytes)}"
        return (
            f"ran out of memory{where} inside a training step, its peak until then {_bytes(peak)} under {cap}: "
            f"{_first_sentences(outcome.oom_message)}"
        )
    if peak is None:
        return f"measured no peak{where}"
    return f"peaked{where} at {_bytes(peak)}, above the budget of {_bytes(budget)}"


def _why_each_rank_missed(trainer: pl.Trainer, outcome: Optional[_TrialOutcome], budget: int) -> str:
    """Under DDP: why the trial did not fit, on each rank in that rank's own figures (its budget, its
    cap, its peak; one all-gather). The out-of-memory message is only known for this rank."""
    figures = (
        [budget, -1, -1, 0, 0, 0]
        if outcome is None
        else [
            budget,
            -1 if outcome.cap_bytes is None else outcome.cap_bytes,
            -1 if outcome.peak_bytes is None else outcome.peak_bytes,
            int(outcome.fitted),
            int(outcome.oom_message is not None),
            1,
        ]
    )
    mine = torch.tensor(figures, dtype=torch.int64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(mine).reshape(-1, len(figures)).cpu().tolist()
    parts = []
    for rank, (rank_budget, cap, peak, fitted, oom, known) in enumerate(gathered):
        message = outcome.oom_message if rank == trainer.global_rank and outcome is not None else None
        parts.append(
            f"rank {rank} "
            + _rank_missed(
                rank_budget,
                None if cap < 0 else cap,
                None if peak < 0 else peak,
                bool(fitted),
                bool(oom),
                bool(known),
                message,
            )
        )
    return "; ".join(parts)


def _rank_missed(
    budget: int, cap: Optional[int], peak: Optional[int], fitted: bool, oom: bool, known: bool, message: Optional[str]
) -> str:
    """One rank's side of a trial that did not fit on every rank, in that rank's own figures.

    Example::

        >>> _rank_missed(54_000, 54_000, 60_000, False, True, True, None)
        'ran out of memory inside a training step, its peak until then 58.6 KiB (60000 bytes) under its cap of 52.7 KiB (54000 bytes)'
    """
    if not known:
        return "ran no trial at this size"
    if fitted:
        return f"fitted (peak {_bytes(peak)}, its budget {_bytes(budget)})"
    if oom:
        where = "the device's memory" if cap is None else f"its cap of {_bytes(cap)}"
        detail = f": {_first_sentences(message)}" if message else ""
        return f"ran out of memory inside a training step, its peak until then {_bytes(peak)} under {where}{detail}"
    if peak is None:
        return "measured no peak"
    return f"peaked at {_bytes(peak)}, above its budget of {_bytes(budget)}"


def _first_sentences(message: str) -> str:
    """An out-of-memory message without CUDA's advice on the allocator, on one line, no final period."""
    return " ".join(message.split(" If reserved but unallocated")[0].split()).rstrip(".")


def _run_steps(trainer: pl.Trainer, pl_module: pl.LightningModule, meter: Any) -> None:
    """The trial's steps. A step whose gradient scaler found inf/NaN skips ``optimizer.step()``, so
    optimizer state may not exist yet: the trial goes on until ``max_steps`` optimizer steps really
    ran (at most as many again), or the peak would miss the optimizer state training holds."""
    wanted = trainer.fit_loop.epoch_loop.max_steps
    manual = not pl_module.automatic_optimization
    batches = trainer.limit_train_batches // MANUAL_TRIAL_BATCHES_AT_MOST if manual else 0
    with (
        _collectives_bypassed(trainer, pl_module),
        logging_disabled(pl_module),
        meter,
        _optimizer_steps_counted(trainer.optimizers) as stepped,
        _batch_sizes_seen(trainer, pl_module, stop_after=batches) as sizes,
    ):
        sizes.clear()
        trainer.fit_loop.run()
        for _ in range(wanted):
            if stepped[0] >= wanted or trainer.fit_loop.epoch_loop.max_steps >= 2 * wanted:
                break
            trainer.fit_loop.epoch_loop.max_steps += 1
            trainer.should_stop = False
            trainer.fit_loop.run()


#: the batch sizes the last trial's steps received (``None`` where none could be read)
_LAST_TRIAL_BATCH_SIZES: list[Optional[int]] = []
#: a manual-optimization trial runs its batches once every optimizer has stepped, within this many times them
MANUAL_TRIAL_BATCHES_AT_MOST = 8


@contextlib.contextmanager
def _batch_sizes_seen(
    trainer: pl.Trainer, pl_module: pl.LightningModule, stop_after: float = 0
) -> Iterator[list[Optional[int]]]:
    """Records the size of every batch the trial's steps receive (Lightning's ``extract_batch_size``,
    read in the module's ``on_train_batch_start``), into :data:`_LAST_TRIAL_BATCH_SIZES`.

    With ``stop_after`` (manual optimization), the trial stops once that many batches began with every
    optimizer's state in place and every optimizer stepped in such a batch: an optimizer stepped every
    few batches (a GAN's generator) allocates its state late, and training's peak is its forward,
    backward and step in a batch where all the state exists."""
    sizes = _LAST_TRIAL_BATCH_SIZES
    hooks = {
        name: (getattr(pl_module, name), name in vars(pl_module))
        for name in ("on_train_batch_start", "on_train_batch_end")
    }
    stepped = [0] * len(trainer.optimizers)
    handles = (
        [
            optimizer.register_step_post_hook(functools.partial(_count_step, stepped, index))
            for index, optimizer in enumerate(trainer.optimizers)
        ]
        if stop_after
        else []
    )
    complete_batches = [0]
    began_complete = [False]
    stepped_when_complete = [False] * len(trainer.optimizers)
    steps_at_start = list(stepped)

    def recording_start(batch: Any, batch_idx: int, *args: Any) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Trying to infer the batch_size from an ambiguous collection"
                sizes.append(extract_batch_size(batch))
        except Exception:  # noqa: BLE001 - no tensor in the batch: nothing to check
            sizes.append(None)
        began_complete[0] = all(stepped)
        steps_at_start[:] = stepped
        return hooks["on_train_batch_start"][0](batch, batch_idx, *args)

    def stopping_end(outputs: Any, batch: Any, batch_idx: int, *args: Any) -> Any:
        result = hooks["on_train_batch_end"][0](outputs, batch, batch_idx, *args)
        if began_complete[0]:
            complete_batches[0] += 1
            for index, (now, before) in enumerate(zip(stepped, steps_at_start)):
                stepped_when_complete[index] = stepped_when_complete[index] or now > before
        if stop_after and complete_batches[0] >= stop_after and all(stepped_when_complete):
            trainer.should_stop = True
        return result

    pl_module.on_train_batch_start = recording_start  # type: ignore[method-assign]
    pl_module.on_train_batch_end = stopping_end  # type: ignore[method-assign]
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()
        for name, (hook, had_own) in hooks.items():
            if had_own:
                setattr(pl_module, name, hook)
            else:
                delattr(pl_module, name)


def _count_step(counts: list[int], index: int, *_: Any) -> None:
    counts[index] += 1


@contextlib.contextmanager
def _optimizer_steps_counted(optimizers: list) -> Iterator[list[int]]:
    """Counts the ``step()`` calls that ran (a scaler that skips a step does not call it); one
    count for the first optimizer, so several optimizers stepping once count as one step."""
    count = [0]

    def counted(*_: Any) -> None:
        count[0] += 1

    handles = [optimizers[0].register_step_post_hook(counted)] if optimizers else []
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


def _agree(
    trainer: pl.Trainer, fitted: bool, peak: Optional[int], budget: int, search_budget: int
) -> tuple[bool, Optional[int]]:
    """All ranks' outcome: fits only if it fitted on every rank. The peak handed to the search is
    the tightest rank's, as seen against the search's budget: ``search_budget - min(headroom)``."""
    if trainer.world_size <= 1:
        return fitted, peak
    headroom = -1 if peak is None else budget - int(peak)
    mine = torch.tensor(
        [int(fitted), int(peak is not None), headroom], dtype=torch.int64, device=trainer.strategy.root_device
    )
    gathered = trainer.strategy.all_gather(mine).reshape(-1, 3).cpu()
    known = gathered[gathered[:, 1] == 1]
    agreed_peak = search_budget - int(known[:, 2].min()) if len(known) == len(gathered) else None
    return bool(gathered[:, 0].min()), agreed_peak


def _agree_plan(
    trainer: pl.Trainer, budget: int, start: int, bytes_per_sample: Optional[float], upper: int
) -> tuple[int, int, Optional[float], int]:
    """The smallest budget, start and upper bound and the steepest estimated slope over the ranks."""
    if trainer.world_size <= 1:
        return budget, start, bytes_per_sample, upper
    mine = torch.tensor(
        [budget, start, -1.0 if bytes_per_sample is None else bytes_per_sample, upper],
        dtype=torch.float64,
        device=trainer.strategy.root_device,
    )
    gathered = trainer.strategy.all_gather(mine).reshape(-1, 4).cpu()
    slopes = [float(value) for value in gathered[:, 2] if value >= 0]
    return (
        int(gathered[:, 0].min()),
        int(gathered[:, 1].min()),
        max(slopes) if slopes else None,
        int(gathered[:, 3].min()),
    )


@contextlib.contextmanager
def _collectives_bypassed(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """Under DDP: the trial steps the bare module (no gradient all-reduce, no buffer broadcast) and
    skips the per-step SIGTERM broadcast, so an OOM on one rank cannot strand the others."""
    strategy, epoch_loop = trainer.strategy, trainer.fit_loop.epoch_loop
    wrapped = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
    if trainer.world_size > 1:
        compat.skip_sigterm_broadcast(epoch_loop)
    if wrapped is not None:
        strategy.model = pl_module
    try:
        yield
    finally:
        if wrapped is not None:
            strategy.model = wrapped
        compat.restore_sigterm_broadcast(epoch_loop)


def _ddp_bucket_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """DDP's gradient buckets (a copy of the gradients unless ``gradient_as_bucket_view``): on CUDA
    the allocator counts them already; elsewhere they are added to a trial's budget."""
    model = trainer.strategy.model
    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    if device_for(pl_module.device).is_cuda:
        return 0
    return storage_bytes([p for p in pl_module.parameters() if p.requires_grad])


# ---------------------------------------------------------------------- state kept and restored


def _cpu_copy(collection: Any) -> Any:
    return apply_to_collection(collection, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))


def _clone(collection: Any) -> Any:
    return apply_to_collection(collection, torch.Tensor, lambda t: t.clone())


def _progress_objects(loop: Any, seen: Optional[set] = None) -> Iterator[compat.BaseProgress]:
    """Every progress counter of ``loop`` and its child loops."""
    seen = set() if seen is None else seen
    for value in list(vars(loop).values()):
        if isinstance(value, compat.BaseProgress) and id(value) not in seen:
            seen.add(id(value))
            yield value
        elif isinstance(value, compat.Loop):
            yield from _progress_objects(value, seen)


class TrainingStateRestored:
    """Keeps, in host memory, everything a trial changes and puts it back on exit: parameters and
    buffers, gradients, optimizer and LR-scheduler state, loop progress, RNG states, module
    attributes (train/eval modes included) and ``trainer.should_stop``.

    Example::

        with TrainingStateRestored(trainer, pl_module) as state:
            state.reset_for_trial()       # counters at zero: a trial's steps run from the start
            trainer.fit_loop.run()        # real steps; afterwards nothing of them is left
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.pl_module = trainer, pl_module

    def __enter__(self) -> TrainingStateRestored:
        trainer, module = self.trainer, self.pl_module
        tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
        self.tensors = [(t, t.detach().to("cpu", copy=True)) for t in tensors]
        self.grads = [
            (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in module.parameters()
        ]
        self.optimizers = [_cpu_copy(optimizer.state_dict()) for optimizer in trainer.optimizers]
        self.schedulers = [_cpu_copy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        self.progress = [(p, _cpu_copy(p.state_dict())) for p in _progress_objects(trainer.fit_loop)]
        self.batches_that_stepped = compat.batches_that_stepped(trainer)
        self.should_stop = trainer.should_stop
        self.rng = compat.collect_rng_states(include_cuda=cuda_rng_in_use())
        # 16-mixed: the trials step with scalers of their own, so an OOM inside optimizer.step() (after
        # unscale_) cannot leave the run's scaler mid-step, and its scale and growth tracker stay as they are
        plugin = trainer.strategy.precision_plugin
        self.scaler = getattr(plugin, "scaler", None)
        self.scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        self.attributes = restored_attributes(module)
        self.attributes.__enter__()
        return self

    def reset_for_trial(self) -> None:
        """The state training starts from, with counters at zero (so ``steps_per_trial`` steps run)."""
        self._restore_weights_and_optimizers()
        for progress in _progress_objects(self.trainer.fit_loop):
            progress.reset()
        compat.set_batches_that_stepped(self.trainer, 0)
        self.trainer.should_stop = False
        if self.scaler is not None:
            plugin: Any = self.trainer.strategy.precision_plugin  # a plugin with a scaler (16-mixed)
            plugin.scaler = _trial_scaler(plugin)

    def _restore_weights_and_optimizers(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        for param, grad in self.grads:
            param.grad = None if grad is None else grad.to(param.device, copy=True)
        for optimizer, state in zip(self.trainer.optimizers, self.optimizers):
            optimizer.load_state_dict(_clone(state))
        for config, state in zip(self.trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(_clone(state))

    def __exit__(self, *exc_info: Any) -> None:
        self.attributes.__exit__(*exc_info)
        if self.scaler is not None:
            plugin: Any = self.trainer.strategy.precision_plugin
            plugin.scaler = self.scaler
            self.scaler.load_state_dict(self.scaler_state)
        self._restore_weights_and_optimizers()
        for progress, state in self.progress:
            progress.load_state_dict(_clone(state))
        compat.set_batches_that_stepped(self.trainer, self.batches_that_stepped)
        self.trainer.should_stop = self.should_stop
        compat.set_rng_states(self.rng)
        compat.reset_logged_results(self.trainer)


def trial_line(trial: Trial, budget_bytes: int) -> str:
    """One trial in words, for progress reporting.

    Example::

        >>> trial_line(Trial(272, False, 65_011_712, 1.88), 59_257_651)
        'batch size 272 does not fit: peak 62.0 MiB, budget 56.5 MiB (1.88 s)'
    """
    outcome = "fits" if trial.fits else "does not fit"
    return (
        f"batch size {trial.batch_size} {outcome}: peak {format_bytes(trial.peak_bytes)}, "
        f"budget {format_bytes(budget_bytes)} ({format_seconds(trial.seconds)})"
    )


def _trial_scaler(plugin: Any) -> torch.amp.GradScaler:
    """A fresh gradient scaler for one trial, at scale 1: memory does not depend on the scale, and
    at 1 a float16 step does not overflow, so the optimizer steps as it will in training."""
    return torch.amp.GradScaler(plugin.device, init_scale=1.0, growth_interval=2**30)


_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _TrialStopMessages(logging.Filter):
    """Drops the fit loop's "`Trainer.fit` stopped: `max_steps=N` reached." that ends every trial."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("`Trainer.fit` stopped")


#: the module's hooks a trial does not call: the user's code sees one fit, which trains once
_RUN_HOOKS_NOT_IN_TRIALS = ("on_train_start", "on_train_end")


def _no_hook(*_: Any, **__: Any) -> None:
    return None


@contextlib.contextmanager
def _trial_settings(trainer: pl.Trainer, steps_per_trial: int) -> Iterator[None]:
    """Callbacks detached, loggers swapped for a DummyLogger, no validation, the module's
    ``on_train_start``/``on_train_end`` not called (the hooks of each step and epoch are: they may
    prepare what the step needs), ``steps_per_trial`` optimizer steps over as many epochs as that takes."""
    fit_loop, module = trainer.fit_loop, trainer.lightning_module
    connected: Any = trainer  # ``callbacks``: set by Lightning's callback connector, not declared on Trainer
    silenced = [name for name in _RUN_HOOKS_NOT_IN_TRIALS if name not in vars(module)]
    for name in silenced:
        setattr(module, name, _no_hook)
    saved = (
        connected.callbacks,
        trainer.loggers,
        trainer.limit_val_batches,
        fit_loop.epoch_loop.max_steps,
        fit_loop.max_epochs,
        trainer.limit_train_batches,
    )
    quiet = _TrialStopMessages()
    logging.getLogger(_RANK_ZERO_LOGGER).addFilter(quiet)
    connected.callbacks = []
    trainer.loggers = [DummyLogger()] if trainer.loggers else []
    trainer.limit_val_batches = 0
    minimums = (fit_loop.min_epochs, fit_loop.epoch_loop.min_steps)
    if trainer.lightning_module.automatic_optimization:
        fit_loop.epoch_loop.max_steps = steps_per_trial
        fit_loop.max_epochs = -1
    else:
        # manual optimization: `global_step` counts every optimizer's steps (two optimizers: a 2-step
        # trial was one batch), so the trial counts batches: one epoch of the trial's sampler, stopped
        # by :func:`_run_steps` once the promised batches ran with every optimizer's state in place
        fit_loop.epoch_loop.max_steps = -1
        fit_loop.max_epochs = 1
        trainer.limit_train_batches = MANUAL_TRIAL_BATCHES_AT_MOST * steps_per_trial
        fit_loop.min_epochs, fit_loop.epoch_loop.min_steps = None, None
    try:
        yield
    finally:
        for name in silenced:
            vars(module).pop(name, None)
        logging.getLogger(_RANK_ZERO_LOGGER).removeFilter(quiet)
        connected.callbacks, trainer.loggers, trainer.limit_val_batches = saved[0], saved[1], saved[2]
        fit_loop.epoch_loop.max_steps, fit_loop.max_epochs, trainer.limit_train_batches = saved[3], saved[4], saved[5]
        fit_loop.min_epochs, fit_loop.epoch_loop.min_steps = minimums


@contextlib.contextmanager
def _trial_batches(trainer: pl.Trainer, steps_per_trial: int) -> Iterator[Optional[str]]:
    """Every trial step gets a full batch of the size tried, and the worst one the data holds.

    The trials' loaders draw from a :class:`TrialSampler`: the dataset's order over and over (so a
    batch larger than half the data still makes full batches at every step; an epoch's short
    leftover batch was the second step, the only one with optimizer state), or, when sample sizes
    vary (sequences of different lengths), the largest sample at every place: a padded batch that
    holds the longest sample is as large as copies of it. Every sample's size is looked at (within
    a time bound, which the note then names). The estimate uses the same batches."""
    loader = first_train_loader(trainer)
    compat.reset_train_loader(trainer)
    dataset = getattr(loader, "dataset", None)
    refusal = _why_batch_size_is_not_the_loaders(loader)
    if refusal:
        raise MisconfigurationException(f"BatchSizeSearch: {refusal}")
    if dataset is None or isinstance(dataset, IterableDataset) or not _sized(dataset):
        yield None
        return
    probed = largest_samples_first(dataset)
    order = probed.order[:1] if probed is not None else list(range(len(dataset)))
    world = trainer.world_size
    per_step = max(1, trainer.accumulate_grad_batches)

    def with_trial_sampler(built: DataLoader) -> DataLoader:
        # enough full batches for twice the trial's steps (a skipped scaler step runs more), or the batches a
        # manual-optimization trial may take, on every rank
        limit = trainer.limit_train_batches if isinstance(trainer.limit_train_batches, int) else 0
        batches = max(per_step * 2 * steps_per_trial, limit)
        length = max(len(dataset), (built.batch_size or 1) * batches * world)
        return compat.update_dataloader(built, sampler=TrialSampler(order, length))

    source = compat.train_source(trainer)
    compat.set_train_source(trainer, RebuiltSource.around(source, with_trial_sampler))
    note = None
    if probed is not None:
        seen = (
            f"over {probed.probed:,} of {probed.total:,} samples, all"
            if probed.complete
            else (
                f"over the {probed.probed:,} of {probed.total:,} samples looked at in the time allowed; a larger one may"
                " exist"
            )
        )
        note = (
            f"sample sizes vary ({probed.smallest:,} to {probed.largest:,} elements {seen}): the estimate and the"
            " trials used batches of the largest sample"
        )
    try:
        yield note
    finally:
        compat.set_train_source(trainer, source)


def _sized(dataset: Any) -> bool:
    try:
        return len(dataset) > 0
    except TypeError:
        return False


def _why_batch_size_is_not_the_loaders(loader: Any) -> Optional[str]:
    """Why setting the batch size cannot change this loader's batches, or None."""
    if not isinstance(loader, DataLoader):
        return None
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return (
            f"the train loader's batches come from its `batch_sampler` ({type(batch_sampler).__name__}), which decides"
            " their size, not `batch_size`: the batch sizes tried would not be the ones trained. Build the loader with"
            " `batch_size=` (and a `sampler=`), or leave BatchSizeSearch out and size the batch sampler yourself."
        )
    return None


def _batch_size_holders(pl_module: pl.LightningModule, name: str) -> list[tuple[Any, Any]]:
    """Every place Lightning keeps ``name`` (the model, ``model.hparams``, the datamodule and its
    hparams), each with the value it holds now."""
    holders = compat.attribute_holders(pl_module, name)
    return [(holder, holder[name] if isinstance(holder, dict) else getattr(holder, name)) for holder in holders]


def _initial_batch_size(trainer: pl.Trainer, holders: list[tuple[Any, Any]], name: str) -> int:
    """The batch size the run would train at. When the places that hold ``name`` disagree (the
    model's attribute 16, its hparams 32), the train loader's own batch size says which one it
    reads; the search sets them all, as Lightning's tuner does, and warns."""
    values = [value for _, value in holders]
    if len(set(map(repr, values))) <= 1:
        return int(values[-1])
    places = ", ".join(f"{_holder_name(holder, name)}={value!r}" for holder, value in holders)
    loader_size: Any = getattr(first_train_loader(trainer), "batch_size", None)
    compat.reset_train_loader(trainer)
    start = int(loader_size) if loader_size in values else int(values[-1])
    rank_zero_warn(
        f"BatchSizeSearch: the batch size is held in several places with different values ({places}); the train loader"
        f" uses {loader_size}. The search starts from {start} and sets every place to the size it finds. Keep one."
    )
    return start


def _holder_name(holder: Any, name: str) -> str:
    if isinstance(holder, pl.LightningModule):
        return f"`model.{name}`"
    if isinstance(holder, pl.LightningDataModule):
        return f"`datamodule.{name}`"
    return f"`hparams.{name}`"


def _put_back_batch_size(holders: list[tuple[Any, Any]], name: str) -> None:
    """Each place that holds the batch size back to the value it held before the search."""
    for holder, value in holders:
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def first_train_loader(trainer: pl.Trainer) -> Any:
    """The fit's (first) train loader, built now from ``train_dataloader()`` at the batch size now set,
    as the fit loop builds it; `compat.reset_train_loader(trainer)` afterwards, so training builds its own.

    Example::

        batch = next(iter(first_train_loader(trainer)))
        compat.reset_train_loader(trainer)
    """
    compat.reset_train_loader(trainer)
    trainer.fit_loop.setup_data()
    return compat.built_train_loader(trainer)


def samples_per_rank(trainer: pl.Trainer) -> Optional[int]:
    """Samples each rank's train loader draws in an epoch (its sampler's length), if known. Building the
    loader may draw from the global RNG: the RNG states are put back."""
    rng = compat.collect_rng_states(include_cuda=cuda_rng_in_use())
    try:
        loader = first_train_loader(trainer)
        sampler = getattr(loader, "sampler", None)
        return len(sampler) if sampler is not None else len(loader.dataset)
    except (TypeError, AttributeError, NotImplementedError):
        return None
    finally:
        compat.reset_train_loader(trainer)
        compat.set_rng_states(rng)


def _bytes(num_bytes: Optional[int]) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes} bytes)" if num_bytes is not None else "n/a"
