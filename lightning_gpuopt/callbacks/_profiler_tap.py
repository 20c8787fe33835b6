"""A stand-in for ``trainer.profiler`` that times chosen actions and forwards every call.

Lightning profiles the training dataloader's ``next()`` (``start``/``stop`` of
``"[_TrainingEpochLoop].train_dataloader_next"``), strategy hooks (``"[Strategy]<Class>.<hook>"``:
``batch_to_device``, ``training_step``), every hook call (``"[Callback]<state_key>.<hook>"``,
``"[LightningModule]<Class>.<hook>"``, ``"[LightningDataModule]<Class>.<hook>"``) and
``trainer.save_checkpoint`` (``"save_checkpoint"``). :func:`install`, in a callback's ``setup()``
(after Lightning set its profiler up), wraps ``trainer.profiler``: ``listeners[name](wall_s, cpu_s)``
is called when an action of that name ends (its wall-clock seconds and the main thread's CPU seconds
meanwhile), ``on_start[name]()`` when one begins, ``any_action(name, wall_s)`` after every action.
Every call still reaches the wrapped profiler, so the user's profiler sees exactly what it saw, and
taps installed one over another each see every action.

    tap = install(trainer, {"save_checkpoint": saved}, on_start={"save_checkpoint": saving})
    ...
    uninstall(trainer, tap)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

#: called with an action's wall-clock seconds and the main thread's CPU seconds meanwhile
Listener = Callable[[float, float], None]
#: called with every action's name and wall-clock seconds
AnyListener = Callable[[str, float], None]


class ProfilerTap:
    """Wraps profiler ``inner``: see the module docstring for ``listeners``, ``any_action`` and ``on_start``."""

    def __init__(
        self,
        inner: Any,
        listeners: dict[str, Listener],
        any_action: Optional[AnyListener] = None,
        on_start: Optional[dict[str, Callable[[], None]]] = None,
    ) -> None:
        self.inner = inner
        self.listeners = dict(listeners)
        self.on_start = dict(on_start or {})
        self.any_action = any_action
        self._started: dict[str, tuple[float, float]] = {}

    def _begin(self, name: str) -> tuple[float, float]:
        started = self.on_start.get(name)
        if started is not None:
            started()
        return time.perf_counter(), time.thread_time() if name in self.listeners else 0.0

    def _end(self, name: str, started: tuple[float, float]) -> None:
        wall = time.perf_counter() - started[0]
        listener = self.listeners.get(name)
        if listener is not None:
            listener(wall, time.thread_time() - started[1])
        if self.any_action is not None:
            self.any_action(name, wall)

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        if self.any_action is not None or action_name in self.listeners or action_name in self.on_start:
            self._started[action_name] = self._begin(action_name)

    def stop(self, action_name: str) -> None:
        started = self._started.pop(action_name, None)
        if started is not None:
            self._end(action_name, started)
        self.inner.stop(action_name)

    def profile(self, action_name: str) -> Any:
        # the fast paths first: it runs on every hook call
        if action_name in self.listeners or action_name in self.on_start:
            return _Timed(self, action_name, self.inner.profile(action_name))
        if self.any_action is not None:
            return _Walled(self.inner.profile(action_name), action_name, self.any_action)
        return self.inner.profile(action_name)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "listeners", "on_start", "any_action", "_started"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Timed:
    """:meth:`ProfilerTap.profile`'s context manager: the action timed inside the wrapped profiler's own
    context (a class, not a generator: it runs on every hook call)."""

    __slots__ = ("inner", "name", "started", "tap")

    def __init__(self, tap: ProfilerTap, name: str, inner: Any) -> None:
        self.tap, self.name, self.inner = tap, name, inner

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.started = self.tap._begin(self.name)

    def __exit__(self, *exc_info: Any) -> Any:
        self.tap._end(self.name, self.started)
        return self.inner.__exit__(*exc_info)


class _Walled:
    """:meth:`ProfilerTap.profile`'s context manager for the catch-all alone: wall-clock time only."""

    __slots__ = ("any_action", "inner", "name", "started")

    def __init__(self, inner: Any, name: str, any_action: AnyListener) -> None:
        self.inner, self.name, self.any_action = inner, name, any_action

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.started = time.perf_counter()

    def __exit__(self, *exc_info: Any) -> Any:
        self.any_action(self.name, time.perf_counter() - self.started)
        return self.inner.__exit__(*exc_info)


def install(
    trainer: Any,
    listeners: dict[str, Listener],
    any_action: Optional[AnyListener] = None,
    on_start: Optional[dict[str, Callable[[], None]]] = None,
) -> ProfilerTap:
    """Wrap ``trainer.profiler`` in a :class:`ProfilerTap` and return it."""
    tap = ProfilerTap(trainer.profiler, listeners, any_action, on_start)
    trainer.profiler = tap
    return tap


def uninstall(trainer: Any, tap: Optional[ProfilerTap]) -> None:
    """Undo :func:`install`: the tap goes quiet and leaves the chain of profilers, wherever it is in it."""
    if tap is None:
        return
    tap.listeners.clear()
    tap.on_start.clear()
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
