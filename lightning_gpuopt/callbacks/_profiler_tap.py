"""A stand-in for ``trainer.profiler`` that times chosen actions and forwards every call.

Lightning profiles the training dataloader's ``next()`` (``"[_TrainingEpochLoop].train_dataloader_next"``),
strategy hooks (``"[Strategy]<Class>.<hook>"``), every hook call (``"[Callback]<state_key>.<hook>"``,
``"[LightningModule]<Class>.<hook>"``, ...) and ``trainer.save_checkpoint`` (``"save_checkpoint"``).
:func:`install`, in a callback's ``setup()``, wraps ``trainer.profiler``: ``listeners[name](wall_s, cpu_s)`` is
called when an action of that name ends (the main thread's CPU seconds for ``start``/``stop`` actions, the loader's
``next()``; else 0), ``on_start[name]()`` when a ``profile`` action begins, ``any_action(name, wall_s)`` after every action not in the
tap's ``quiet`` names (swappable at any time); :func:`bypass` takes it out of the path and back. Every call reaches
the wrapped profiler, so the user's profiler sees what it saw, and stacked taps each see every action."""

from __future__ import annotations

import time
from typing import Any, Callable, Container, Optional

#: called with an action's wall-clock seconds and the main thread's CPU seconds meanwhile
Listener = Callable[[float, float], None]
#: called with every action's name and wall-clock seconds
AnyListener = Callable[[str, float], None]
_UNTIMED, _NOT_STARTED = (None, None), (False, 0.0, 0.0)


class ProfilerTap:
    """Wraps profiler ``inner``; ``timed``: action name -> (its listener, its on_start)."""

    def __init__(self, inner: Any, timed: dict[str, tuple[Any, Any]], any_action: Optional[AnyListener]) -> None:
        self.inner, self._timed, self.any_action = inner, timed, any_action
        self.quiet: Container[str] = ()
        self._started: dict[str, tuple[bool, float, float]] = {}  # start/stop: (reported, wall, CPU)

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        if action_name in self._timed or (self.any_action is not None and action_name not in self.quiet):
            self._started[action_name] = (action_name not in self.quiet, time.perf_counter(), time.thread_time())

    def stop(self, action_name: str) -> None:
        reported, wall, cpu = self._started.pop(action_name, _NOT_STARTED)
        if not wall:
            return self.inner.stop(action_name)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu  # the CPU time, a syscall: the fetch only
        self.inner.stop(action_name)  # before our listeners: their work is outside the wrapped profiler's timing
        self._ended(action_name, reported, wall, cpu)

    def _ended(self, action_name: str, reported: bool, wall: float, cpu: float) -> None:
        listener = self._timed.get(action_name, _UNTIMED)[0]
        if listener is not None:
            listener(wall, cpu)
        if reported and self.any_action is not None:
            self.any_action(action_name, wall)

    def profile(self, action_name: str) -> Any:
        # this runs on every hook call: the common case (nothing to time) returns the inner context as it is
        if action_name in self._timed or (self.any_action is not None and action_name not in self.quiet):
            return _Timed(self, action_name, self.inner.profile(action_name))
        return self.inner.profile(action_name)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "any_action", "quiet", "_timed", "_started"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Timed:
    """A ``profile`` action's timing in the wrapped profiler's context ``inner``; slots: fast."""

    __slots__ = ("inner", "name", "reported", "tap", "wall")

    def __init__(self, tap: ProfilerTap, name: str, inner: Any) -> None:
        self.tap, self.name, self.inner, self.reported = tap, name, inner, name not in tap.quiet

    def __enter__(self) -> None:
        self.inner.__enter__()
        on_start = self.tap._timed.get(self.name, _UNTIMED)[1]
        if on_start is not None:
            on_start()
        self.wall = time.perf_counter()

    def __exit__(self, *exc_info: Any) -> Any:
        wall = time.perf_counter() - self.wall
        try:
            return self.inner.__exit__(*exc_info)  # before our listeners, as in stop()
        finally:
            self.tap._ended(self.name, self.reported, wall, 0.0)


def install(
    trainer: Any,
    listeners: dict[str, Listener],
    any_action: Optional[AnyListener] = None,
    on_start: Optional[dict[str, Callable[[], None]]] = None,
) -> ProfilerTap:
    """Wrap ``trainer.profiler`` in a :class:`ProfilerTap` (the module docstring) and return it."""
    on_start = on_start or {}
    timed = {name: (listeners.get(name), on_start.get(name)) for name in {*listeners, *on_start}}
    trainer.profiler = ProfilerTap(trainer.profiler, timed, any_action)
    return trainer.profiler


def bypass(trainer: Any, tap: Optional[ProfilerTap], out: bool = False) -> bool:
    """Take ``tap`` out of ``trainer.profiler`` (``out``, where on top of the chain: it sees nothing then) or back;
    whether it moved."""
    if tap is None or trainer.profiler is not (tap if out else tap.inner):
        return False
    trainer.profiler = tap.inner if out else tap
    return True


def uninstall(trainer: Any, tap: Optional[ProfilerTap]) -> None:
    """Undo :func:`install`: the tap goes quiet and leaves the chain of profilers, wherever it is in it."""
    if tap is None:
        return
    tap._timed.clear()
    tap.any_action = None
    holder, name = trainer, "profiler"
    while isinstance(getattr(holder, name), ProfilerTap):
        if getattr(holder, name) is tap:
            return setattr(holder, name, tap.inner)
        holder, name = getattr(holder, name), "inner"
