"""The memory levers' decisions for :class:`~lightning_gpuopt.MemoryFill` (mixed precision, activation
checkpointing, micro-batch, accumulation and the learning rate's rule), pure: measurements come in as figures
or as oracles that run real trials. :class:`MemoryFillPlan` is what was decided and measured."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from lightning_gpuopt.core.oom import OomAdaptation

MIXED_PRECISIONS = ("bf16-mixed", "16-mixed")  #: precisions MemoryFill may switch to
#: what ``precision=`` accepts (Lightning's short forms too) and what each means; ``None``/``"32-true"``: no switch
PRECISIONS = {"auto": "auto", "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed", "bf16-mixed": "bf16-mixed",
              "bf16": "bf16-mixed", "32-true": None, "32": None, 32: None, None: None}  # fmt: skip


def checked_precision(value: object) -> Optional[str]:
    """``value`` as ``"auto"``, a mixed precision or ``None`` (no switch), else a ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, type(None))) or value not in PRECISIONS:
        expected = "'auto' (mixed precision on GPUs), '16-mixed', 'bf16-mixed', or None / '32-true' (no switch)"
        message = f"`precision`={value!r} is not a precision MemoryFill switches to; expected {expected}."
        yourself = "set Trainer(precision=...) yourself: a precision set on the Trainer is kept"
        raise ValueError(f"{message} For '16-true', 'bf16-true' or '64-true', {yourself}.")
    return PRECISIONS[value]


LR_RULES = ("linear", "sqrt")  #: the lr of a batch grown k times: k times (Goyal et al. 2017), or sqrt(k) (Adam-like)


def lr_note(rule: Optional[str], grown: float, lr: float, how: str = "scale_lr") -> tuple[float, str]:
    """The factor ``rule`` scales the learning rate by for a batch ``grown`` times the user's, and the report's line.

    >>> lr_note("linear", 4.0, 0.05)
    (4.0, "scale_lr='linear': the global batch is 4x yours, lr 0.05 → 0.2 (all groups, schedules)")
    >>> lr_note(None, 4.0, 0.05)[1]
    "the global batch is 4x yours, lr kept at 0.05: the linear rule would set 0.2, the sqrt rule 0.1 (scale_lr='linear' or 'sqrt' applies one)"
    """
    factors, head = {"linear": grown, "sqrt": math.sqrt(grown)}, f"the global batch is {grown:.4g}x yours"
    if rule is None:
        would = f"the linear rule would set {lr * grown:.4g}, the sqrt rule {lr * factors['sqrt']:.4g} ({how}='linear' or 'sqrt' applies one)"
        return 1.0, f"{head}, lr kept at {lr:.4g}: {would}"
    return factors[rule], f"scale_lr={rule!r}: {head}, lr {lr:.4g} → {lr * factors[rule]:.4g} (all groups, schedules)"


def choose_precision(
    precision: Optional[str], device_type: str, *, current: str, bf16_supported: bool, asked: bool = True
) -> tuple[Optional[str], str]:
    """The mixed precision to switch a ``32-true`` run to (``None``: leave it) and why; ``"auto"`` on CUDA only.
    ``asked``: whether ``current`` is what the user set.

    >>> choose_precision("auto", "cuda", current="32-true", bf16_supported=True)
    ('bf16-mixed', 'bf16-mixed: the GPU supports bfloat16')
    """
    if precision is None:
        return None, "precision=None: the Trainer's precision kept"
    if current != "32-true":
        how = "" if asked else ", or Lightning chose it (on CPU it runs '16-mixed' as 'bf16-mixed')"
        return None, f"precision={current!r} was set explicitly{how}: left as it is"
    if precision != "auto":
        if device_type == "cpu" and precision == "16-mixed":
            return "bf16-mixed", "bf16-mixed: precision='16-mixed' on CPU runs as bfloat16 (as Lightning runs it)"
        return precision, f"{precision}: asked for with precision={precision!r}"
    if device_type == "cuda":
        if bf16_supported:
            return "bf16-mixed", "bf16-mixed: the GPU supports bfloat16"
        return "16-mixed", "16-mixed with a gradient scaler: the GPU has no bfloat16"
    if device_type == "cpu":
        return None, "precision='auto' leaves CPU runs in float32 (pass precision='bf16-mixed' for it on CPU)"
    return None, f"no mixed precision for a {device_type!r} device"


def split_global_batch(samples_per_rank: int, largest_fit: int) -> tuple[int, int]:
    """``(micro_batch_size, accumulate_grad_batches)``: as few steps as the largest fit allows, evened out.

    >>> split_global_batch(100, largest_fit=32), split_global_batch(64, largest_fit=200)  # 4 x 25, not 4 x 32
    ((25, 4), (64, 1))
    """
    if samples_per_rank < 1 or largest_fit < 1:
        raise ValueError(f"samples_per_rank={samples_per_rank} and largest_fit={largest_fit} must be >= 1")
    steps = math.ceil(samples_per_rank / largest_fit)
    for exact in range(steps, min(2 * steps, samples_per_rank) + 1):
        if samples_per_rank % exact == 0:
            return samples_per_rank // exact, exact
    return math.ceil(samples_per_rank / steps), steps


