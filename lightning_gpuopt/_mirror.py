"""The callbacks and the CLI again, built on the ``pytorch_lightning`` package instead of ``lightning.pytorch``.

Lightning ships the same trainer twice: ``lightning.pytorch`` (in the ``lightning`` package) and
``pytorch_lightning`` (its own package, generated from the same source by renaming the imports). The two
have distinct classes: a ``pytorch_lightning.Trainer`` holds ``pytorch_lightning`` loops, plugins and
strategies, which the ``lightning.pytorch`` classes our callbacks check against do not match. Lightning
builds ``pytorch_lightning`` by rewriting ``lightning.pytorch`` → ``pytorch_lightning`` and
``lightning.fabric`` → ``lightning_fabric`` in its source; this module does the same to our callback
modules at import time, under ``lightning_gpuopt.pytorch_lightning``, so that one source serves both
namespaces. ``lightning_gpuopt.core`` has no Lightning import and is shared as it is: results are the
same classes under both.

Example:
    >>> from lightning_gpuopt._mirror import rewritten
    >>> rewritten("from lightning.pytorch.callbacks import Callback")
    'from pytorch_lightning.callbacks import Callback'
    >>> rewritten("from lightning_gpuopt.callbacks.gpuopt import GpuOpt")
    'from lightning_gpuopt.pytorch_lightning.callbacks.gpuopt import GpuOpt'
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
from importlib.machinery import ModuleSpec
from typing import Optional, Sequence

MIRROR_PACKAGE = "lightning_gpuopt.pytorch_lightning"
MIRRORED = ("lightning_gpuopt.callbacks", "lightning_gpuopt.cli")

_RENAMES = [
    (re.compile(r"(?<![\w.])lightning_gpuopt\.(callbacks|cli)\b"), MIRROR_PACKAGE + r".\1"),
    (re.compile(r"(?<![\w.])lightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"(?<![\w.])lightning\.fabric\b"), "lightning_fabric"),
    (re.compile(r"^(\s*)from lightning import\b", re.MULTILINE), r"\1from pytorch_lightning import"),
]


def rewritten(source: str) -> str:
    """``source`` with the imports renamed the way Lightning renames them for ``pytorch_lightning``."""
    for pattern, replacement in _RENAMES:
        source = pattern.sub(replacement, source)
    return source


def original_name(mirror_name: str) -> Optional[str]:
    """The module a mirrored one is built from, or None when ``mirror_name`` is not mirrored.

    >>> original_name("lightning_gpuopt.pytorch_lightning.callbacks.gpuopt")
    'lightning_gpuopt.callbacks.gpuopt'
    >>> original_name("lightning_gpuopt.pytorch_lightning.cli.lightning_cli")
    'lightning_gpuopt.cli.lightning_cli'
    >>> original_name("lightning_gpuopt.pytorch_lightning") is None
    True
    """
    if not mirror_name.startswith(MIRROR_PACKAGE + "."):
        return None
    name = "lightning_gpuopt" + mirror_name[len(MIRROR_PACKAGE) :]
    return name if any(name == root or name.startswith(root + ".") for root in MIRRORED) else None


class _RewritingLoader(importlib.abc.SourceLoader):
    """Loads a module from the original's file with the imports rewritten (no bytecode cache: the
    cached file of the original would be overwritten)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        with open(path, encoding="utf-8") as file:
            return rewritten(file.read()).encode("utf-8")


class _MirrorFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: object = None) -> Optional[ModuleSpec]:
        original = original_name(fullname)
        if original is None:
            return None
        spec = importlib.util.find_spec(original)
        if spec is None or spec.origin is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname,
            spec.origin,
            loader=_RewritingLoader(spec.origin),
            submodule_search_locations=spec.submodule_search_locations,
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), ahead of the file finder that would load the
    original files unchanged under the mirrored names."""
    if not any(isinstance(finder, _MirrorFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MirrorFinder())
