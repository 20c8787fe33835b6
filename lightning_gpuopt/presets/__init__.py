"""Presets: named sets of :class:`~lightning_gpuopt.GpuOpt` settings, shipped as YAML files.

A preset is a flat YAML mapping of ``GpuOpt`` keyword arguments (:data:`PRESET_KEYS`). The
comment at its top is its description. A user's YAML file may extend a shipped preset (or
another file) with ``preset: NAME_OR_PATH`` and override some of its keys::

    # my-team.yaml
    preset: fill-memory
    max_memory: 0.85
    min_micro_batch_size: 16

Example::

    >>> available_presets()
    ['diagnose', 'fill-memory', 'low-memory', 'max-throughput']
    >>> load_preset("fill-memory")["checkpointing"]
    'auto'
    >>> load_preset("no-such-preset")
    Traceback (most recent call last):
    ...
    ValueError: unknown preset 'no-such-preset': expected one of 'diagnose', 'fill-memory', 'low-memory', 'max-throughput', or the path of a YAML file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

#: where the shipped presets live (package data)
PRESET_DIR = Path(__file__).resolve().parent

#: every key a preset may set, with what it means (the keyword arguments of ``GpuOpt``)
PRESET_KEYS: dict[str, str] = {
    "monitor": "run DataWaitMonitor: data wait vs compute, GPU idle and utilisation, verdict",
    "estimate": "run MemoryEstimator: torchinfo + calibrated peak-memory estimate, checked against a real step",
    "tune_loader": "run DataLoaderTuner: measure and apply num_workers / prefetch_factor / pin_memory",
    "fill_memory": "run MemoryFill: largest micro-batch, AMP, activation checkpointing, gradient accumulation",
    "max_memory": "memory a step may use: bytes, '20GiB', or a fraction of the device (0.9); required on CPU",
    "margin": "headroom kept free: a size fits only if its peak stays within max_memory * (1 - margin)",
    "global_batch_size": "samples per optimizer step over all devices; default: batch size x accumulation x devices",
    "amp": "mixed precision: 'auto' (bf16-mixed / 16-mixed on GPUs, off on CPU), true, or false",
    "checkpointing": "activation checkpointing: 'auto' (when the micro-batch gets too small), true, false, "
    "or a list of module class names",
    "accumulation": "gradient accumulation: 'auto' (as many steps as the global batch needs) or false",
    "objective": "'throughput' (largest micro-batch that fits) or 'memory' (smallest footprint)",
    "min_micro_batch_size": "below this micro-batch size, activation checkpointing is switched on ('auto')",
    "batch_arg_name": "where the batch size lives: attribute of the model, its hparams or the datamodule",
    "loader_max_seconds": "time budget of DataLoaderTuner, in seconds",
    "on_oom": "an out-of-memory error in a training step: 'adapt' (train the batch again in smaller micro-batches, "
    "keep them) or 'raise'",
}

_SUFFIXES = (".yaml", ".yml")


def available_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str | os.PathLike) -> Path:
    """The YAML file of a shipped preset name, or ``name_or_path`` itself when it is a file.

    Raises:
        ValueError: neither a shipped preset nor an existing YAML file (the message lists the presets).
    """
    text = os.fspath(name_or_path)
    if text in available_presets():
        return PRESET_DIR / f"{text}.yaml"
    path = Path(text).expanduser()
    if path.suffix in _SUFFIXES and path.is_file():
        return path
    names = ", ".join(repr(name) for name in available_presets())
    hint = f" (no such file: {path})" if path.suffix in _SUFFIXES else ""
    raise ValueError(f"unknown preset {text!r}{hint}: expected one of {names}, or the path of a YAML file.")


def preset_description(name_or_path: str | os.PathLike) -> str:
    """The comment lines at the top of a preset's file, joined into one paragraph."""
    lines = []
    for line in preset_path(name_or_path).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def load_preset(name_or_path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The settings of a preset name or YAML file, with ``preset:`` extensions resolved.

    Raises:
        ValueError: an unknown preset, a file that is not a mapping, an unknown key (the message
            lists the valid ones), or a cycle of ``preset:`` references.
    """
    path = preset_path(name_or_path)
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ValueError(f"presets extend each other in a cycle: {chain}")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"preset file {path} holds a {type(loaded).__name__}, expected a mapping of settings "
                         "such as `amp: auto`.")  # fmt: skip
    settings = dict(loaded)
    base = settings.pop("preset", None)
    check_keys(settings, source=str(path))
    if base is None:
        return settings
    if not isinstance(base, (str, os.PathLike)):
        raise ValueError(f"`preset: {base!r}` in {path} is not a preset name or path.")
    base_path = Path(base) if Path(base).is_absolute() or base in available_presets() else path.parent / base
    return {**load_preset(base if base in available_presets() else base_path, (*_seen, path)), **settings}


def check_keys(settings: dict[str, Any], source: str) -> None:
    """Raise ``ValueError`` naming the unknown keys of ``settings`` and listing the valid ones."""
    unknown = [key for key in settings if key not in PRESET_KEYS]
    if unknown:
        valid = ", ".join(PRESET_KEYS)
        raise ValueError(f"unknown key(s) {', '.join(repr(k) for k in unknown)} in {source}: valid keys are "
                         f"{valid} (and `preset` to extend a preset).")  # fmt: skip
