"""Presets: named sets of :class:`~lightning_gpuopt.GpuOpt` settings (:data:`PRESET_KEYS`) in YAML files, the top
comment the description; a file may extend a preset or another file with ``preset: NAME_OR_PATH``."""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

import yaml

_DIR = Path(__file__).resolve().parent
_SUFFIXES = (".yaml", ".yml")

#: every key a preset may set (the keyword arguments of ``GpuOpt``), with what it means
PRESET_KEYS: dict[str, str] = {
    "monitor": "run DataWaitMonitor: data wait vs compute, GPU idle and utilisation, verdict",
    "estimate": "run MemoryEstimator: torchinfo + calibrated peak-memory estimate, checked against a real step",
    "tune_loader": "run DataLoaderTuner: measure and apply num_workers / prefetch_factor / pin_memory",
    "fill_memory": "run MemoryFill: largest micro-batch, AMP, activation checkpointing, gradient accumulation",
    "max_memory": "memory a step may use: bytes, '20GiB', or a fraction of the device (0.9); required on CPU",
    "margin": "headroom: 'auto' (a size fits only if 1/32 more samples would, at the measured bytes per sample) or a number: its peak within max_memory * (1 - margin)",
    "global_batch_size": "samples per optimizer step over all devices; default: batch size x accumulation x devices",
    "precision": "what a 32-true run switches to: 'auto' (bf16-mixed / 16-mixed on GPUs, none on CPU), '16-mixed', 'bf16-mixed', or null / '32-true' (none); a precision set on the Trainer is kept",
    "activation_checkpointing": "activation checkpointing: 'auto' (when the micro-batch gets too small), true, false, or a list of module class names",
    "accumulation": "gradient accumulation: 'auto' (as many steps as the global batch needs) or false",
    "objective": "'throughput' (largest micro-batch that fits) or 'memory' (smallest footprint)",
    "min_micro_batch_size": "below this micro-batch size, activation checkpointing is switched on ('auto')",
    "batch_arg_name": "where the batch size lives: attribute of the model, its hparams or the datamodule",
    "loader_max_seconds": "time budget of DataLoaderTuner, in seconds",
    "scale_lr": "'linear' or 'sqrt': the learning rates follow the global batch's growth over yours; null: kept (the report says what each would set)",
    "on_oom": "an out-of-memory error in a training step: 'adapt' (train the batch again in smaller micro-batches, keep them) or 'raise'",
}


def _expected() -> str:
    return f"expected one of {', '.join(map(repr, available_presets()))}, or the path of a YAML file."


def available_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(path.stem for path in _DIR.glob("*.yaml"))


def preset_path(name_or_path: str | os.PathLike) -> Path:
    """The YAML file of a shipped preset's name, or ``name_or_path`` itself when it is a YAML file."""
    text = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        raise ValueError(f"`preset`={name_or_path!r} is not a preset name or path: {_expected()}")
    if text in available_presets():
        return _DIR / f"{text}.yaml"
    path = Path(text).expanduser()
    if path.suffix in _SUFFIXES and path.is_file():
        return path
    hint = f" (no YAML file at {path})" if path.suffix in _SUFFIXES or path.exists() else ""
    raise ValueError(f"unknown preset {text!r}{hint}: {_expected()}")


def preset_description(name_or_path: str | os.PathLike) -> str:
    """The comment lines at the top of a preset's file, as one paragraph."""
    lines = preset_path(name_or_path).read_text().splitlines()
    return " ".join(line.lstrip("#").strip() for line in itertools.takewhile(lambda line: line.startswith("#"), lines))


def load_preset(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a preset's name or YAML file, ``preset:`` extensions resolved (else a clear ``ValueError``)."""
    return load_preset_with_sources(name_or_path)[0]


def load_preset_with_sources(name_or_path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Path]]:
    """:func:`load_preset`'s settings, and for each key the file that set it."""
    return _load_chain(preset_path(name_or_path), ())


def _load_chain(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, Path]]:
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ValueError(f"presets extend each other in a cycle: {chain}; remove one `preset:` line of the chain.")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"preset file {path} is not valid YAML: {problem}{where}.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"preset file {path} cannot be read: {error}.") from None
    if loaded is not None and not isinstance(loaded, dict):
        why = f"holds a {type(loaded).__name__}, expected a mapping of settings such as `precision: auto`."
        raise ValueError(f"preset file {path} {why}")
    settings = dict(loaded or {})
    if not settings:
        why = "is empty (or only comments): it sets nothing, so GpuOpt runs no part"
        warnings.warn(f"preset file {path} {why}; start it with `preset: diagnose` (or another preset).", stacklevel=4)
    base = settings.pop("preset", None)
    check_keys(settings, source=str(path))
    sources = {key: path for key in settings}
    if base is None:
        return settings, sources
    if not isinstance(base, str) or not base:
        raise ValueError(f"`preset: {base!r}` in {path} is not a preset name or path: {_expected()}")
    relative = not Path(base).expanduser().is_absolute() and base not in available_presets()
    base_settings, base_sources = _load_chain(preset_path(path.parent / base if relative else base), (*seen, resolved))
    return {**base_settings, **settings}, {**base_sources, **sources}


def check_keys(settings: dict[str, Any], source: str) -> None:
    """Raise ``ValueError`` naming the unknown keys of ``settings`` (from ``source``) and the valid ones."""
    unknown = [key for key in settings if key not in PRESET_KEYS]
    if unknown:
        why = f"valid keys are {', '.join(PRESET_KEYS)} (and `preset` to extend a preset)."
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in {source}: {why}")
