"""What a callback changed in the Trainer, the model and the process, undone in one place.

Each callback registers every change it makes together with how to undo it. ``teardown`` (the
fit ended) and ``on_exception`` (it did not: an error, Ctrl+C, SIGTERM) both unwind the same
list, last change first, so no path can forget one; an undo that fails does not skip the others.

A change can be *lasting*: ``BatchSizeSearch`` keeps the batch size it found after a fit that
ended well (that is its result), but puts the user's back when the fit failed.

Example::

    >>> class Settings: precision = "32-true"
    >>> settings, changes = Settings(), Changes()
    >>> changes.set_attribute(settings, "precision", "bf16-mixed")
    >>> settings.precision
    'bf16-mixed'
    >>> changes.undo()
    []
    >>> settings.precision
    '32-true'
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.core.device import cuda_rng_in_use


@dataclass
class Change:
    """One change: what it is (for messages) and how to undo it."""

    description: str
    undo: Callable[[], Any]
    #: kept when the fit ends well (``Changes.finish``), undone only after a failure (``Changes.undo``)
    lasting: bool = False


@dataclass
class FailedUndo:
    """An undo that raised: the change and the error."""

    change: Change
    error: BaseException


class Changes:
    """A stack of undoable changes; see the module docstring."""

    def __init__(self) -> None:
        self._stack: list[Change] = []

    def __len__(self) -> int:
        return len(self._stack)

    def add(self, description: str, undo: Callable[[], Any], lasting: bool = False, undo_last: bool = False) -> None:
        """Register a change made (or about to be made) with the callable that undoes it; ``undo_last``:
        undone after every other change (e.g. the SIGINT handler, so Ctrl+C cannot cut the others short)."""
        change = Change(description, undo, lasting)
        if undo_last:
            self._stack.insert(0, change)
        else:
            self._stack.append(change)

    def set_attribute(self, owner: Any, name: str, value: Any, lasting: bool = False) -> None:
        """``setattr(owner, name, value)``, undone by setting the value it had before."""
        before = getattr(owner, name)
        self.add(f"{type(owner).__name__}.{name}", lambda: setattr(owner, name, before), lasting)
        setattr(owner, name, value)

    def undo(self) -> list[FailedUndo]:
        """Undo every change, last first (after a failed fit); returns the undos that raised."""
        return self._unwind(keep_lasting=False)

    def finish(self) -> list[FailedUndo]:
        """Undo the temporary changes and forget the lasting ones (after a fit that ended well)."""
        return self._unwind(keep_lasting=True)

    def _unwind(self, keep_lasting: bool) -> list[FailedUndo]:
        failed: list[FailedUndo] = []
        while self._stack:
            change = self._stack.pop()
            if keep_lasting and change.lasting:
                continue
            try:
                change.undo()
            except Exception as error:  # noqa: BLE001 - the other undos must still run
                failed.append(FailedUndo(change, error))
        return failed


def warn_failed_undos(owner: str, failed: list[FailedUndo]) -> None:
    """After an exception: say which changes could not be undone (raising would hide the exception)."""
    for item in failed:
        rank_zero_warn(
            f"{owner}: could not undo the change of {item.change.description} after the failed fit "
            f"({type(item.error).__name__}: {item.error})."
        )


def raise_failed_undos(owner: str, failed: list[FailedUndo]) -> None:
    """At teardown: every undo ran; raise the first failure, naming all of them."""
    if not failed:
        return
    names = ", ".join(item.change.description for item in failed)
    raise RuntimeError(
        f"{owner}: could not undo the change of {names} at teardown: "
        f"{type(failed[0].error).__name__}: {failed[0].error}"
    ) from failed[0].error


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The loader's own generators (its ``generator`` and its sampler's), which iterating it draws from."""
    candidates = (
        getattr(loader, "generator", None),
        getattr(getattr(loader, "sampler", None), "generator", None),
        getattr(getattr(getattr(loader, "batch_sampler", None), "sampler", None), "generator", None),
    )
    return [gen for gen in candidates if isinstance(gen, torch.Generator)]


@contextlib.contextmanager
def rng_preserved(loader: Optional[Any] = None) -> Iterator[None]:
    """The global RNG states (torch, CUDA when in use, numpy, Python's ``random``) and ``loader``'s
    own generators are as they were once the block ends: building a loader iterator draws its
    seeds from them, and training must draw the same numbers as a run without our work.

    Example::

        >>> before = torch.get_rng_state()
        >>> with rng_preserved():
        ...     _ = torch.rand(3)
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    generators = loader_generators(loader) if loader is not None else []
    states = compat.collect_rng_states(include_cuda=cuda_rng_in_use())
    generator_states = [gen.get_state() for gen in generators]
    try:
        yield
    finally:
        compat.set_rng_states(states)
        for gen, state in zip(generators, generator_states):
            gen.set_state(state)
