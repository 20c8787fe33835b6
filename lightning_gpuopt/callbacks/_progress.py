"""Progress of long work before training, on rank 0: a line a unit, or a rich bar when the Trainer shows one."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info


class WorkProgress:
    """Reports units of work as they end: ``title`` labels them, ``total`` is the most (``None``: unknown); a bar
    where the Trainer shows an enabled progress bar (TQDM or rich) when it is made."""

    def __init__(self, trainer: Trainer, title: str, total: Optional[int], enabled: bool) -> None:
        self.title, self.total, self.count = title, total, 0
        self.enabled = enabled and trainer.is_global_zero
        self._bar: Any = None
        self._task: Any = None
        self._use_bar = self.enabled and bool(getattr(trainer.progress_bar_callback, "is_enabled", False))

    def __enter__(self) -> WorkProgress:
        if self._use_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.table import Column

            last = Column(no_wrap=True, overflow="ellipsis", ratio=1)  # the last unit's line takes what is left
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[last]}", table_column=last),
                expand=True,
            )
            self._task = self._bar.add_task(self.title, total=self.total, last="")
            self._bar.start()
        return self

    def done(self, line: str) -> None:
        """One unit ended; ``line`` says what it measured."""
        if not self.enabled:
            return
        self.count += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, last=line)
        else:
            of = f"/{self.total}" if self.total else ""
            rank_zero_info(f"{self.title} {self.count}{of}: {line}")

    def __exit__(self, *exc_info: Any) -> None:
        if self._bar is not None:
            if self.total is not None:  # the search stopped early: the bar shows how many ran
                self._bar.update(self._task, total=self.count)
            self._bar.stop()
            self._bar = None
