"""A stand-in for ``trainer.profiler`` that times chosen actions and delegates everything.

Lightning wraps the training dataloader ``next()`` in ``profiler.start/stop(
"[_TrainingEpochLoop].train_dataloader_next")``, strategy hooks such as ``batch_to_device``
and ``training_step`` in ``profiler.profile("[Strategy]<Strategy>.<hook>")``, and
``trainer.save_checkpoint`` in ``profiler.profile("save_checkpoint")``. Installing a
:class:`ProfilerTap` in a callback's ``setup()`` (after Lightning set its profiler up) gives
the exact duration of each of those calls; actions nobody listens to go straight to the
wrapped profiler, so the user's profiler (``SimpleProfiler``, ...) sees exactly what it saw.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

Listener = Callable[[float, float], None]
"""Called with an action's wall-clock seconds and the CPU seconds of the calling (main) thread meanwhile."""


class ProfilerTap:
    """Times the listened-to actions and forwards every call to the wrapped profiler.

    Args:
        inner: the profiler being wrapped (``trainer.profiler``).
        listeners: action name -> function called with the action's wall-clock and CPU seconds.
    """

    def __init__(self, inner: Any, listeners: dict[str, Listener]) -> None:
        self.inner = inner
        self.listeners = dict(listeners)
        self._started: dict[str, tuple[float, float]] = {}

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        if action_name in self.listeners:
            self._started[action_name] = (time.perf_counter(), time.thread_time())

    def stop(self, action_name: str) -> None:
        started = self._started.pop(action_name, None)
        if started is not None and action_name in self.listeners:
            self.listeners[action_name](time.perf_counter() - started[0], time.thread_time() - started[1])
        self.inner.stop(action_name)

    def profile(self, action_name: str) -> Any:
        listener = self.listeners.get(action_name)
        if listener is None:
            return self.inner.profile(action_name)
        return _Timed(self.inner.profile(action_name), listener)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "listeners", "_started"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Timed:
    """Context manager timing the body inside the wrapped profiler's own context (a class, not a
    generator: it runs on every step, so it is kept cheap)."""

    __slots__ = ("inner", "listener", "wall", "cpu")

    def __init__(self, inner: Any, listener: Listener) -> None:
        self.inner = inner
        self.listener = listener

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc_info: Any) -> Any:
        self.listener(time.perf_counter() - self.wall, time.thread_time() - self.cpu)
        return self.inner.__exit__(*exc_info)


def install(trainer: Any, listeners: dict[str, Listener]) -> ProfilerTap:
    """Wrap ``trainer.profiler`` in a :class:`ProfilerTap` listening to ``listeners``."""
    tap = ProfilerTap(trainer.profiler, listeners)
    trainer.profiler = tap
    return tap


def uninstall(trainer: Any, tap: Optional[ProfilerTap]) -> None:
    """Undo :func:`install`. When another tap was installed on top, this one only goes quiet."""
    if tap is None:
        return
    tap.listeners.clear()
    if trainer.profiler is tap:
        trainer.profiler = tap.inner
        return
    outer = trainer.profiler
    while isinstance(outer, ProfilerTap):
        if outer.inner is tap:
            outer.inner = tap.inner
            return
        outer = outer.inner
