"""MemoryFill's activation checkpointing in a run: which blocks, switched on, checked, refused or kept.

A model's own switch (HuggingFace) is used unless the user named the blocks; other blocks are wrapped one group per
class. Each group must give the plain step's loss, gradients and buffers on every rank before anything trains, else
it is refused with the reason. Every switch is registered in the callback's :class:`Undo`."""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpuopt.callbacks._engine import FitSession, TrainingState, Undo
from lightning_gpuopt.callbacks._engine.steps import loss_function
from lightning_gpuopt.callbacks._engine.trials import gather_ranks
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
from lightning_gpuopt.core.estimate import sliced_batch
from lightning_gpuopt.core.loader import batch_samples

__all__ = ["BlockSpec", "Checkpointing", "checked_setting"]

CHECK_SAMPLES = 2  #: samples of a batch on which a checkpointed step is checked against a plain one
_SWITCH_WORDS = ("true", "false", "yes", "no", "on", "off", "none", "null", "1", "0")  #: refused, not class names


def checked_setting(value: Any) -> Union[str, bool, list]:
    """``"auto"``, ``True``, ``False`` or a non-empty list of module classes or names, else a ``ValueError``."""
    works = "must be 'auto', True, False or a list of module classes / class names / module names, e.g. ['TransformerEncoderLayer']"
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.strip() and value.strip().lower() not in _SWITCH_WORDS:
        return [value]
    switch = " (a str, not a switch: write True or False without quotes)" if isinstance(value, str) else ""
    is_list = isinstance(value, (list, tuple)) and len(value) > 0
    if switch or not is_list or not all(isinstance(v, type) or (isinstance(v, str) and v.strip()) for v in value):
        raise ValueError(f"`activation_checkpointing` {works}, got {value!r}{switch}.")
    return list(value)


