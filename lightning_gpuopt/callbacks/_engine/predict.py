"""The estimate that starts a search: the largest batch predicted from a step traced on fake tensors, on a
batch of the trials' own loader, refined by traces near the limit."""

from __future__ import annotations

from typing import NamedTuple, Optional

from lightning_gpuopt.callbacks._engine.steps import loss_function
from lightning_gpuopt.callbacks._engine.trials import Trials
from lightning_gpuopt.core.allocator import largest_replayed_fit
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep
from lightning_gpuopt.core.loader import batch_samples


def sizes_note(trials: Trials) -> Optional[str]:
    """What the search says when sample sizes vary (the trials then use the largest sample everywhere)."""
    sizes, _ = trials.session.sample_sizes()
    if sizes is None:
        return None
    of = f"{sizes.probed:,} of {sizes.total:,} samples"
    seen = f"over {of}, all"
    if not sizes.complete:
        seen = f"over the {of} looked at in the time allowed; a larger one may exist"
    return (
        f"sample sizes vary ({sizes.smallest:,} to {sizes.largest:,} elements {seen}): the estimate and the"
        " trials used batches of the largest sample"
    )


def training_step(trials: Trials, batch_size: int) -> TrainingStep:
    """The module's training step on a batch of the trials' loader at ``batch_size``, on the module's device, as
    training runs it (precision, accumulation, DDP's buckets)."""
    trainer, module = trials.trainer, trials.module
    batch = trainer.strategy.batch_to_device(next(iter(trials.loader(batch_size))))
    return TrainingStep(
        module,
        batch,
        loss_function(module),
        optimizers=list(trainer.optimizers[:1]) if len(trainer.optimizers) == 1 else [],
        batch_size=batch_samples(batch),
        step_context=trainer.precision_plugin.train_step_context,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        untraced=[("DDP gradient buckets", trials.ddp_bucket_bytes)] if trials.ddp_bucket_bytes else [],
    )


class Prediction(NamedTuple):
    """The estimate's largest batch for a budget, bytes per sample (``None``: no estimate), notes and lines
    ``(fixed_bytes, bytes_per_sample)``."""

    largest: Optional[int]
    bytes_per_sample: Optional[float]
    notes: list[str]
    lines: tuple[tuple[float, float], ...] = ()
    #: where ``largest`` is the allocator replay's: the steps a trial needs for its answer to hold; else 0
    trial_steps: int = 0

    def peak_bytes(self, batch_size: int) -> Optional[int]:
        """The peak at ``batch_size``: the highest line there (each is exact only where traced)."""
        return int(max(fixed + per_sample * batch_size for fixed, per_sample in self.lines)) if self.lines else None


def predicted_largest_fit(trials: Trials, batch_size: int, budget: int) -> Prediction:
    """The estimate of the step on a batch of ``batch_size`` for ``budget``."""
    note = sizes_note(trials)
    notes = [note] if note else []
    try:
        estimator = StepEstimator(training_step(trials, batch_size))
        estimate = estimator.estimate(budget)
        if estimate.method != "traced":
            reason = f"the step could not be traced on fake tensors ({estimate.not_traced_reason}); started at your batch size"
            return Prediction(None, None, [reason, *notes])
        refined = estimator.refined(estimate)  # what no re-trace sees is counted: buckets, cuBLAS
        lines = tuple((e.fixed_bytes or 0.0, e.bytes_per_sample) for e in (estimate, refined) if e.bytes_per_sample)
        line, largest, steps = refined.max_batch_size, None, trials.steps_per_trial
        if estimator.card.is_cuda and line:  # the largest batch up to twice the line's whose steps, replayed, fit
            largest = largest_replayed_fit(estimator.allocations, budget, 2 * line, steps)
            held = largest and largest_replayed_fit(estimator.allocations, budget, 2 * largest, 2 * steps)
            if largest and held and held < largest:  # a warm cache fits fewer: every trial runs twice the steps
                largest, steps = held, 2 * steps
        return Prediction(largest or line, refined.bytes_per_sample, notes, lines, steps if largest else 0)
    except Exception as error:  # noqa: BLE001 - without an estimate the search starts at the user's size
        reason = f"no estimate ({type(error).__name__}: {error}); started at your batch size"
        return Prediction(None, None, [reason, *notes])
