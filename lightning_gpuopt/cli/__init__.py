"""Command lines: the ``gpuopt`` console command and :class:`GpuOptCLI` (``--gpuopt`` on LightningCLI).

Two programs, one module each:

- :mod:`lightning_gpuopt.cli.command`: ``gpuopt doctor | presets | estimate | plot`` (``main`` is the
  ``[project.scripts]`` entry point; also ``python -m lightning_gpuopt.cli``). Standard library only at
  import, so ``gpuopt --help`` and ``gpuopt presets`` answer without loading torch or Lightning.
- :mod:`lightning_gpuopt.cli.lightning_cli`: :class:`GpuOptCLI` and its helpers
  (``preset_flag_as_key``, ``resolved_gpuopt_settings``, ...). It imports Lightning, so it is
  imported here only when one of its names is first asked for (PEP 562 ``__getattr__``).

Every name of both modules is importable from ``lightning_gpuopt.cli``, as it was when they were one file.

Example:
    >>> from lightning_gpuopt.cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    gpuopt ...
    0
    >>> from lightning_gpuopt.cli import GpuOptCLI, preset_flag_as_key
    >>> GpuOptCLI.__module__
    'lightning_gpuopt.cli.lightning_cli'
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_gpuopt.cli import command
from lightning_gpuopt.cli.command import (
    DEFAULT_BATCH_SIZE,
    ESTIMATE_OPTIMIZERS,
    ESTIMATE_PRECISIONS,
    ESTIMATE_TRAINER_STEPS,
    EstimateSetup,
    UsageError,
    build_parser,
    estimate_table,
    import_class,
    main,
    memory_argument,
    run_doctor,
    run_estimate,
    run_plot,
    run_presets,
)

#: names served by :mod:`lightning_gpuopt.cli.lightning_cli`, imported (with Lightning) on first use
_LIGHTNING_CLI_NAMES = frozenset(
    {
        "GPUOPT_KEY",
        "GpuOptCLI",
        "add_gpuopt_arguments",
        "gpuopt_help",
        "preset_flag_as_key",
        "resolved_gpuopt_settings",
        # what the single-file module imported at its top, importable from it then
        "GpuOpt",
        "LightningArgumentParser",
        "LightningCLI",
        "Optional",
        "load_preset",
    }
)


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_CLI_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.lightning_cli"), name)
    elif not name.startswith("__") and hasattr(command, name):  # the command's helpers, private ones included
        value = getattr(command, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LIGHTNING_CLI_NAMES | {name for name in vars(command) if not name.startswith("__")})
