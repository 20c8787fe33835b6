"""Trials: a few real training steps at a batch size, through the Trainer's epoch loop, measured, then undone.

In trial mode (one :class:`Undo`) the user's callbacks and loggers are set aside, validation is off, the module's
``on_train_start``/``on_train_end`` do not run, compiled code runs eager and under DDP the bare module steps without
collectives. Each trial starts from :class:`TrainingState`, draws full batches of the largest samples from a copy of
the user's loader and runs ``steps_per_trial`` optimizer steps (:attr:`Trials.batches_run` counts the batches begun)
under a cap: a CUDA card's allocator, else a :class:`~lightning_gpuopt.core.memory.MemoryBudget`. A size fits only if
it fitted on every rank; a trial leaving under one small-pool segment (2 MiB) of the cap unreserved is ``at_edge``
(its answer is confirmed with twice the steps).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.parsing import lightning_setattr
from torch.nn.parallel import DistributedDataParallel

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._engine.session import FitSession
from lightning_gpuopt.callbacks._engine.state import TrainingState
from lightning_gpuopt.callbacks._engine.undo import Undo
from lightning_gpuopt.core._torch_compat import eager
from lightning_gpuopt.core.device import CUDA_SMALL_SEGMENT_BYTES, device_for, objects_set_aside
from lightning_gpuopt.core.loader import TrialSampler
from lightning_gpuopt.core.memory import call_catching_oom
from lightning_gpuopt.core.op_memory import storage_bytes

#: a manual-optimization trial runs at most this many times ``steps_per_trial`` batches
MANUAL_TRIAL_BATCHES_AT_MOST = 8


@dataclass
class TrialOutcome:
    """This rank's side of one trial (``cap_bytes`` ``None``: the device's own memory; ``at_edge``: see the
    module docstring)."""

    fitted: bool
    peak_bytes: Optional[int]
    cap_bytes: Optional[int]
    oom_message: Optional[str]
    allocated_bytes: Optional[int] = None
    at_edge: bool = False


def gather_ranks(trainer: Any, values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (one all-gather; this rank's alone without DDP)."""
    if trainer.world_size <= 1:
        return [list(values)]
    mine = torch.tensor(list(values), dtype=torch.float64, device=trainer.strategy.root_device)
    return trainer.strategy.all_gather(mine).reshape(-1, len(values)).cpu().tolist()


