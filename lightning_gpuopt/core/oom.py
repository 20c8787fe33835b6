"""Out-of-memory recovery in training (``MemoryFill(on_oom="adapt")``): split a batch into micro-batches,
and decide how small: after an error at ``m`` samples of ``e`` elements each, samples of ``e`` elements
or more train in at most ``m // 2``. Micro-batch losses weighted by their share of the samples give the
batch's gradient **when the loss is a mean over the batch's samples** (``reduction="mean"``).

    >>> batch = {"x": torch.arange(10.0).reshape(5, 2), "y": torch.arange(5)}
    >>> [(len(part["y"]), weight) for part, weight in split_batch(batch, 2, batch_size=5)]
    [(2, 0.4), (2, 0.4), (1, 0.2)]
    >>> limits = MicroBatchLimits()
    >>> limits.adapt(step=7, attempted=8, elements=512, reason="CUDA out of memory").new_micro_batch_size
    4
    >>> limits.limit_for(512), limits.limit_for(1024), limits.limit_for(100)
    (4, 4, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_gpuopt.core.op_memory import leaves


class BatchSplitError(ValueError):
    """The batch cannot be cut into micro-batches (a tensor whose first dimension is not the batch's)."""


class OutOfMemoryAtOneSampleError(torch.OutOfMemoryError):
    """Even a micro-batch of one sample ran out of memory: nothing smaller can be tried."""


@dataclass
class OomAdaptation:
    """One out-of-memory error absorbed by smaller micro-batches."""

    step: int  # trainer.global_step
    batch_idx: int
    old_micro_batch_size: int
    new_micro_batch_size: int
    sample_elements: int  # the new limit holds for samples at least this large
    reason: str  #: where it happened ("forward" / "backward"; under DDP which ranks) and the error's first line


@dataclass
class MicroBatchLimits:
    """Micro-batch limits learned from out-of-memory errors, by size of sample."""

    #: ``(sample_elements, micro_batch_size)``: samples this large or larger train in at most this many
    limits: list[tuple[int, int]] = field(default_factory=list)
    adaptations: list[OomAdaptation] = field(default_factory=list)

    def limit_for(self, elements: int) -> Optional[int]:
        """The largest micro-batch allowed for samples of ``elements`` elements (``None``: no limit)."""
        return min((size for threshold, size in self.limits if threshold <= elements), default=None)

    def adapt(self, *, step: int, attempted: int, elements: int, reason: str, batch_idx: int = 0) -> OomAdaptation:
        """An OOM at ``attempted`` samples of ``elements`` elements: try half (at 1: OutOfMemoryAtOneSampleError)."""
        if attempted <= 1:
            done = [f"{a.old_micro_batch_size} → {a.new_micro_batch_size} (step {a.step})" for a in self.adaptations]
            at_one = f"out of memory with a micro-batch of 1 sample ({elements} elements per sample) at step {step}"
            instead = "Free memory (a smaller model, mixed precision, activation checkpointing, shorter samples) or use a larger device."
            tried = f"Adaptations so far: {', '.join(done) or 'none'}. Last error: {reason}."
            raise OutOfMemoryAtOneSampleError(f"{at_one}: nothing smaller can be tried. {tried} {instead}")
        adaptation = OomAdaptation(step, batch_idx, attempted, attempted // 2, elements, reason)
        self.limits.append((elements, attempted // 2))
        self.adaptations.append(adaptation)
        return adaptation


def sample_elements(batch: Any, batch_size: int) -> int:
    """Elements per sample of ``batch`` (its tensors' elements / ``batch_size``, summed): the size of sample
    :class:`MicroBatchLimits` keys on (a padded batch of long sequences has more)."""
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    return sum(tensor.numel() // max(1, batch_size) for tensor in tensors)


def split_batch(batch: Any, size: int, *, batch_size: int) -> list[tuple[Any, float]]:
    """``batch`` cut into micro-batches of at most ``size`` samples along dimension 0, each weighted by its share of
    ``batch_size`` (views; containers rebuilt; 0-dim tensors, other leaves shared; other lengths: BatchSplitError)."""
    if size < 1 or batch_size < 1:
        raise ValueError(f"size={size} and batch_size={batch_size} must be >= 1")
    bounds = [(start, min(start + size, batch_size)) for start in range(0, batch_size, size)]
    return [(_slice(batch, start, stop, batch_size), (stop - start) / batch_size) for start, stop in bounds]


def _slice(batch: Any, start: int, stop: int, batch_size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != batch_size:
            held = f"it holds a tensor of shape {tuple(batch.shape)} whose first dimension is not {batch_size}"
            how = "Recovery from out-of-memory errors cuts every tensor of the batch along dimension 0; put the samples first, or use on_oom='raise'."
            raise BatchSplitError(f"cannot split a batch of {batch_size} samples: {held}. {how}")
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)((key, _slice(value, start, stop, batch_size)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)):
        parts = [_slice(value, start, stop, batch_size) for value in batch]  # a named tuple takes them as arguments
        return type(batch)(*parts) if isinstance(batch, tuple) and hasattr(batch, "_fields") else type(batch)(parts)
    return batch
