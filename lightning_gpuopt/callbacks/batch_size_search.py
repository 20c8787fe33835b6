"""BatchSizeSearch: the largest batch that fits, found with a handful of real training steps.

In ``on_fit_start``: a prediction from a traced step, then trials of ``steps_per_trial`` real training steps at the
sizes :func:`~lightning_gpuopt.core.search.search_largest_fit` picks (all ranks agree; see docs/batch-size-search.md).
The size found is set where ``batch_arg_name`` lives and kept after the fit; a failed fit puts the user's back.

Logged once when training starts (to every logger and ``trainer.callback_metrics``):
``gpuopt/batch_size`` (found and set), ``gpuopt/batch_search_trials``, ``gpuopt/batch_search_steps``
(the training batches the trials began), ``gpuopt/batch_search_seconds``, ``gpuopt/batch_search_peak_bytes``
(the chosen size's trial, the largest over ranks), ``gpuopt/batch_search_budget_bytes`` (the cap of
every trial, the tightest rank's) and ``gpuopt/batch_search_predicted`` (the estimate's largest batch,
when it could trace). Rank 0 logs the trials and writes the ``"batch_size_search"`` report section."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine import FitSession, Trials, Undo, rng_kept, signals_stop_our_work
from lightning_gpuopt.callbacks._engine.predict import Prediction, predicted_largest_fit
from lightning_gpuopt.callbacks._engine.session import EngineCallback
from lightning_gpuopt.callbacks._engine.trials import TrialOutcome, agreed, gather_ranks
from lightning_gpuopt.callbacks._progress import WorkProgress
from lightning_gpuopt.callbacks._reporting import log_metrics, report_section
from lightning_gpuopt.core.checks import check_bool, check_choice, check_int, check_name, check_number
from lightning_gpuopt.core.device import device_for
from lightning_gpuopt.core.fill import lr_note
from lightning_gpuopt.core.loader import batch_samples
from lightning_gpuopt.core.memory import MIN_MAX_MEMORY_BYTES, parse_memory
from lightning_gpuopt.core.report import batch_search_table, format_bytes, format_seconds, to_dict
from lightning_gpuopt.core.search import BatchSizeSearchResult, Trial, largest_stepping_size, search_largest_fit

REPORT_SECTION = "batch_size_search"  #: section of ``gpuopt_report.json`` this callback writes
MODES = ("fill", "cap")
Mode = Literal["fill", "cap"]


class NoBatchSizeFitsError(RuntimeError):
    """No size tried fitted the budget; the message says why the smallest failed, ``result`` holds the trials."""

    def __init__(self, message: str, result: Optional[BatchSizeSearchResult] = None) -> None:
        super().__init__(message)
        self.result = result


class BatchSizeSearch(EngineCallback):
    r"""Find the largest batch size that fits the memory budget with a few real training steps, and set it.

    ``train_dataloader()`` (the model's or datamodule's) must read the batch size ``batch_arg_name`` names.

    Example::

        search = BatchSizeSearch(max_memory="20GiB", multiple_of=8)
        Trainer(callbacks=[search]).fit(model, datamodule=dm)   # dm.batch_size is now the largest that fits
        search.result.batch_size, [(t.batch_size, t.fits) for t in search.result.trials]

    Args:
        max_memory: bytes, ``"20GiB"`` or a fraction of the device (``0.9``); ``None``: a CUDA card's free
            memory plus what torch holds (required on CPU).
        margin: ``"auto"``: a size fits only if 1/32 more samples would (measured headroom); a number: only if
            its peak stays within ``max_memory * (1 - margin)``.
        steps_per_trial: real training steps per trial (from the second on, optimizer state exists).
        max_trials, min_batch_size, max_batch_size: the search's bounds (sizes also stop at a rank's samples).
        batch_arg_name: the model attribute, ``hparams`` key or datamodule attribute holding the batch size.
        multiple_of: every size tried is a multiple of this (e.g. 8 for tensor cores).
        mode: ``"fill"`` (as large as fits) or ``"cap"`` (never above the user's batch size).
        verbose: log the table of trials (the JSON report is written either way).
    """

    def __init__(
        self,
        max_memory: Optional[int | float | str] = None,
        margin: Union[float, Literal["auto"]] = "auto",
        steps_per_trial: int = 2,
        max_trials: int = 10,
        min_batch_size: int = 1,
        max_batch_size: int = 2**16,
        batch_arg_name: str = "batch_size",
        multiple_of: int = 1,
        mode: Mode = "fill",
        verbose: bool = True,
    ) -> None:
        if max_memory is not None:  # a fraction is resolved against the device later
            parse_memory(max_memory, "cpu", name="max_memory", minimum=MIN_MAX_MEMORY_BYTES)
        if margin != "auto":
            check_number("margin", margin, "margin='auto' or margin=0.1", low=0, high=1, high_inclusive=False)
        check_int("steps_per_trial", steps_per_trial, 1, "steps_per_trial=2, so that optimizer state exists")
        check_int("max_trials", max_trials, 1, "max_trials=10")
        check_int("min_batch_size", min_batch_size, 1, "min_batch_size=1")
        check_int("max_batch_size", max_batch_size, min_batch_size, f"max_batch_size=65536 (>= {min_batch_size})")
        check_int("multiple_of", multiple_of, 1, "multiple_of=1 or multiple_of=8")
        if multiple_of > max_batch_size:
            raise ValueError(
                f"`multiple_of`={multiple_of} is above `max_batch_size`={max_batch_size}; expected one <= it."
            )
        check_name("batch_arg_name", batch_arg_name, "batch_arg_name='batch_size'")
        check_choice("mode", mode, MODES, "mode='fill' (as large as fits) or mode='cap' (never above your batch size)")
        check_bool("verbose", verbose, "verbose=False")
        self.max_memory, self.margin = max_memory, margin if margin == "auto" else float(margin)
        self.steps_per_trial, self.max_trials = steps_per_trial, max_trials
        self.min_batch_size, self.max_batch_size, self.multiple_of = min_batch_size, max_batch_size, multiple_of
        self.batch_arg_name, self.mode, self.verbose = batch_arg_name, mode, verbose
        self.progress = verbose  #: report each trial as it ends (a line, or a bar with the Trainer's)
        self.result: Optional[BatchSizeSearchResult] = None  #: what the search found; ``None`` before ``fit``
        self._undo = Undo()
        self._memory_cap: Any = None
        compat.skip_unused_batch_hooks(self)  # its no-op per-batch hooks: not called each batch

    def _reset(self) -> None:
        self.result = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with signals_stop_our_work(trainer, self._undo):
            result = self.search(trainer)
            assert result.batch_size is not None
            FitSession.of(trainer).apply(self._undo, batch_size=(self.batch_arg_name, result.batch_size, True))
        lr = next((float(group["lr"]) for optimizer in trainer.optimizers for group in optimizer.param_groups), None)
        if result.batch_size != (initial := result.initial_batch_size) and initial and lr is not None:  # grew k times
            result.notes.append(lr_note(None, result.batch_size / initial, lr, "MemoryFill's scale_lr")[1])
        self._report(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (r := self.result) is None:
            return
        check_trained_batch_size(trainer, type(self).__name__, self.batch_arg_name, r.batch_size)
        self.hold_memory_cap(pl_module)
        metrics: dict[str, Optional[float]] = {"batch_size": r.batch_size, "batch_search_trials": r.num_trials}
        metrics |= dict(batch_search_steps=r.steps, batch_search_seconds=r.seconds)
        metrics |= dict(batch_search_peak_bytes=r.peak_bytes, batch_search_budget_bytes=r.budget_bytes)
        metrics["batch_search_predicted"] = r.predicted_batch_size
        log_metrics(trainer, {f"gpuopt/{key}": value for key, value in metrics.items()})

    def hold_memory_cap(self, pl_module: pl.LightningModule) -> None:
        """On a CUDA card with an explicit ``max_memory``, cap what training reserves, as the trials' cap."""
        self._release()
        card = device_for(pl_module.device)
        if self.max_memory is not None and card.is_cuda:
            self._memory_cap = card.memory_cap(self.capacity_bytes(pl_module.device))
            self._memory_cap.start()

    def _release(self) -> None:
        """Lift the cap of :meth:`hold_memory_cap`."""
        cap, self._memory_cap = self._memory_cap, None
        if cap is not None:
            cap.stop()

    def capacity_bytes(self, device: torch.device) -> int:
        """``max_memory`` in bytes; without one, what a CUDA card has free plus what torch holds."""
        if self.max_memory is None:
            if not device_for(device).is_cuda:
                raise ValueError(
                    f"`max_memory`=None on a {device.type} device: there is no device memory to fill; pass "
                    'max_memory (e.g. max_memory="300MB") to search under a simulated budget.'
                )
            return device_for(device).usable_memory()
        return parse_memory(self.max_memory, device, name="max_memory", minimum=MIN_MAX_MEMORY_BYTES)

    def budget_bytes(self, device: torch.device, capacity: Optional[int] = None) -> int:
        """What a trial's peak may reach: ``max_memory`` less a numeric ``margin``.

        >>> BatchSizeSearch(max_memory="100MB", margin=0.1).budget_bytes(torch.device("cpu"))
        90000000
        """
        capacity = self.capacity_bytes(device) if capacity is None else capacity
        return int(capacity * (1.0 - (0.0 if self.margin == "auto" else self.margin)))

    def check_usable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raise ``MisconfigurationException`` when no search can resize this fit's batches."""
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

    def search(
        self,
        trainer: Any,
        min_batch_size: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        prediction: Optional[tuple] = None,
        start: Optional[int] = None,
    ) -> Any:
        """Search now (before training) and return :attr:`result`, setting nothing; ``prediction``: a known
        ``(largest, bytes_per_sample, notes)``; ``start``: the first size. Raises :class:`NoBatchSizeFitsError`."""
        compat.check_trainer_namespace(trainer, self)
        module = trainer.lightning_module
        self.check_usable(trainer, module)
        lower = self.min_batch_size if min_batch_size is None else min_batch_size
        started, session = time.perf_counter(), FitSession.of(trainer)
        capacity = self.capacity_bytes(module.device)  # asked once: free memory moves between two readings
        budget = self.budget_bytes(module.device, capacity)
        initial = _initial_batch_size(session, self.batch_arg_name)
        # made before the trials set the callbacks aside (the progress bar among them)
        progress = WorkProgress(trainer, "BatchSizeSearch trial", self.max_trials, self.progress)
        outcomes: dict[int, TrialOutcome] = {}
        with Trials(session, self.steps_per_trial, self.batch_arg_name) as trials:
            upper, upper_note, samples = self._upper_bound(session, initial, max_batch_size)
            known = Prediction(*prediction) if prediction is not None else None  # a Prediction or its first 3
            predicted, per_sample, notes, _, steps = known or predicted_largest_fit(trials, initial, budget)
            replayed = 0 if start else steps  # the allocator replay's trial steps; 0: the line's
            for note in notes:
                rank_zero_warn(f"BatchSizeSearch: {note}")
            start = start or (int(predicted * (1 if replayed else 3 / 4)) if predicted is not None else initial)
            plan = _agree_plan(trainer, budget, start, per_sample, max(upper, lower), replayed)
            search_budget, start, per_sample, upper, replayed = plan
            trial_steps = replayed if replayed > self.steps_per_trial else None  # every trial a confirmation

            def fits(size: int, steps: Optional[int] = None) -> tuple[bool, Optional[int]]:  # headroom: allocated bytes
                outcome = outcomes[size] = trials.run(size, budget, capacity, steps=steps or trial_steps)
                auto = self.margin == "auto" and outcome.allocated_bytes is not None
                measured = replace(outcome, peak_bytes=outcome.allocated_bytes) if auto else outcome
                return agreed(trainer, measured, budget, search_budget)

            def confirm(size: int) -> bool:  # the answer at the edge of the card holds for twice the steps
                edge = (size not in outcomes or outcomes[size].at_edge) and not trials.manual and not trial_steps
                at_edge = any(row[0] for row in gather_ranks(trainer, [edge]))  # on some rank
                return not at_edge or fits(size, 2 * self.steps_per_trial)[0]

            with progress:
                result = search_largest_fit(
                    fits,
                    budget_bytes=search_budget,
                    start=max(start, lower),
                    max_batch_size=upper,
                    min_batch_size=lower,
                    multiple_of=self.multiple_of,
                    max_trials=self.max_trials,
                    bytes_per_sample=per_sample,
                    headroom=1 / 32 if self.margin == "auto" else 0.0,
                    tolerance=1 / 64,  # see docs/batch-size-search.md
                    confirm=confirm,
                    on_trial=lambda trial: progress.done(trial_line(trial, search_budget)),
                    near=bool(replayed),
                )
            size = result.batch_size
            message = self._nothing_fits_message(trials, outcomes, result, budget, capacity) if size is None else ""
            # automatic optimization: Lightning steps on an epoch's last batch
            every = max(trials.first_steps.values(), default=1) if trials.manual else 1
            size, fit_notes = (None, []) if size is None else self._epoch_cap(session, size, samples, every, lower)
        result = replace(
            result,
            batch_size=size,
            initial_batch_size=initial,
            predicted_batch_size=predicted,
            limit_bytes=capacity,
            steps_per_trial=self.steps_per_trial,
            steps=trials.batches_run,
            world_size=trainer.world_size,
            seconds=time.perf_counter() - started,
            notes=[*notes, *([upper_note] if upper_note and result.stop_reason == "upper bound" else []), *fit_notes],
        )
        self.result = result
        if result.batch_size is None:
            raise NoBatchSizeFitsError(message, result)
        return result

    def _upper_bound(self, session: FitSession, initial: int, max_batch_size: Optional[int]) -> tuple[int, str, Any]:
        upper = self.max_batch_size if max_batch_size is None else max_batch_size
        note = f"max_batch_size={upper}" if max_batch_size is None else f"MemoryFill needs no micro-batch above {upper}"
        if self.mode == "cap" and initial < upper:
            upper, note = initial, f"mode='cap': never above your batch size {initial}"
        samples = session.samples_per_rank()
        if samples == 0:
            raise MisconfigurationException(
                "BatchSizeSearch: the train loader holds no samples on this rank (an empty dataset, or fewer samples "
                "than ranks): there is no batch to try. Check the dataset `train_dataloader()` returns."
            )
        if samples is not None and samples < upper:
            upper, note = samples, f"each rank's loader holds {samples} samples"
        return upper, note, samples

    def _epoch_cap(self, session: FitSession, size: int, samples: Optional[int], every: int, lower: int) -> tuple:
        """``(size, notes)``: at most a stream's length, and an epoch holds the ``every`` batches a step takes."""
        if samples is None:  # a stream: one batch at ``size`` shows whether it is shorter
            with rng_kept():
                drawn = batch_samples(next(iter(session.loader(batch_size=size)), None)) or size
            samples = int(min(row[0] for row in gather_ranks(session.trainer, [drawn])))
            note = [f"the train stream holds {samples} samples, fewer than {size}"] if samples < size else []
            return min(size, samples), note
        capped = largest_stepping_size(size, samples, every, self.multiple_of)
        why = f"training_step steps the optimizer once every {every} batches (seen in the trials)"
        if capped < max(1, lower):
            raise MisconfigurationException(
                f"BatchSizeSearch: {why}; an epoch of {samples} samples holds fewer than {every} batches of "
                f"min_batch_size={lower}: no optimizer step would run. Lower min_batch_size or add data."
            )
        return capped, [f"{why}: at most {capped} a batch, so that an epoch steps"] if capped < size else []

    def _nothing_fits_message(self, trials: Trials, outcomes: dict, result: Any, budget: int, capacity: int) -> str:
        """Why the smallest size tried failed; on a simulated cap also its need, measured without the cap."""
        smallest = min(result.trials, key=lambda trial: trial.batch_size)
        size, trainer = smallest.batch_size, trials.trainer
        if size <= result.lower_bound:
            headline = f"even min_batch_size={size} does not fit"
        else:
            count, plural = len(result.trials), "s" if len(result.trials) != 1 else ""
            headline = f"no size fitted in {count} trial{plural} (max_trials={self.max_trials}); the smallest tried, {size}, does not fit"
        if trainer.world_size > 1:
            where = f"the budget of the tightest rank, {_bytes(result.budget_bytes)}"
            why = f"its trial, rank by rank: {_why_each_rank_missed(trainer, outcomes.get(size), budget)}"
        else:
            where = f"the budget of {_bytes(result.budget_bytes)} (max_memory={self.max_memory!r} less margin={self.margin})"
            why = f"its trial did not fit (peak {_bytes(smallest.peak_bytes)})"
            if (outcome := outcomes.get(size)) is not None:
                oom, message = outcome.oom_message is not None, outcome.oom_message
                why = f"its trial {_missed(budget, outcome.cap_bytes, smallest.peak_bytes, oom, message, 'the')}"
        needs = ""
        if not device_for(trainer.lightning_module.device).is_cuda:  # a simulated cap: measure without it
            uncapped = trials.run(size, budget, capacity, capped=False)  # on every rank (collectives)
            if uncapped.fitted or uncapped.peak_bytes is not None:
                rank = "" if trainer.world_size == 1 else f" on rank {trainer.global_rank}"
                needs = f" Measured again without the cap{rank}, a step at batch size {size} needs {_bytes(uncapped.peak_bytes)}."
        return (
            f"BatchSizeSearch: {headline} {where}: {why}.{needs} Try MemoryFill (mixed precision, activation "
            "checkpointing and gradient accumulation), a smaller model, or more memory (a larger max_memory, a "
            "smaller margin, or a larger device)."
        )

    def _report(self, trainer: pl.Trainer, applied: bool = True) -> None:
        assert self.result is not None
        table = functools.partial(batch_search_table, self.result, applied) if self.verbose else None
        report_section(trainer, REPORT_SECTION, to_dict(self.result), table)


def trial_line(trial: Trial, budget_bytes: int) -> str:
    """One trial in words, for progress reporting.

    >>> trial_line(Trial(272, False, 65_011_712, 1.88), 59_257_651)
    'batch size 272 does not fit: peak 62.0 MiB, budget 56.5 MiB (1.88 s)'
    """
    outcome = "fits" if trial.fits else "does not fit"
    return (
        f"batch size {trial.batch_size} {outcome}: peak {format_bytes(trial.peak_bytes)}, "
        f"budget {format_bytes(budget_bytes)} ({format_seconds(trial.seconds)})"
    )


def _initial_batch_size(session: FitSession, name: str) -> int:
    """The run's batch size (a warning and the loader's where holders differ); refused where the loader ignores it."""
    trainer = session.trainer
    holders = compat.attribute_holders(trainer.lightning_module, name)
    values = [holder[name] if isinstance(holder, dict) else getattr(holder, name) for holder in holders]
    loader = session.probe_loader()
    batch_sampler = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise MisconfigurationException(
            f"BatchSizeSearch: the train loader's batches come from its `batch_sampler` ({type(batch_sampler).__name__}),"
            " which decides their size, not `batch_size`: the batch sizes tried would not be the ones trained. Build the"
            " loader with `batch_size=` (and a `sampler=`), or leave BatchSizeSearch out and size the batch sampler yourself."
        )
    loader_size: Any = getattr(loader, "batch_size", None) if isinstance(loader, DataLoader) else None
    if len(set(map(repr, values))) > 1:
        places = ", ".join(f"{_holder_name(holder, name)}={value!r}" for holder, value in zip(holders, values))
        start = int(loader_size if loader_size in values else values[-1])
        rank_zero_warn(
            f"BatchSizeSearch: the batch size is held in several places with different values ({places}); the train"
            f" loader uses {loader_size}. The search starts from {start} and sets every place to the size it finds. "
            "Keep one."
        )
        return start
    if loader_size is not None and loader_size != values[-1]:
        raise MisconfigurationException(_ignored_message(trainer, name, values[-1], loader_size))
    return int(values[-1])


def check_trained_batch_size(trainer: pl.Trainer, owner: str, name: str, batch_size: Optional[int]) -> None:
    """Refuse to train when the loader training built ignores the batch size found."""
    loader = compat.built_train_loader(trainer) if compat.train_loader_built(trainer) else None
    size = getattr(loader, "batch_size", None)
    if batch_size is not None and isinstance(size, int) and size != batch_size:
        raise MisconfigurationException(f"{owner}: " + _ignored_message(trainer, name, batch_size, size))


def _ignored_message(trainer: pl.Trainer, name: str, wanted: Any, size: Any) -> str:
    datamodule = getattr(trainer, "datamodule", None)
    owner = type(datamodule if datamodule is not None else trainer.lightning_module).__name__
    return (
        f"`{name}`={wanted}, but the train loader makes batches of [{size}] samples: {owner}.train_dataloader() "
        f"does not build its loader with that batch size. Build it with `batch_size=self.{name}` (the value the "
        f"search sets on the model, its hparams or the datamodule), or pass `batch_arg_name=` with the name it reads."
    )


def _holder_name(holder: Any, name: str) -> str:
    kinds = (("LightningModule", "model"), ("LightningDataModule", "datamodule"), ("", "hparams"))
    return next(
        f"`{where}.{name}`" for kind, where in kinds if not kind or isinstance(holder, compat.any_namespace("", kind))
    )


def _agree_plan(trainer: Any, budget: int, start: int, per_sample: Optional[float], upper: int, steps: int) -> tuple:
    """Over the ranks: the least budget, start, upper bound and replayed steps, and the steepest slope."""
    rows = gather_ranks(trainer, [budget, start, -1.0 if per_sample is None else per_sample, upper, steps])
    slopes = [row[2] for row in rows if row[2] >= 0]
    least = [int(min(row[i] for row in rows)) for i in (0, 1, 3, 4)]
    return least[0], least[1], max(slopes) if slopes else None, least[2], least[3]


def _bytes(num_bytes: Optional[int]) -> str:
    return f"{format_bytes(num_bytes)} ({num_bytes} bytes)" if num_bytes is not None else "n/a"


def _why_each_rank_missed(trainer: pl.Trainer, outcome: Optional[TrialOutcome], budget: int) -> str:
    """Under DDP: why the trial did not fit, rank by rank in its own figures (one all-gather)."""
    mine = [float(budget), -1.0, -1.0, 0.0, 0.0, 0.0]
    if outcome is not None:
        mine[1:] = [-1 if v is None else v for v in (outcome.cap_bytes, outcome.peak_bytes)]
        mine[3:] = [float(outcome.fitted), float(outcome.oom_message is not None), 1.0]
    parts = []
    for rank, (rank_budget, cap, peak, fitted, oom, known) in enumerate(gather_ranks(trainer, mine)):
        message = outcome.oom_message if rank == trainer.global_rank and outcome is not None else None
        figures = (int(rank_budget), None if cap < 0 else int(cap), None if peak < 0 else int(peak))
        side = f"fitted (peak {_bytes(figures[2])}, its budget {_bytes(figures[0])})" if fitted else ""
        side = "ran no trial at this size" if not known else side or _missed(*figures, bool(oom), message, "its")
        parts.append(f"rank {rank} {side}")
    return "; ".join(parts)


def _missed(budget: int, cap: Optional[int], peak: Optional[int], oom: bool, message: Optional[str], whose: str) -> str:
    """Why a trial did not fit, in its own figures (``whose``: "the", or "its" for one rank of several).

    >>> _missed(54_000, 54_000, 60_000, True, None, "its")
    'ran out of memory inside a training step, its peak until then 58.6 KiB (60000 bytes) under its cap of 52.7 KiB (54000 bytes)'
    >>> _missed(1_500, None, 2_000, False, None, "the")
    'peaked at 2.0 KiB (2000 bytes), above the budget of 1.5 KiB (1500 bytes)'
    """
    if oom:
        where = "the device's memory" if cap is None else f"{whose} cap of {_bytes(cap)}"
        first = " ".join(message.split(" If reserved but unallocated")[0].split()).rstrip(".") if message else ""
        detail = f": {first}" if message else ""  # without CUDA's advice on the allocator, on one line
        return f"ran out of memory inside a training step, its peak until then {_bytes(peak)} under {where}{detail}"
    if peak is None:
        return "measured no peak"
    return f"peaked at {_bytes(peak)}, above {whose} budget of {_bytes(budget)}"
