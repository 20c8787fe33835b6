"""A stand-in for ``trainer.profiler`` that times chosen actions and delegates everything.

Lightning wraps the training dataloader ``next()`` in ``profiler.start/stop(
"[_TrainingEpochLoop].train_dataloader_next")``, strategy hooks such as ``batch_to_device``
and ``training_step`` in ``profiler.profile("[Strategy]<Strategy>.<hook>")``, and
``trainer.save_checkpoint`` in ``profiler.profile("save_checkpoint")``. Installing a
:class:`ProfilerTap` in a callback's ``setup()`` (after Lightning set its profiler up) gives
the exact duration of each of those calls; actions nobody listens to go straight to the
wrapped profiler, so the user's profiler (``SimpleProfiler``, ...) sees exactly what it saw.

Lightning also profiles every hook call, as ``[Callback]<state_key>.<hook>``,
``[LightningModule]<Class>.<hook>``, ``[LightningDataModule]<Class>.<hook>`` and
``[Strategy]<Class>.<hook>``. An optional catch-all listener (``any_action``) is called with
the name and wall-clock seconds of every action (``perf_counter`` only: it runs on every hook
call, dozens per step), the listened-to ones included.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

Listener = Callable[[float, float], None]
"""Called with an action's wall-clock seconds and the CPU seconds of the calling (main) thread meanwhile."""

AnyListener = Callable[[str, float], None]
"""Called with every action's name and wall-clock seconds."""


class ProfilerTap:
    """Times the listened-to actions and forwards every call to the wrapped profiler.

    Args:
        inner: the profiler being wrapped (``trainer.profiler``).
        listeners: action name -> function called with the action's wall-clock and CPU seconds.
        any_action: called with the name and wall-clock seconds of every action (optional).
    """

    def __init__(
        self,
        inner: Any,
        listeners: dict[str, Listener],
        any_action: Optional[AnyListener] = None,
        starts: Optional[dict[str, Callable[[], None]]] = None,
    ) -> None:
        self.inner = inner
        self.listeners = dict(listeners)
        self.any_action = any_action
        #: action name -> called when the action starts
        self.starts = dict(starts or {})
        self._started: dict[str, tuple[float, float]] = {}
        self._any_started: dict[str, float] = {}

    def start(self, action_name: str) -> None:
        if action_name in self.starts:
            self.starts[action_name]()
        self.inner.start(action_name)
        if action_name in self.listeners:
            self._started[action_name] = (time.perf_counter(), time.thread_time())
        if self.any_action is not None:
            self._any_started[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        now = time.perf_counter()
        started = self._started.pop(action_name, None)
        if started is not None and action_name in self.listeners:
            self.listeners[action_name](now - started[0], time.thread_time() - started[1])
        any_started = self._any_started.pop(action_name, None)
        if any_started is not None and self.any_action is not None:
            self.any_action(action_name, now - any_started)
        self.inner.stop(action_name)

    def profile(self, action_name: str) -> Any:
        if action_name in self.starts:
            self.starts[action_name]()
        listener = self.listeners.get(action_name)
        if listener is not None:
            return _Timed(self.inner.profile(action_name), listener, action_name, self.any_action)
        if self.any_action is not None:
            return _TimedName(self.inner.profile(action_name), action_name, self.any_action)
        return self.inner.profile(action_name)

    def __getattr__(self, name: str) -> Any:
        if name in (
            "inner",
            "listeners",
            "any_action",
            "starts",
            "_started",
            "_any_started",
        ):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Timed:
    """Context manager timing the body inside the wrapped profiler's own context (a class, not a
    generator: it runs on every step, so it is kept cheap)."""

    __slots__ = ("any_action", "cpu", "inner", "listener", "name", "wall")

    def __init__(
        self, inner: Any, listener: Listener, name: str = "", any_action: Optional[AnyListener] = None
    ) -> None:
        self.inner = inner
        self.listener = listener
        self.name = name
        self.any_action = any_action

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc_info: Any) -> Any:
        wall = time.perf_counter() - self.wall
        self.listener(wall, time.thread_time() - self.cpu)
        if self.any_action is not None:
            self.any_action(self.name, wall)
        return self.inner.__exit__(*exc_info)


class _TimedName:
    """The catch-all's context manager: wall-clock time only, inside the wrapped profiler's context."""

    __slots__ = ("any_action", "inner", "name", "wall")

    def __init__(self, inner: Any, name: str, any_action: AnyListener) -> None:
        self.inner = inner
        self.name = name
        self.any_action = any_action

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.wall = time.perf_counter()

    def __exit__(self, *exc_info: Any) -> Any:
        self.any_action(self.name, time.perf_counter() - self.wall)
        return self.inner.__exit__(*exc_info)


def install(
    trainer: Any,
    listeners: dict[str, Listener],
    any_action: Optional[AnyListener] = None,
    starts: Optional[dict[str, Callable[[], None]]] = None,
) -> ProfilerTap:
    """Wrap ``trainer.profiler`` in a :class:`ProfilerTap` listening to ``listeners`` (and to every
    action through ``any_action``; ``starts``: called when their action starts)."""
    tap = ProfilerTap(trainer.profiler, listeners, any_action, starts)
    trainer.profiler = tap
    return tap


def uninstall(trainer: Any, tap: Optional[ProfilerTap]) -> None:
    """Undo :func:`install`. When another tap was installed on top, this one only goes quiet."""
    if tap is None:
        return
    tap.listeners.clear()
    tap.starts.clear()
    tap.any_action = None
    if trainer.profiler is tap:
        trainer.profiler = tap.inner
        return
    outer = trainer.profiler
    while isinstance(outer, ProfilerTap):
        if outer.inner is tap:
            outer.inner = tap.inner
            return
        outer = outer.inner