@dataclass(frozen=True)
class FillRequest:
    """What a plan must reach: ``samples_per_rank`` per optimizer step, with ``fixed_accumulation`` steps when the
    accumulation is not ours to choose. ``fill``: the largest micro-batch that fits, up to ``samples_per_rank``."""

    samples_per_rank: int
    min_micro_batch_size: int = 8
    fixed_accumulation: Optional[int] = None
    objective: str = "throughput"  #: "throughput": the largest fitting micro-batch; "memory": the wanted one, no larger
    may_checkpoint: bool = False  #: checkpointing may still be switched on (``activation_checkpointing="auto"``)
    fill: bool = False

    @property
    def needed(self) -> int:
        """The micro-batch the global batch needs at the fixed accumulation (all samples without one)."""
        return self.samples_per_rank // (self.fixed_accumulation or 1)

    @property
    def wanted(self) -> int:
        """The micro-batch below which checkpointing pays: ``min_micro_batch_size``, at most what is needed."""
        free = self.fixed_accumulation is None or self.fill
        return min(self.min_micro_batch_size, self.needed) if free else self.needed


@dataclass
class FillDecision:
    """The micro-batch and accumulation a plan chose, the largest micro-batch that fitted, and why."""

    micro_batch_size: int
    accumulate_grad_batches: int
    largest_fit: int
    reasons: list[str] = field(default_factory=list)


class NoFit(Exception):
    """Not even a micro-batch of 1 fits (``largest`` is ``None``), or less than a fixed accumulation needs."""

    def __init__(self, largest: Optional[int], needed: int) -> None:
        super().__init__(largest, needed)
        self.largest, self.needed = largest, needed


def plan_micro_batches(
    request: FillRequest, largest_fit: Callable[[int, bool], Optional[int]], checkpoint: Callable[[str], bool]
) -> FillDecision:
    """The plan, from two oracles: ``largest_fit(upper, accumulating)`` (``None``: not even 1 fits) and
    ``checkpoint(reason)``, which switches activation checkpointing on (``True``: it is on).

    >>> fits = lambda upper, accumulating: min(upper, 24 if accumulating else 32)
    >>> decision = plan_micro_batches(FillRequest(100), fits, checkpoint=lambda reason: False)
    >>> decision.micro_batch_size, decision.accumulate_grad_batches, decision.largest_fit  # 5 x 20: exact
    (20, 5, 24)
    """
    reasons: list[str] = []
    needed, wanted = request.needed, request.wanted
    free_accumulation = request.fixed_accumulation is None
    upper = wanted if request.objective == "memory" and free_accumulation else needed
    largest = largest_fit(upper, False)
    if (largest is None or largest < wanted) and request.may_checkpoint:
        found = "no micro-batch" if largest is None else f"a largest micro-batch of {largest}"
        if checkpoint(f"the trials found {found} < {wanted} without it"):
            largest = largest_fit(upper, False)
    if request.fill and largest is not None:
        return FillDecision(largest, request.fixed_accumulation or 1, largest, reasons)
    if largest is not None and largest < needed and free_accumulation:
        accumulating = largest_fit(largest, True)
        if accumulating != largest:
            when = f"{accumulating} when accumulating (earlier micro-batches' gradients stay alive)"
            reasons.append(f"largest micro-batch {largest} without accumulation, {when}")
        largest = accumulating
    if largest is None or (not free_accumulation and largest < needed):
        raise NoFit(largest, needed)
    if not free_accumulation:
        return FillDecision(needed, request.fixed_accumulation or 1, largest, reasons)
    return FillDecision(*split_global_batch(request.samples_per_rank, largest), largest, reasons)


@dataclass
class MemoryFillPlan:
    """What MemoryFill decided (the same on every rank) and the memory it predicted and measured."""

    precision: str
    checkpointing: bool
    micro_batch_size: int
    accumulate_grad_batches: int
    #: samples per optimizer step over all ranks, and the number asked for (they differ when no split is exact)
    global_batch_size: int
    requested_global_batch_size: int
    world_size: int = 1
    #: qualified names and classes of the checkpointed blocks
    checkpointed_modules: list[str] = field(default_factory=list)
    checkpointed_classes: list[str] = field(default_factory=list)
    #: the run's settings before MemoryFill
    initial_precision: str = "32-true"
    initial_batch_size: int = 0
    initial_accumulate_grad_batches: int = 1
    #: the largest micro-batch that fitted, the trials' budget, the peak predicted at ``micro_batch_size`` and measured
    largest_fit: Optional[int] = None
    budget_bytes: Optional[int] = None
    predicted_peak_bytes: Optional[int] = None
    measured_peak_bytes: Optional[int] = None
    lr_change: Optional[tuple[float, float]] = None  #: the lr before and after ``scale_lr`` (``None``: not scaled)
    reasons: list[str] = field(default_factory=list)  #: why each lever was (not) used, in the order decided
    seconds: float = 0.0
    on_oom: str = "raise"  #: ``"adapt"`` or ``"raise"``, and each out-of-memory error absorbed
    oom_adaptations: list[OomAdaptation] = field(default_factory=list)

    @property
    def changes(self) -> list[str]:
        """The settings the plan changed, as ``"name: before → after"`` lines (empty: nothing changed)."""
        blocks = f"on for {len(self.checkpointed_modules)} blocks ({', '.join(self.checkpointed_classes)})"
        settings = [
            ("precision", self.initial_precision, self.precision),
            ("activation checkpointing", None, blocks if self.checkpointing else None),
            ("batch size", self.initial_batch_size, self.micro_batch_size),
            ("accumulate_grad_batches", self.initial_accumulate_grad_batches, self.accumulate_grad_batches),
            ("learning rate", *(self.lr_change or (None, None))),
        ]
        return [f"{name}: {'' if old is None else f'{old} → '}{new}" for name, old, new in settings if old != new]