class _TrialSteps(Callback):
    """A trial's one callback: counts optimizer steps and the batch (from 1) of each optimizer's first; under manual
    optimization stops once ``batches`` batches ran with every optimizer's state in place and each stepped in one."""

    def __init__(self, optimizers: list, batches: int) -> None:
        self.batches, self.stepped, self.first = batches, [0] * len(optimizers), dict[int, int]()
        self._handles = [
            optimizer.register_step_post_hook(functools.partial(self._count, index))
            for index, optimizer in enumerate(optimizers)
        ]
        self._complete = self.begun = 0  # batches complete (manual optimization), begun
        self._began_complete = False
        self._at_start: list[int] = []
        self._stepped_when_complete = [False] * len(optimizers)

    def _count(self, index: int, *_: Any) -> None:
        self.stepped[index] += 1
        self.first.setdefault(index, self.begun)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.begun += 1
        self._began_complete, self._at_start = all(self.stepped), list(self.stepped)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._began_complete:
            return
        self._complete += 1
        for index, (now, before) in enumerate(zip(self.stepped, self._at_start)):
            self._stepped_when_complete[index] |= now > before
        if self.batches and self._complete >= self.batches and all(self._stepped_when_complete):
            trainer.should_stop = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class Trials:
    """Trial mode for a ``with`` block, and :meth:`run` for each trial (see the module docstring)."""

    def __init__(self, session: FitSession, steps_per_trial: int, batch_arg_name: str) -> None:
        self.session, self.trainer = session, session.trainer
        self.steps_per_trial, self.batch_arg_name = steps_per_trial, batch_arg_name
        self.module = self.trainer.lightning_module
        self.manual = not self.module.automatic_optimization
        self.state: Optional[TrainingState] = None
        self.batches_run = 0  #: batches begun by every trial so far (a trial that ran out of memory: fewer)
        self.first_steps: dict[int, int] = {}  #: optimizer index -> the last trial's batch (from 1) of its first step
        self._undo = Undo()

    def __enter__(self) -> Trials:
        try:
            return self._enter()
        except BaseException:  # what was changed before the error is put back, then the error goes on
            self._undo.undo()
            raise

    def _enter(self) -> Trials:
        trainer, loop = self.trainer, self.trainer.fit_loop
        self.state = TrainingState(trainer)  # before anything runs: a loader iterator draws from the RNG
        self._undo.add("the training state", self.state.restore)
        per_step = max(1, trainer.accumulate_grad_batches)
        self.batches = (MANUAL_TRIAL_BATCHES_AT_MOST if self.manual else 4 * per_step) * self.steps_per_trial
        undo = self._undo
        for holder in compat.attribute_holders(self.module, self.batch_arg_name):  # trials set the sizes tried
            name = self.batch_arg_name
            undo.set(holder, name, holder[name] if isinstance(holder, dict) else getattr(holder, name))
        undo.set(trainer, "callbacks", [])
        (stance := eager()).__enter__()  # compiled code runs eager: dynamo's caches stay as training finds them
        undo.add("the compiler's stance", lambda: stance.__exit__(None, None, None))
        (set_aside := objects_set_aside()).__enter__()  # a failed trial's full collection scans the trials' objects
        undo.add("the collector's objects", lambda: set_aside.__exit__(None, None, None))
        dummy = compat.of_namespace(trainer, "loggers.logger", "DummyLogger")
        undo.set(trainer, "loggers", [dummy()] if trainer.loggers else [])
        undo.set(trainer, "limit_val_batches", 0)
        undo.set(trainer, "limit_train_batches", self.batches)
        undo.set(loop.epoch_loop, "max_steps", -1 if self.manual else self.steps_per_trial)
        undo.set(loop, "min_epochs", None)
        undo.set(loop.epoch_loop, "min_steps", None)
        undo.add("the train loader", lambda: compat.reset_train_loader(trainer))
        #: DDP's gradient buckets, counted as a baseline on the host (read before the wrapper is set aside)
        self.ddp_bucket_bytes = _ddp_bucket_bytes(trainer, self.module)
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            undo.set(trainer.strategy, "model", self.module)
        if trainer.world_size > 1:
            compat.skip_sigterm_broadcast(loop.epoch_loop)
            undo.add("the SIGTERM broadcast", lambda: compat.restore_sigterm_broadcast(loop.epoch_loop))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        failed = self._undo.undo()
        if (card := device_for(self.module.device)).is_cuda:  # training starts as on a fresh card, as each trial
            card.empty_cache(workspaces=True)
        if failed and exc_info[0] is None:
            raise failed[0][1]

    def loader(self, batch_size: int) -> Any:
        """A copy of the user's loader at ``batch_size`` whose every batch is full, of the largest samples."""
        sizes, sized = self.session.sample_sizes()
        if not sized:
            return self.session.loader(batch_size=batch_size)
        dataset = self.session.probe_loader().dataset
        order = sizes.order[:1] if sizes is not None else list(range(len(dataset)))
        length = max(len(dataset), batch_size * self.batches * self.trainer.world_size)
        return self.session.loader(TrialSampler(order, length), batch_size=batch_size)

    def run(
        self, batch_size: int, budget_bytes: int, capacity_bytes: int, capped: bool = True, steps: Optional[int] = None
    ) -> TrialOutcome:
        """One trial at ``batch_size`` on this rank: fits when it did not run out of memory and its peak stayed
        within ``budget_bytes`` (``capped=False``: measured without a cap)."""
        trainer, module = self.trainer, self.module
        assert self.state is not None
        lightning_setattr(module, self.batch_arg_name, batch_size)  # as training will hold it
        compat.reset_train_loader(trainer)
        self.session.processed_loader(lambda: self.loader(batch_size))  # collectives: on every rank
        self.state.reset_for_trial()
        prefetched = getattr(compat.data_fetcher(trainer), "batches", [])
        existing = (module, *trainer.optimizers, prefetched)
        card = device_for(module.device)
        if card.is_cuda:
            card.empty_cache(workspaces=True)  # as on a fresh card (an earlier trial's cuBLAS workspaces split one)
        limit = (capacity_bytes if card.is_cuda else budget_bytes) if capped else None
        meter = card.memory_cap(limit, existing, self.ddp_bucket_bytes)  # DDP's buckets: 0 on a card
        outcome = call_catching_oom(functools.partial(self._steps, card, steps or self.steps_per_trial), meter)
        reserved = meter.peak_reserved_bytes if card.is_cuda else None
        peak = reserved if reserved is not None else meter.peak_bytes
        fitted = not outcome.out_of_memory and peak is not None and peak <= budget_bytes
        cap = (budget_bytes if not card.is_cuda else None) if capped else None
        allocated = None if meter.peak_bytes is None else int(meter.peak_bytes)
        edge = capped and card.is_cuda and (outcome.value or 0) > capacity_bytes - CUDA_SMALL_SEGMENT_BYTES  # reserved
        return TrialOutcome(fitted, None if peak is None else int(peak), cap, outcome.error_message, allocated, edge)

    def _steps(self, card: Any, wanted: int, meter: Any) -> int:
        """``wanted`` optimizer steps (more batches after a skipped scaler step); a CUDA card's reserved bytes."""
        trainer, epoch_loop = self.trainer, self.trainer.fit_loop.epoch_loop
        steps = _TrialSteps(list(trainer.optimizers), wanted if self.manual else 0)
        trainer.callbacks = [steps]
        fetcher = compat.data_fetcher(trainer)
        epoch_loop.max_steps = -1 if self.manual else wanted  # an earlier trial may have run more

        def run_on(more: int) -> None:  # the epoch goes on, ``more`` optimizer steps further
            epoch_loop.max_steps += more
            trainer.should_stop = False
            epoch_loop.run(fetcher)

        try:
            with meter:
                self.module.on_train_epoch_start()
                run_on(0)
                while not self.manual and (steps.stepped or [wanted])[0] < wanted and epoch_loop.max_steps < 2 * wanted:
                    run_on(1)
                return card.reserved_memory() if card.is_cuda else 0
        finally:
            self.batches_run, self.first_steps = self.batches_run + steps.begun, steps.first
            steps.remove()
            trainer.callbacks = []


def _ddp_bucket_bytes(trainer: Any, module: Any) -> int:
    """DDP's gradient buckets on the host (a CUDA allocator counts them already), added to a trial's budget."""
    model = trainer.strategy.model
    copied = isinstance(model, DistributedDataParallel) and not model.gradient_as_bucket_view
    if not copied or device_for(module.device).is_cuda:
        return 0
    return storage_bytes([p for p in module.parameters() if p.requires_grad])


def agreed(
    trainer: Any, outcome: TrialOutcome, budget_bytes: int, search_budget_bytes: int
) -> tuple[bool, Optional[int]]:
    """All ranks' verdict: fits only if it fitted on every rank; the peak is ``search_budget - min(headroom)``."""
    peak = outcome.peak_bytes
    if trainer.world_size <= 1:
        return outcome.fitted, peak
    rows = gather_ranks(trainer, [float(outcome.fitted), float(peak is not None), budget_bytes - (peak or 0)])
    known = [row[2] for row in rows if row[1]]
    agreed_peak = int(search_budget_bytes - min(known)) if len(known) == len(rows) else None
    return all(row[0] for row in rows), agreed_peak
