"""The one undo mechanism: every change our callbacks make to the Trainer, the model and the process.

A change is registered with how to undo it when it is made. After a fit that ended well
(:meth:`Undo.after_success`, in ``teardown``) the temporary changes are undone and the *lasting* ones
kept (the batch size a search found); after a failed one (:meth:`Undo.after_failure`, in
``on_exception``) all are. Last change first; an undo that raises skips none of the others.

Lightning handles SIGTERM only after ``on_fit_start`` and ignores SIGINT once it caught a ``KeyboardInterrupt``:
:func:`signals_stop_our_work` handles both around our work as Lightning does in training.

>>> class Settings: precision = "32-true"
>>> settings, undo = Settings(), Undo()
>>> undo.set(settings, "precision", "bf16-mixed")
>>> undo.after_failure("doctest"), settings.precision
(None, '32-true')
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


class Undo:
    """A stack of undoable changes (see the module docstring)."""

    def __init__(self) -> None:
        self._stack: list[Change] = []

    def __len__(self) -> int:
        return len(self._stack)

    def add(self, description: str, undo: Callable[[], Any], lasting: bool = False, last: bool = False) -> None:
        """Register a change with the callable that undoes it; ``last``: undone after every other one."""
        self._stack.insert(0 if last else len(self._stack), Change(description, undo, lasting))

    def set(self, owner: Any, name: str, value: Any, lasting: bool = False) -> None:
        """``owner.name = value`` (``owner[name]`` for a mapping), undone by the value it had (or deleting it)."""
        if isinstance(owner, MutableMapping):
            before = owner.get(name, _ABSENT)
            owner[name] = value
        else:
            before = _current(owner, name)
            setattr(owner, name, value)
        self.add(f"{type(owner).__name__}.{name}", lambda: _put_back(owner, name, before), lasting)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Undo]:
        """A nested log whose changes are undone when the block ends (the first failure raised after all ran)."""
        inner = Undo()
        try:
            yield inner
        finally:
            inner.after_success("Undo.scope", keep_lasting=False)

    def undo(self) -> list[tuple[Change, BaseException]]:
        """Undo every change, last first; returns the undos that raised."""
        return self._unwind(keep_lasting=False)

    def after_failure(self, owner: str) -> None:
        """The fit failed: undo everything, and warn of what could not be undone (raising would hide the error)."""
        for change, error in self._unwind(keep_lasting=False):
            message = f"could not undo the change of {change.description} after the failed fit"
            rank_zero_warn(f"{owner}: {message} ({type(error).__name__}: {error}).")

    def after_success(self, owner: str, keep_lasting: bool = True) -> None:
        """The fit ended well: undo the temporary changes (all undos run), then raise the first that failed."""
        failed = self._unwind(keep_lasting)
        if failed:
            names, (_, error) = ", ".join(change.description for change, _ in failed), failed[0]
            message = f"{owner}: could not undo the change of {names} at teardown: {type(error).__name__}: {error}"
            raise RuntimeError(message) from error

    def _unwind(self, keep_lasting: bool) -> list[tuple[Change, BaseException]]:
        failed: list[tuple[Change, BaseException]] = []
        while self._stack:
            change = self._stack.pop()
            if not (keep_lasting and change.lasting):
                try:
                    change.undo()
                except Exception as error:  # noqa: BLE001 - the other undos must still run
                    failed.append((change, error))
        return failed


def _current(owner: Any, name: str) -> Any:
    """What to put back: a property's value, else the instance attribute, or ``_ABSENT`` (deleted on undo)."""
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
