"""The one undo mechanism: every change our callbacks make to the Trainer, the model and the process.

A change is registered together with how to undo it, at the moment it is made. ``finish()`` (the
fit ended well: ``teardown``) undoes the temporary changes and keeps the *lasting* ones (the batch
size a search found is its result); ``undo()`` (the fit failed: ``on_exception``) undoes them all.
Both unwind last change first, and an undo that raises skips none of the others. ``scope()`` is a
nested log unwound when its block ends (a trial's settings, a measurement's state).

SIGTERM and Ctrl+C during our work before training (:func:`signals_stop_our_work`): Lightning
installs its SIGTERM handler only after ``on_fit_start``, so around our work a handler does what
Lightning's does during training (logs, stops the launcher's processes, chains the user's handler,
sets ``received_sigterm`` so a trial stops after its step, then ``SIGTERMException`` leaves ``fit``).
Lightning ignores SIGINT from the moment it catches a ``KeyboardInterrupt`` and never puts it back:
when the interrupt came during our work, the handler the process had is put back last.

Example::

    >>> class Settings: precision = "32-true"
    >>> settings, undo = Settings(), Undo()
    >>> undo.set(settings, "precision", "bf16-mixed")
    >>> settings.precision
    'bf16-mixed'
    >>> undo.undo()
    []
    >>> settings.precision
    '32-true'
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_warn

from lightning_gpuopt.callbacks import _lightning_compat as compat

log = logging.getLogger(__name__)
_ABSENT = object()


@dataclass
class Change:
    """One change: what it is (for messages), how to undo it, and whether a fit that ended well keeps it."""

    description: str
    undo: Callable[[], Any]
    lasting: bool = False


@dataclass
class FailedUndo:
    change: Change
    error: BaseException


class Undo:
    """A stack of undoable changes (see the module docstring)."""

    def __init__(self) -> None:
        self._stack: list[Change] = []

    def __len__(self) -> int:
        return len(self._stack)

    def add(self, description: str, undo: Callable[[], Any], lasting: bool = False, last: bool = False) -> None:
        """Register a change with the callable that undoes it; ``last``: undone after every other one."""
        change = Change(description, undo, lasting)
        if last:
            self._stack.insert(0, change)
        else:
            self._stack.append(change)

    def set(self, owner: Any, name: str, value: Any, lasting: bool = False) -> None:
        """``owner.name = value`` (or ``owner[name]`` for a mapping), undone by the value it had (or
        by deleting it when it had none)."""
        if isinstance(owner, MutableMapping):
            before = owner.get(name, _ABSENT)
            owner[name] = value
        else:
            before = _current(owner, name)
            setattr(owner, name, value)
        self.add(f"{type(owner).__name__}.{name}", lambda: _put_back(owner, name, before), lasting)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Undo]:
        """A nested log whose changes are undone when the block ends (first failure raised after all ran)."""
        inner = Undo()
        try:
            yield inner
        finally:
            failed = inner.undo()
            if failed:
                raise RuntimeError(f"could not undo {failed[0].change.description}") from failed[0].error

    def undo(self) -> list[FailedUndo]:
        """Undo every change, last first; returns the undos that raised."""
        return self._unwind(keep_lasting=False)

    def finish(self) -> list[FailedUndo]:
        """Undo the temporary changes and forget the lasting ones."""
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


def _current(owner: Any, name: str) -> Any:
    """What to put back: a property's value (set again through it), else the instance attribute, or
    ``_ABSENT`` when there is none (an attribute or method patched on the instance is deleted on undo)."""
    if isinstance(getattr(type(owner), name, None), property) or not hasattr(owner, "__dict__"):
        return getattr(owner, name)
    return vars(owner).get(name, _ABSENT)


def _put_back(owner: Any, name: str, before: Any) -> None:
    if isinstance(owner, MutableMapping):
        if before is _ABSENT:
            owner.pop(name, None)
        else:
            owner[name] = before
    elif before is _ABSENT:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, before)


def warn_failed(owner: str, failed: list[FailedUndo]) -> None:
    """After an exception: say which changes could not be undone (raising would hide the exception)."""
    for item in failed:
        rank_zero_warn(
            f"{owner}: could not undo the change of {item.change.description} after the failed fit "
            f"({type(item.error).__name__}: {item.error})."
        )


def raise_failed(owner: str, failed: list[FailedUndo]) -> None:
    """At teardown: every undo ran; raise the first failure, naming all of them."""
    if failed:
        names = ", ".join(item.change.description for item in failed)
        raise RuntimeError(
            f"{owner}: could not undo the change of {names} at teardown: "
            f"{type(failed[0].error).__name__}: {failed[0].error}"
        ) from failed[0].error


@contextlib.contextmanager
def signals_stop_our_work(trainer: Any, undo: Optional[Undo] = None, raise_at_once: bool = False) -> Iterator[None]:
    """Inside the block a SIGTERM stops our work and ends ``fit`` as Lightning does; a ``KeyboardInterrupt``
    passing through registers the SIGINT handler the process had in ``undo`` (put back last)."""
    previous_term, previous_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # handlers belong to the main thread; one installed from C (``None``) could not be put back
    installed = threading.current_thread() is threading.main_thread() and previous_term is not None
    connector = compat.signal_connector(trainer)
    received_before = connector.received_sigterm
    received: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        first = not received
        received.append(signum)
        if first and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        if callable(previous_term):  # a handler of the user's, chained as Lightning chains it
            previous_term(signum, frame)
        connector.received_sigterm = True  # a trial's loop raises SIGTERMException after its step
        if raise_at_once and first:
            raise compat.of_namespace(trainer, "utilities.exceptions", "SIGTERMException")()

    if installed:
        connector.received_sigterm = False  # a SIGTERM of an earlier fit must not stop this one
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        if undo is not None:
            undo.add("the SIGINT handler", lambda: _set_handler(signal.SIGINT, previous_int), last=True)
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous_term)
            if not received:
                connector.received_sigterm = received_before
    if received:  # our work ended before it saw the flag: stop as a training step would
        raise compat.of_namespace(trainer, "utilities.exceptions", "SIGTERMException")()


def _set_handler(signum: int, handler: Any) -> None:
    if threading.current_thread() is threading.main_thread() and handler is not None:
        signal.signal(signum, handler)
