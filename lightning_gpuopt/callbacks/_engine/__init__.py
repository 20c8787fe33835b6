"""The one engine our callbacks share: decide before training from real measurements, then leave no trace.
``docs/architecture.md`` maps its modules; each module's docstring says what it does."""

from lightning_gpuopt.callbacks._engine.session import FitSession, rebuild_loader
from lightning_gpuopt.callbacks._engine.state import TrainingState, rng_kept
from lightning_gpuopt.callbacks._engine.trials import Trials
from lightning_gpuopt.callbacks._engine.undo import Undo, signals_stop_our_work

__all__ = ["FitSession", "TrainingState", "Trials", "Undo", "rebuild_loader", "rng_kept", "signals_stop_our_work"]
