"""The estimate that starts a search: the largest batch predicted from a step traced on fake tensors, on a
batch of the trials' own loader, refined by traces near the limit."""

from __future__ import annotations

from typing import Any, Optional

from lightning_gpuopt.callbacks._engine.steps import loss_function
from lightning_gpuopt.callbacks._engine.trials import Trials
from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep
from lightning_gpuopt.core.loader import batch_samples


def trial_batch(trials: Trials, batch_size: int) -> Any:
    """A batch of the trials' loader at ``batch_size``, on the module's device."""
    trainer = trials.trainer
    return trainer.strategy.batch_to_device(next(iter(trials.loader(batch_size))))


def sizes_note(trials: Trials) -> Optional[str]:
    """What the search says when sample sizes vary (the trials then use the largest sample everywhere)."""
    sizes, _ = trials.session.sample_sizes()
    if sizes is None:
        return None
    seen = (
        f"over {sizes.probed:,} of {sizes.total:,} samples, all"
        if sizes.complete
        else f"over the {sizes.probed:,} of {sizes.total:,} samples looked at in the time allowed; a larger one may exist"
    )
    return (
        f"sample sizes vary ({sizes.smallest:,} to {sizes.largest:,} elements {seen}): the estimate and the"
        " trials used batches of the largest sample"
    )


def training_step(trials: Trials, batch: Any, accumulate: Optional[int] = None) -> TrainingStep:
    """The module's training step on ``batch``, as training runs it (precision, accumulation, DDP's buckets)."""
    trainer, module = trials.trainer, trials.module
    return TrainingStep(
        module,
        batch,
        loss_function(module),
        optimizers=list(trainer.optimizers[:1]) if len(trainer.optimizers) == 1 else [],
        batch_size=batch_samples(batch),
        step_context=trainer.precision_plugin.train_step_context,
        accumulate_grad_batches=trainer.accumulate_grad_batches if accumulate is None else accumulate,
        untraced=[("DDP gradient buckets", trials.ddp_bucket_bytes)] if trials.ddp_bucket_bytes else [],
    )


def predicted_largest_fit(
    trials: Trials, batch_size: int, budget: int
) -> tuple[Optional[int], Optional[float], list[str]]:
    """The estimate's largest batch for ``budget`` and its bytes per sample (``None``: no estimate), and notes."""
    note = sizes_note(trials)
    notes = [note] if note else []
    try:
        estimator = StepEstimator(training_step(trials, trial_batch(trials, batch_size)))
        estimate = estimator.estimate(budget)
        if estimate.method != "traced":
            reason = f"the step could not be traced on fake tensors ({estimate.not_traced_reason}); started at your batch size"
            return None, None, [reason, *notes]
        refined = estimator.refined(estimate)  # what no re-trace sees is counted: buckets, cuBLAS
        return refined.max_batch_size, refined.bytes_per_sample, notes
    except Exception as error:  # noqa: BLE001 - without an estimate the search starts at the user's size
        return None, None, [f"no estimate ({type(error).__name__}: {error}); started at your batch size", *notes]
