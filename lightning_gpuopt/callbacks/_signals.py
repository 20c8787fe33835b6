"""SIGTERM and Ctrl+C while our callbacks work before training (loader timing, trial steps).

Lightning installs its SIGTERM handler only after ``on_fit_start``, so during ``setup`` and
``on_fit_start`` a SIGTERM would kill the process with no cleanup. :func:`sigterm_stops_our_work`
installs, around that work, a handler that does what Lightning's does during training: it logs
the signal, stops the launcher's other processes, calls a handler the user installed before, and
sets ``trainer.received_sigterm``, so a trial stops at the end of its step (with
``raise_at_once``, as in loader timing, a ``SIGTERMException`` is raised right away). Our work
then stops, everything is restored on the way out (the ``with`` blocks, then ``on_exception``),
and :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` leaves ``fit`` as it does
for a SIGTERM in a training step. The handler the process had is back once the block ends.

Ctrl+C: Lightning ignores SIGINT from the moment it catches the ``KeyboardInterrupt`` (so its own
shutdown is not interrupted) and never puts the handler back. When the interrupt came during our
work, the handler the process had is registered in ``changes`` and put back by ``on_exception``,
after every other undo.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_gpuopt.callbacks import _lightning_compat as compat
from lightning_gpuopt.callbacks._changes import Changes

log = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_stops_our_work(
    trainer: pl.Trainer, changes: Optional[Changes] = None, raise_at_once: bool = False
) -> Iterator[None]:
    """Inside the block a SIGTERM stops our work and ends ``fit`` as Lightning does (see the module
    docstring); a ``KeyboardInterrupt`` passing through registers the SIGINT handler in ``changes``.

    Example::

        with sigterm_stops_our_work(trainer, self._changes):
            run_trials()          # a SIGTERM: the trial stops after its step, SIGTERMException leaves fit
    """
    previous_term, previous_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # handlers belong to the main thread; one installed from C (``None``) could not be put back
    installed = threading.current_thread() is threading.main_thread() and previous_term is not None
    connector = compat.signal_connector(trainer)
    received_before = connector.received_sigterm
    received: list[int] = []

    def on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        first = not received
        received.append(signum)
        if first and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        if callable(previous_term):  # a handler of the user's, chained as Lightning chains it
            previous_term(signum, frame)
        connector.received_sigterm = True  # a trial's fit loop raises SIGTERMException after its step
        if raise_at_once and first:
            raise SIGTERMException()

    if installed:
        connector.received_sigterm = False  # a SIGTERM of an earlier fit must not stop this one's trials
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        if changes is not None:
            changes.add("the SIGINT handler", _handler_restored(signal.SIGINT, previous_int), undo_last=True)
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous_term)
            if not received:
                connector.received_sigterm = received_before
    if received:  # our work ended before it saw the flag: stop as a training step would
        raise SIGTERMException()


def _handler_restored(signum: int, handler: Any) -> Any:
    """An undo that puts ``handler`` back for ``signum`` (a no-op outside the main thread)."""

    def undo() -> None:
        if threading.current_thread() is threading.main_thread() and handler is not None:
            signal.signal(signum, handler)

    return undo
