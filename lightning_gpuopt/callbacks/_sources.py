"""A stand-in for Lightning's train-loader source that rebuilds the loader it returns.

Lightning asks the fit loop's source (:func:`~lightning_gpuopt.callbacks._lightning_compat.train_source`) for the train loader whenever it (re)builds it
(``_request_dataloader`` records the loader's arguments meanwhile, so Lightning can still inject
its distributed sampler). :class:`RebuiltSource` asks the source it wraps -- the user's
datamodule, model hook or loader, or another ``RebuiltSource`` -- and passes the loader through
``rebuild``. ``DataLoaderTuner`` uses it to apply worker settings, ``BatchSizeSearch`` to run
its trials on the largest samples first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader

from lightning_gpuopt.callbacks._lightning_compat import DataLoaderSource


@dataclass
class RebuiltSource(DataLoaderSource):
    """``inner``'s loader, passed through ``rebuild`` when it is a single ``DataLoader``."""

    inner: Optional[DataLoaderSource] = None
    rebuild: Optional[Callable[[DataLoader], Any]] = None

    @classmethod
    def around(cls, source: DataLoaderSource, rebuild: Callable[[DataLoader], Any]) -> RebuiltSource:
        return cls(source.instance, source.name, inner=source, rebuild=rebuild)

    def dataloader(self) -> Any:
        loader = self.inner.dataloader() if self.inner is not None else super().dataloader()
        if self.rebuild is not None and isinstance(loader, DataLoader):
            return self.rebuild(loader)
        return loader
