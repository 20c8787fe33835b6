"""The one engine our callbacks share: decide before training from real measurements, then leave no trace.

* :mod:`.undo` -- :class:`Undo`, the one way every change is registered and undone (teardown keeps
  the lasting ones; an exception, Ctrl+C or SIGTERM undoes all), and :func:`signals_stop_our_work`;
* :mod:`.state` -- :class:`TrainingState`, everything a trial or measurement may change, put back;
* :mod:`.session` -- :class:`FitSession`, one per fit: the user's loader built once, our changes
  applied once, ``configure_optimizers()`` replayed from its own RNG states when the batch changed;
* :mod:`.trials` -- :class:`Trials`, real training steps through the Trainer's loop, measured,
  agreed across ranks;
* :mod:`.steps` and :mod:`.predict` -- the training step as the estimate traces it, and the
  estimate that starts a search;
* :mod:`.oom_recovery` -- out-of-memory errors in training absorbed by smaller micro-batches.
"""

from lightning_gpuopt.callbacks._engine.session import FitSession, rebuild_loader
from lightning_gpuopt.callbacks._engine.state import TrainingState, rng_kept
from lightning_gpuopt.callbacks._engine.trials import Trials
from lightning_gpuopt.callbacks._engine.undo import Undo, signals_stop_our_work

__all__ = ["FitSession", "TrainingState", "Trials", "Undo", "rebuild_loader", "rng_kept", "signals_stop_our_work"]