class Checkpointing:
    """The checkpointed blocks of one fit (see the module docstring); ``reasons`` gets what was decided."""

    def __init__(
        self, module: Any, setting: Union[str, bool, Sequence[BlockSpec]], undo: Undo, reasons: list[str]
    ) -> None:
        self.module, self.setting, self.undo, self.reasons = module, setting, undo, reasons
        self.on: Optional[CheckpointedBlocks] = None  #: the blocks kept (checked); ``None``: none
        self._unchecked: list[tuple[CheckpointedBlocks, list]] = []
        self._reason, self._tried = "", setting is False

    @property
    def explicit(self) -> bool:
        return self.setting is True or isinstance(self.setting, list)

    @property
    def may_switch_on(self) -> bool:
        """Whether ``"auto"`` may still switch checkpointing on (not tried yet, and there are blocks)."""
        return self.setting == "auto" and not self._tried and bool(find_repeated_blocks(self.module))

    def decide_in_setup(self, objective: str) -> None:
        """Explicit blocks on now; ``objective='memory'`` on."""
        if self.setting is False:
            return
        if self.explicit:
            spec = self.setting
            blocks = find_repeated_blocks(self.module) if spec is True else select_blocks(self.module, spec)
            if not blocks:
                raise MisconfigurationException(_no_blocks_message(self.module))
            self.switch_on(f"activation_checkpointing={self.setting!r}", blocks)
        elif not find_repeated_blocks(self.module):
            reason = f"no repeated blocks to checkpoint in {type(self.module).__name__} (pass activation_checkpointing=[classes] to choose some)"
            if objective == "memory":
                reason += ": the smallest footprint falls back to the smallest micro-batch and accumulation"
                rank_zero_info(f"MemoryFill: {reason}")
            self.reasons.append(reason)
            self._tried = True
        elif objective == "memory":
            self.switch_on("objective='memory': the smallest footprint")

    def switch_on(self, reason: str, blocks: Optional[list] = None) -> None:
        """``blocks`` (default: the repeated ones) on, to be checked (:meth:`check`) before anything trains."""
        blocks = find_repeated_blocks(self.module) if blocks is None else blocks
        self._tried, self._reason = True, reason
        native = [] if isinstance(self.setting, list) else native_checkpointing_owners(self.module)
        groups: list[tuple[CheckpointedBlocks, list]] = []
        for owner_name, owner in native:
            inside = [(n, m) for n, m in blocks if not owner_name or n.startswith(owner_name + ".")]
            if not inside:
                continue
            handle = self._registered(enable_native_checkpointing([(owner_name, owner)]))
            if handle.names:
                groups.append((handle, inside))
                blocks = [block for block in blocks if block not in inside]
            else:  # its switch flagged no layer (an old-style model): ours on its blocks
                handle.remove()
        by_class: dict[type, list] = {}
        for name, module in blocks:
            by_class.setdefault(type(module), []).append((name, module))
        groups.extend((self._registered(enable_checkpointing(members)), []) for members in by_class.values())
        self._unchecked = [(handle, fallback) for handle, fallback in groups if handle.names or fallback]
        self.on = CheckpointedBlocks.joined([handle for handle, _ in self._unchecked])

    def _registered(self, handle: CheckpointedBlocks) -> CheckpointedBlocks:
        self.undo.add("activation checkpointing", handle.remove)
        return handle

    def check(self, session: FitSession) -> None:
        """Keep each unchecked group only when a step with it gives the plain step's loss and gradients."""
        groups, self._unchecked = self._unchecked, []
        if not groups:
            return
        if not self.module.automatic_optimization:
            self._keep([handle for handle, _ in groups], "not checked: manual optimization steps the optimizers itself")
            return
        kept, refused = list[CheckpointedBlocks](), list[tuple[CheckpointedBlocks, str]]()
        while groups:  # a second round checks the fallbacks of the model's own switches that failed
            handles, retry = [handle for handle, _ in groups], list[tuple[CheckpointedBlocks, list]]()
            for (handle, fallback), problem in zip(groups, self._problems(session, handles, [*kept, *handles])):
                if problem is None:
                    kept.append(handle)
                    continue
                retried = handle.native and fallback  # the model's own switch failed: ours on the same blocks
                handle.remove()
                if retried:
                    retry.append((self._registered(enable_checkpointing(fallback)), []))
                    own = handle.method or f"{type(self.module).__name__} own checkpointing"
                    self.reasons.append(f"{own} refused: {problem}; torch.utils.checkpoint on its blocks instead")
                else:
                    refused.append((handle, problem))
            groups = retry
        self._keep(kept, "recomputation checked: same loss and gradients as a plain step")
        self._refuse(refused, kept)

    def _problems(
        self, session: FitSession, groups: list[CheckpointedBlocks], enabled: list[CheckpointedBlocks]
    ) -> list[Optional[str]]:
        """Per group, why a step with it alone of ``enabled`` on differs from a plain step (``None``: it does not)."""
        trainer, module = session.trainer, self.module
        state = TrainingState(trainer)  # weights, grads, RNG states and attributes are put back
        try:
            try:
                batch = trainer.strategy.batch_to_device(next(iter(session.loader(batch_size=CHECK_SAMPLES))))
                batch = sliced_batch(batch, batch_samples(batch), CHECK_SAMPLES)
            except Exception as error:  # noqa: BLE001 - no batch to check on: refuse with the reason
                why = f"no batch to check the recomputation on ({type(error).__name__}: {error})"
                problems: list[Optional[str]] = [why] * len(groups)
            else:
                problems, context, loss_of = [], trainer.precision_plugin.train_step_context, loss_function(module)
                for group in groups:
                    with contextlib.ExitStack() as others:
                        for other in (other for other in enabled if other is not group):
                            others.enter_context(other.paused())
                        problems.append(check_recomputation(module, loss_of, batch, group, step_context=context))
        finally:
            state.restore()
        agreed = [all(row[0] for row in gather_ranks(trainer, [float(problem is None)])) for problem in problems]
        return [p if p is not None or ok else "another rank's recomputation differs" for p, ok in zip(problems, agreed)]

    def _keep(self, kept: list[CheckpointedBlocks], check: str) -> None:
        self.on = CheckpointedBlocks.joined(kept) if kept else None
        if self.on is not None:
            blocks = f"{len(self.on.names)} {'/'.join(self.on.classes)} blocks"
            self.reasons.append(f"activation checkpointing on {blocks} ({self.on.method}; {check}): {self._reason}")

    def _refuse(self, refused: list, kept: list) -> None:
        for handle, problem in refused:
            blocks = f"{len(handle.names)} {'/'.join(handle.classes)} blocks"
            differs = f"a checkpointed step differs from a plain one ({problem})"
            self.reasons.append(f"activation checkpointing refused for {blocks}: {differs}")
        if not refused:
            return
        if self.explicit and not kept:
            handle, problem = refused[0]
            what = f"activation_checkpointing={self.setting!r} on {type(self.module).__name__}"
            instead = "Pass activation_checkpointing=[classes] naming blocks whose forward has no side effects, or activation_checkpointing=False."
            differs = f"a training step with its {'/'.join(handle.classes)} blocks checkpointed differs"
            raise MisconfigurationException(f"MemoryFill: {what}: {differs} from the plain step ({problem}). {instead}")
        (rank_zero_warn if self.explicit else rank_zero_info)(f"MemoryFill: {self.reasons[-1]}")


def _no_blocks_message(module: Any) -> str:
    """The refusal of ``activation_checkpointing=True`` on a model without repeated blocks, with classes to name."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    subs = [sub for name, sub in module.named_modules() if name and not isinstance(sub, containers)]
    nested = [s for s in subs if next(s.parameters(), None) is not None and next(s.children(), None) is not None]
    candidates = list(dict.fromkeys(type(sub).__name__ for sub in nested))
    instead = f"Pass the module classes or qualified module names to checkpoint, e.g. activation_checkpointing={candidates[:2]}, "
    instead = instead if candidates else "It has no submodule with parameters and submodules of its own to checkpoint: "
    found = f"found no repeated blocks in {type(module).__name__} (same-class children of an nn.ModuleList/nn.Sequential with parameters and submodules)"
    auto = "activation_checkpointing='auto' (checkpoints the blocks it finds, else goes on without and says so)"
    return f"MemoryFill: activation_checkpointing=True {found}. {instead}or {auto}, or activation_checkpointing=False."
