"""The ``gpuopt`` console command: ``doctor``, ``presets``, ``estimate``, ``plot``.

::

    gpuopt doctor [--quick | --matmul-seconds S] [--json]
    gpuopt presets [NAME_OR_YAML] [--json]
    gpuopt estimate MODULE:CLASS [--init-args ARGS] [--datamodule MODULE:CLASS [--datamodule-init-args ARGS]]
                    [--input-size 3,224,224] [--batch-size N]
                    [--optimizer adam|adamw|sgd|none] [--precision 32-true|bf16-mixed|16-mixed|bf16-true]
                    [--max-memory 20GiB] [--device cpu|cuda] [--json]
    gpuopt plot REPORT.json [--out DIR] [--json]

``--init-args`` (and ``--datamodule-init-args``) take the class's keyword arguments as JSON or YAML text or a
.yaml/.json file, type-checked against its ``__init__`` by jsonargparse; an argument typed as a class takes
``{"class_path": ..., "init_args": {...}}``, which is built.

Human output is a rich table on stdout; ``--json`` prints one JSON document instead. Exit status:
0 on success, 2 on bad usage (the message names the argument, the value and what would work),
1 when ``doctor`` finds a "fail". Also runs as ``python -m lightning_gpuopt.cli ...``.

This module imports only the standard library at the top: torch, Lightning, rich, YAML and jsonargparse are
imported inside the subcommand that needs them, so ``gpuopt --help`` and ``gpuopt presets``
answer without loading torch or Lightning (``tests/test_cli_command.py`` checks that they do not).
Keep it that way: a top-level ``import torch`` here costs every ``gpuopt`` call seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, cast

if TYPE_CHECKING:
    import torch

#: precisions ``gpuopt estimate`` accepts, as Lightning's Trainer names them
ESTIMATE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
#: optimizers ``gpuopt estimate --optimizer`` builds (``auto``: a LightningModule's ``configure_optimizers()`` with a
#: Trainer attached, else Adam)
ESTIMATE_OPTIMIZERS = ("auto", "adam", "adamw", "sgd", "none")
#: the batch size of ``--input-size`` and ``example_input_array`` batches without ``--batch-size``
DEFAULT_BATCH_SIZE = 8
#: ``max_steps`` of the Trainer ``gpuopt estimate`` attaches to a LightningModule (``configure_optimizers``
#: may read ``self.trainer.estimated_stepping_batches``; nothing is trained)
ESTIMATE_TRAINER_STEPS = 1000

_STATUS_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


class UsageError(Exception):
    """Bad command-line input: exit status 2; the message names the argument, the value and what works."""


def main(argv: list[str] | None = None) -> int:
    """Run ``gpuopt`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: 2 on bad usage, 0 for --help
        return int(exit_.code or 0)
    try:
        return int(args.handler(args))
    except UsageError as error:
        _print_error(f"gpuopt {args.command}: error: {error}")
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``gpuopt`` argument parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog="gpuopt", description="Check a machine for GPU training, show presets, estimate a model's memory."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{doctor,presets,estimate,plot}")
    _add_doctor_parser(commands, common)
    _add_presets_parser(commands, common)
    _add_estimate_parser(commands, common)
    _add_plot_parser(commands, common)
    return parser


def _version() -> str:
    from lightning_gpuopt import __version__

    return __version__


def _console() -> Any:
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 120))
    return Console(width=width, highlight=False)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _print_error(message: str) -> None:
    """The command's error line on stderr (the console command's output, not library logging)."""
    sys.stderr.write(message + "\n")


def _table(title: str, columns: Sequence[str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


# ----------------------------------------------------------------------------- gpuopt doctor


def _add_doctor_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    doctor = commands.add_parser(
        "doctor",
        parents=[common],
        help="environment checks, each with a status and a fix",
        description="Check torch/CUDA vs the driver and GPU, the GPUs and who else uses them, matmul speed, "
        "CPU cores and threads, BLAS, pinned memory and /dev/shm. Exit status 1 on a 'fail'.",
    )
    timing = doctor.add_mutually_exclusive_group()
    timing.add_argument("--quick", action="store_true", help="a 0.3 s matmul benchmark instead of 2 s")
    timing.add_argument(
        "--matmul-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds of matmul benchmark over all dtypes (default 2; 0 skips it)",
    )
    doctor.set_defaults(handler=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    """``gpuopt doctor``: run :func:`lightning_gpuopt.core.doctor.run_checks`; 1 if one "fail"s."""
    from lightning_gpuopt.core.doctor import run_checks, worst_status

    if args.matmul_seconds < 0:
        raise UsageError(f"`--matmul-seconds`={args.matmul_seconds} is negative; use e.g. 2 (or 0 to skip).")
    checks = run_checks(matmul_seconds=0.3 if args.quick else args.matmul_seconds)
    status = worst_status(checks)
    if args.json:
        _print_json({"status": status, "checks": [dataclasses.asdict(check) for check in checks]})
    else:
        _print_doctor(checks, status)
    return 1 if status == "fail" else 0


def _print_doctor(checks: list[Any], status: str) -> None:
    from rich.text import Text

    table = _table("gpuopt doctor", ["status", "check", "finding  (→ fix)"])
    for check in checks:
        finding = Text(check.value)
        if check.fix:
            finding.append(f"\n→ {check.fix}", style="italic")
        table.add_row(Text(check.status.upper(), style=_STATUS_STYLE.get(check.status, "")), Text(check.name), finding)
    console = _console()
    console.print(table)
    counts = ", ".join(f"{sum(c.status == s for c in checks)} {s}" for s in ("ok", "info", "warn", "fail"))
    console.print(Text(f"{len(checks)} checks: {counts}; overall {status.upper()}", style=_STATUS_STYLE[status]))


# ----------------------------------------------------------------------------- gpuopt presets


def _add_presets_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    presets = commands.add_parser(
        "presets",
        parents=[common],
        help="list the presets, or show one's settings",
        description="Without NAME: the shipped presets and what each does. With NAME (or a YAML file): its "
        "settings, `preset:` extensions resolved, and what each key means.",
    )
    presets.add_argument("name", nargs="?", metavar="NAME", help="a preset name or the path of a YAML file")
    presets.set_defaults(handler=run_presets)


def run_presets(args: argparse.Namespace) -> int:
    """``gpuopt presets [NAME]``: list the presets, or one preset's settings with each key's meaning."""
    from lightning_gpuopt.presets import PRESET_KEYS, available_presets, load_preset, preset_description, preset_path

    if args.name is None:
        listing = [
            {"name": name, "description": preset_description(name), "path": str(preset_path(name))}
            for name in available_presets()
        ]
        if args.json:
            _print_json({"presets": listing})
        else:
            table = _table("gpuopt presets  (gpuopt presets NAME shows one)", ["preset", "what it does"])
            for item in listing:
                table.add_row(item["name"], item["description"])
            _console().print(table)
        return 0
    try:
        settings = load_preset(args.name)
        description = preset_description(args.name)
    except ValueError as error:
        raise UsageError(f"`NAME`={args.name!r}: {error}") from None
    if args.json:
        _print_json(
            {
                "name": args.name,
                "path": str(preset_path(args.name)),
                "description": description,
                "settings": settings,
                "meanings": {key: PRESET_KEYS[key] for key in settings},
            }
        )
        return 0
    from rich.text import Text

    table = _table(f"gpuopt preset {args.name}", ["key", "value", "meaning"])
    for key, value in settings.items():
        table.add_row(Text(key), Text(json.dumps(value)), Text(PRESET_KEYS[key]))
    console = _console()
    console.print(Text(description))
    console.print(table)
    return 0


# ----------------------------------------------------------------------------- gpuopt plot


def _add_plot_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    plot = commands.add_parser(
        "plot",
        parents=[common],
        help="draw a gpuopt_report.json as PNGs (needs the [plot] extra)",
        description="Draw step time over training, memory vs batch size and the loader settings timed, "
        "each from its section of the report, as PNGs (lightning_gpuopt.core.plot.save_plots).",
    )
    plot.add_argument(
        "report",
        metavar="REPORT",
        help="a gpuopt_report.json written by the callbacks: a path or a URL (s3://..., gcs://..., any fsspec filesystem)",
    )
    plot.add_argument("--out", metavar="DIR", help="where the PNGs go, a path or a URL (default: beside REPORT)")
    plot.set_defaults(handler=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    """``gpuopt plot REPORT [--out DIR]``: the PNGs written, one a line; exit 1 when nothing could be drawn.

    ``REPORT`` and ``--out`` may be URLs of any fsspec filesystem (``s3://bucket/run/gpuopt_report.json``,
    ``memory://...``); a protocol whose package is not installed is an error naming it (exit 2)."""
    from lightning_gpuopt.core.plot import PLOT_NAMES, PlotUnavailableError, save_plots
    from lightning_gpuopt.core.storage import FilesystemUnavailableError, as_location, parent_location, read_bytes

    report = as_location(args.report)
    try:
        data = json.loads(read_bytes(report))
    except FilesystemUnavailableError as error:
        raise UsageError(f"`REPORT`={args.report!r} cannot be read: {error}") from None
    except Exception as error:
        # a local file: OSError or ValueError; a URL: whatever its filesystem raises (credentials, network)
        if isinstance(report, Path) and not isinstance(error, (OSError, ValueError)):
            raise
        raise UsageError(
            f"`REPORT`={args.report!r} is not a readable JSON report ({error}); expected the "
            "gpuopt_report.json in the trainer's log dir, e.g. "
            "lightning_logs/version_0/gpuopt_report.json"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"`REPORT`={args.report!r} holds {type(data).__name__}, not a gpuopt report's JSON object")
    out = as_location(args.out) if args.out is not None else parent_location(report)
    try:
        written = save_plots(data, out)
    except PlotUnavailableError as error:
        _print_error(f"gpuopt plot: error: {error}")
        return 1
    except FilesystemUnavailableError as error:
        raise UsageError(f"`--out`={str(out)!r}: {error}") from None
    except Exception as error:
        # writing to a URL: whatever its filesystem raises is an error message, not a traceback
        if isinstance(out, Path):
            raise
        _print_error(f"gpuopt plot: error: the PNGs could not be written to {out}: {type(error).__name__}: {error}")
        return 1
    if args.json:
        _print_json({"written": [str(path) for path in written]})
    else:
        for path in written:
            sys.stdout.write(f"{path}\n")
    if not written:
        _print_error(
            f"gpuopt plot: nothing to draw: {args.report} has none of the sections data_wait, batch_size_search, "
            f"dataloader with figures (plots: {', '.join(PLOT_NAMES)})"
        )
    return 0 if written else 1


# ----------------------------------------------------------------------------- gpuopt estimate


def _add_estimate_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    estimate = commands.add_parser(
        "estimate",
        parents=[common],
        help="a model's training-step memory and the largest batch that fits",
        description="Import MODULE:CLASS, build it, trace one training step on fake tensors (nothing is trained "
        "or allocated) and report the memory by part, the predicted peak at --batch-size and the "
        "largest batch that fits --max-memory. The batch comes from --input-size, else --datamodule's "
        "train_dataloader(), else the model's, else its example_input_array. A LightningModule gets a "
        "CPU Trainer attached (nothing is trained), so that configure_optimizers() and "
        "train_dataloader() can use self.trainer.",
    )
    estimate.add_argument(
        "target",
        metavar="MODULE:CLASS",
        help="the model class: a dotted module (importable, or under the current directory) or "
        "path/to/file.py, a colon, the class name; e.g. examples/models.py:TokenTransformer",
    )
    estimate.add_argument(
        "--init-args",
        default="{}",
        metavar="ARGS",
        help="keyword arguments of the class as JSON or YAML text or a .yaml/.json file, type-checked against "
        "its __init__; an argument typed as a class takes {class_path: ..., init_args: {...}}, e.g. "
        "'{\"width\": 256}', 'width: 256' or model.yaml",
    )
    estimate.add_argument(
        "--datamodule",
        metavar="MODULE:CLASS",
        help="a LightningDataModule class whose train_dataloader() gives the batch, as MODULE:CLASS "
        "is given, e.g. my_package.data:ImageNetData",
    )
    estimate.add_argument(
        "--datamodule-init-args",
        default="{}",
        metavar="ARGS",
        help="keyword arguments of the --datamodule class, as --init-args takes them (JSON, YAML or a file)",
    )
    estimate.add_argument(
        "--input-size",
        action="append",
        metavar="D1,D2,...",
        help="the shape of one sample of forward's input, without the batch dimension, e.g. "
        "3,224,224; repeat for several inputs (forward(*inputs)); the loss is then a "
        "stand-in: the mean of the output",
    )
    estimate.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16", "long"),
        help="dtype of the --input-size tensors (long: token ids below --vocab)",
    )
    estimate.add_argument(
        "--vocab",
        type=int,
        metavar="N",
        help="token ids for --dtype long are drawn from [0, N) (default: the model's first nn.Embedding)",
    )
    estimate.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help=f"the batch size to estimate at (default: the dataloader's, else {DEFAULT_BATCH_SIZE})",
    )
    estimate.add_argument(
        "--optimizer",
        default="auto",
        choices=ESTIMATE_OPTIMIZERS,
        help="auto (default): the model's configure_optimizers() (with a Trainer attached), else "
        "adam; sgd has momentum 0.9",
    )
    estimate.add_argument(
        "--precision",
        default="32-true",
        choices=ESTIMATE_PRECISIONS,
        help="as Lightning's Trainer(precision=...); 16-mixed only on CUDA",
    )
    estimate.add_argument(
        "--max-memory",
        metavar="MEMORY",
        help='the memory to fit: bytes, "20GiB", "300MB" or a fraction of the device (0.9); '
        "default: what the device can give a training step now",
    )
    estimate.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    estimate.set_defaults(handler=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    """``gpuopt estimate``: the :class:`~lightning_gpuopt.core.estimate.MemoryEstimate` of one model."""
    import torch

    from lightning_gpuopt.core.estimate import StepEstimator, TrainingStep, host_step_context
    from lightning_gpuopt.core.report import to_dict

    _check_estimate_numbers(args)
    device = _estimate_device(args.device, args.precision)
    cls = import_class(args.target)
    module = _instantiate(cls, args.init_args, args.target)
    datamodule = _datamodule(args)
    setup = EstimateSetup(model=f"{cls.__module__}.{cls.__qualname__}", device=str(device), precision=args.precision)
    # the model and the batch stay on the host (nothing is moved to a GPU): a CUDA run is traced there under a
    # CPU autocast of its dtype, and the device sets the 512-byte blocks and the cuBLAS workspace
    host = torch.device("cpu")
    module = _prepare_module(module, host, args.precision)
    trainer = _attach_trainer(module, datamodule, args, setup)
    batch, loss_fn, forward_input = _batch_and_loss(module, args, host, setup, datamodule)
    setup.batch_size = _batch_size_of(batch)
    optimizer = _optimizer(module, args.optimizer, setup)
    optimizers = [] if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
    capacity = _capacity(args.max_memory, device, module, setup)
    step = TrainingStep(
        module,
        batch,
        loss_fn,
        manual_step=_manual_step(module, trainer, optimizers, args, setup),
        optimizers=optimizers,
        batch_size=setup.batch_size,
        step_context=host_step_context(args.precision),
        device=device,
        forward_input=forward_input,
    )
    # kernel workspaces are learned once (on the host), for the estimate and the re-traces near the limit
    estimator = StepEstimator(step)
    estimate = estimator.estimate(capacity)
    if estimate.max_batch_size and setup.batch_size and estimate.max_batch_size > 2 * setup.batch_size:
        estimate = estimator.refined(estimate)  # as BatchSizeSearch does; beyond 2B the line extrapolates
    estimate = dataclasses.replace(estimate, notes=[*setup.notes, *estimate.notes])
    if args.json:
        setup_figures = {key: value for key, value in dataclasses.asdict(setup).items() if key != "notes"}
        _print_json({**to_dict(estimate), "setup": setup_figures})  # notes: in the estimate's
    else:
        _console().print(estimate_table(estimate, setup), markup=False, highlight=False)
    return 0


@dataclasses.dataclass
class EstimateSetup:
    """What ``gpuopt estimate`` ran with (the ``"setup"`` key of its JSON)."""

    model: str
    device: str
    precision: str
    datamodule: str = ""
    parameters: int = 0
    batch_source: str = ""
    batch_size: int | None = None
    loss: str = ""
    optimizer: str = ""
    memory_source: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)


def _manual_step(module: Any, trainer: Any, optimizers: list, args: argparse.Namespace, setup: EstimateSetup) -> Any:
    """For a LightningModule under manual optimization with a batch from a dataloader: its whole
    ``training_step`` (its backward passes and optimizer steps), traced with the Trainer attached
    (see :func:`lightning_gpuopt.callbacks.memory_estimator.manual_step`); else ``None``."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_gpuopt.callbacks.memory_estimator import manual_step

    if (
        trainer is None
        or module.automatic_optimization
        or args.input_size
        or not setup.batch_source.endswith("train_dataloader()")
        or not is_overridden("training_step", module)
    ):
        return None
    trainer.strategy.optimizers = optimizers  # what self.optimizers() reads outside the trace
    setup.loss = "the model's training_step() (manual optimization: its own backward passes and optimizer steps)"
    setup.notes[:] = [note for note in setup.notes if "stand-in" not in note]
    return manual_step(trainer, module)


def _check_estimate_numbers(args: argparse.Namespace) -> None:
    for name, value in (("--batch-size", args.batch_size), ("--vocab", args.vocab)):
        if value is not None and value < 1:
            raise UsageError(f"`{name}`={value} must be a positive integer, e.g. {name} 8.")


# -- the model


def import_class(target: str, base: type | None = None, argument: str = "MODULE:CLASS") -> type:
    """The class named by ``MODULE:CLASS`` or ``path/to/file.py:CLASS``, a subclass of ``base``
    (default ``torch.nn.Module``); errors name ``argument``.

    A dotted module is imported from ``sys.path`` with the current directory in front; a file is
    imported with its own directory on ``sys.path`` (for its sibling imports).

    Raises:
        UsageError: naming which part failed: the form, the file, the module, the class.

    Example::

        >>> import_class("torch.nn:Linear")
        <class 'torch.nn.modules.linear.Linear'>
        >>> import_class("torch.nn:Linnear")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_gpuopt.cli.command.UsageError: `MODULE:CLASS`='torch.nn:Linnear': the module 'torch.nn' has no ...
    """
    import torch

    base = torch.nn.Module if base is None else base
    label = f"`{argument}`={target!r}"
    module_part, colon, class_part = target.rpartition(":")
    if not colon or not module_part or not class_part:
        raise UsageError(
            f"{label} is not MODULE:CLASS: give the module (dotted, or path/to/file.py), a colon "
            "and the class, e.g. examples/models.py:TokenTransformer or my_package.models:MyModel."
        )
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        module = _import_file(module_part, label)
    else:
        module = _import_module(module_part, label)
    cls = getattr(module, class_part, None)
    if cls is None:
        close = difflib.get_close_matches(class_part, [name for name in vars(module) if not name.startswith("_")], 1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        candidates = ", ".join(_module_classes(module, base)) or "none"
        raise UsageError(
            f"{label}: the module {module_part!r} has no attribute {class_part!r}; {hint}"
            f"its {_class_name(base)} classes: {candidates}."
        )
    if not (isinstance(cls, type) and issubclass(cls, base)):
        candidates = ", ".join(_module_classes(module, base)) or "none"
        raise UsageError(
            f"{label}: {class_part!r} is a {type(cls).__name__}, not a {_class_name(base)} class; "
            f"the module's {_class_name(base)} classes: {candidates}."
        )
    return cls


def _class_name(cls: type) -> str:
    """``torch.nn.Module``, ``lightning.pytorch.LightningDataModule``: as users import it."""
    module = cls.__module__
    public = {"torch.nn.modules.module": "torch.nn", "lightning.pytorch.core.datamodule": "lightning.pytorch"}
    return f"{public.get(module, module)}.{cls.__qualname__}"


def _import_module(name: str, label: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            raise UsageError(
                f"{label}: the module part {name!r} cannot be imported ({error}); it is looked up on "
                f"sys.path and in the current directory {os.getcwd()}; give a dotted module path or "
                "path/to/file.py."
            ) from None
        raise UsageError(
            f"{label}: importing the module {name!r} failed: {error} (a dependency of it is missing)."
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's module raised while importing
        raise UsageError(f"{label}: importing the module {name!r} raised {type(error).__name__}: {error}") from None


def _import_file(path_text: str, label: str) -> ModuleType:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise UsageError(
            f"{label}: the file {path_text!r} does not exist (looked for {path}); give an existing "
            "path/to/file.py or a dotted module."
        )
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    name = path.stem if path.stem not in sys.modules else f"_gpuopt_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{label}: {path_text!r} cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file raised while importing
        del sys.modules[name]
        raise UsageError(f"{label}: importing the file {path_text!r} raised {type(error).__name__}: {error}") from None
    return module


def _module_classes(module: ModuleType, base: type | None = None, limit: int = 15) -> list[str]:
    """The ``base`` (default ``torch.nn.Module``) classes defined in ``module``; without any, those it
    exposes (at most ``limit``)."""
    import torch

    base = torch.nn.Module if base is None else base
    exposed = sorted(
        name for name, value in vars(module).items() if isinstance(value, type) and issubclass(value, base)
    )
    defined = [name for name in exposed if getattr(module, name).__module__ == module.__name__]
    names = defined or exposed
    return names[:limit] + (["..."] if len(names) > limit else [])


def _instantiate(
    cls: type, init_args: str, target: str, arguments: tuple[str, str] = ("MODULE:CLASS", "--init-args")
) -> Any:
    """``cls(**init_args)``: ``init_args`` is JSON, YAML or a .yaml/.json file's path, its values type-checked
    against ``cls.__init__`` by jsonargparse, and the ones given as ``class_path``/``init_args`` built; a
    parameter jsonargparse cannot type (untyped, ``**kwargs``) gets its value as given. Errors name
    ``arguments`` (the class's and the init args'), the value, what is wrong and the signature."""
    class_argument, init_argument = arguments
    label = f"`{init_argument}`={init_args!r}"
    signature = f"{cls.__name__}{_signature(cls)}"
    given = _init_args_mapping(init_args, label, signature)
    _check_init_keys(cls, given, label, signature)
    kwargs = _typed_init_args(cls, given, label, signature)
    try:
        return cls(**kwargs)
    except Exception as error:  # noqa: BLE001 - bad keyword arguments, or the class's own checks
        raise UsageError(
            f"{cls.__name__}(**{given!r}) from `{class_argument}`={target!r} and `{init_argument}` "
            f"raised {type(error).__name__}: {error}; the signature is {signature}."
        ) from None


#: the suffixes of the files ``--init-args`` and ``--datamodule-init-args`` read
INIT_ARGS_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def _init_args_mapping(text: str, label: str, signature: str) -> dict[str, Any]:
    """The keyword arguments in ``text``: a JSON object, a YAML mapping, or the path of a .yaml/.json
    file holding one (empty text or an empty file: none); errors end with ``signature``."""
    stripped = text.strip()
    path = Path(stripped).expanduser()
    what_works = (
        'give a mapping of keyword arguments as JSON or YAML, e.g. \'{"width": 256, "depth": 4}\' or '
        f"'width: 256', or a .yaml/.json file of one; the signature is {signature}."
    )
    if stripped and "\n" not in stripped and path.suffix.lower() in INIT_ARGS_FILE_SUFFIXES:
        if not path.is_file():
            raise UsageError(
                f"{label}: the file {stripped!r} does not exist (looked for {path.resolve()}); {what_works}"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{label}: the file {stripped!r} cannot be read ({error}); {what_works}") from None
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        from jsonargparse import get_loader

        try:
            value = get_loader("yaml")(text)
        except Exception as error:  # noqa: BLE001 - the YAML loader's errors (yaml.YAMLError and the like)
            raise UsageError(f"{label} is not JSON or YAML ({' '.join(str(error).split())}); {what_works}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{label} is a {type(value).__name__} ({_short(value)}), not a mapping; {what_works}")
    keys = [key for key in value if not isinstance(key, str)]
    if keys:
        raise UsageError(f"{label}: the key {keys[0]!r} is not a parameter name; {what_works}")
    return value


def _check_init_keys(cls: type, given: dict[str, Any], label: str, signature: str) -> None:
    """Unknown keys (without ``**kwargs``) and missing required parameters, named with the signature."""
    parameters = _init_parameters(cls)
    if parameters is None:
        return
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [name for name, parameter in parameters.items() if parameter.kind in by_name]
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        unknown = [key for key in given if key not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, 1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            plural = "s" if len(unknown) > 1 else ""
            raise UsageError(
                f"{label}: unexpected keyword argument{plural} {', '.join(map(repr, unknown))} "
                f"(unknown key{plural}{hint}); the signature is {signature}."
            )
    missing = [
        name
        for name, parameter in parameters.items()
        if parameter.kind in by_name and parameter.default is inspect.Parameter.empty and name not in given
    ]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise UsageError(
            f"{label}: missing required argument{plural} {', '.join(map(repr, missing))} (no default in the "
            f"signature: give {'them' if plural else 'it'}); the signature is {signature}."
        )


def _typed_init_args(cls: type, given: dict[str, Any], label: str, signature: str) -> dict[str, Any]:
    """``given`` type-checked by jsonargparse against ``cls.__init__``'s type hints, values given as
    ``class_path``/``init_args`` built; the values of parameters it cannot type pass as given."""
    if not given:
        return {}
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False, default_env=False)
    try:
        added = parser.add_class_arguments(cls, "init", instantiate=False, fail_untyped=False)
    except Exception:  # noqa: BLE001 - a signature jsonargparse cannot read: every value as given
        return dict(given)
    # jsonargparse gives an untyped parameter a type from its default (or Any): its value stays as given
    parameters = _init_parameters(cls) or {}
    untyped = {name for name, parameter in parameters.items() if parameter.annotation is inspect.Parameter.empty}
    typed = {name.split(".")[1] for name in added if name.count(".") == 1} - untyped
    checked = {key: value for key, value in given.items() if key in typed}
    if not checked:
        return dict(given)
    try:
        config = parser.parse_object({"init": checked})
    except argparse.ArgumentError as error:
        message = str(error)
        key = _jsonargparse_key(message, checked)
        if key is None:  # about a default or a parameter not given: the constructor has the last word
            return dict(given)
        raise UsageError(
            f"{label}: wrong type or value for {key!r}: {_short(given[key])} does not fit "
            f"`{_parameter_text(cls, key)}` ({_jsonargparse_reason(message)}); the signature is {signature}."
        ) from None
    except Exception:  # noqa: BLE001 - jsonargparse failed on a type it cannot check: every value as given
        return dict(given)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # 4.49 renamed it
    try:
        config = instantiate(config)
    except Exception as error:  # noqa: BLE001 - a class given as class_path raised
        reason = _jsonargparse_reason(str(error))
        raise UsageError(
            f"{label}: building the classes given as class_path raised {type(error).__name__}: {reason}; "
            f"the signature is {signature}."
        ) from None
    return {**given, **{key: config["init"][key] for key in checked}}


def _jsonargparse_key(message: str, keys: dict[str, Any]) -> str | None:
    """The given key a jsonargparse error is about (``Parser key "init.hidden"``, ``Key "init.depth"``)."""
    for match in re.finditer(r"""["']init\.([A-Za-z_][A-Za-z_0-9]*)""", message):
        if match.group(1) in keys:
            return match.group(1)
    return None


def _jsonargparse_reason(message: str, limit: int = 600) -> str:
    """A jsonargparse error's reason on one line, without its ``Parser key "..."`` header, the value again
    (the message shows it) and an ``Optional``'s ``None`` alternative."""
    noise = ("Parser key", "Subtypes:", "Given value", "- Expected a <class 'NoneType'>")
    reason = " ".join(line.strip() for line in message.strip().splitlines() if not line.strip().startswith(noise))
    if reason == "Cannot take a Union of no types.":  # jsonargparse 4.39 on a value outside a Literal
        reason = "not one of the values its type allows"
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _parameter_text(cls: type, name: str) -> str:
    """``hidden: int = 32``: the parameter as the signature shows it (the name alone without one)."""
    parameters = _init_parameters(cls)
    return str(parameters[name]) if parameters is not None and name in parameters else name


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _datamodule(args: argparse.Namespace) -> Any:
    """The ``--datamodule`` instance (``None`` without one)."""
    from lightning.pytorch import LightningDataModule

    if args.datamodule is None:
        if args.datamodule_init_args.strip() not in ("", "{}"):
            raise UsageError(
                f"`--datamodule-init-args`={args.datamodule_init_args!r} without --datamodule: name "
                "the class too, e.g. --datamodule my_package.data:MyData."
            )
        return None
    cls = import_class(args.datamodule, LightningDataModule, "--datamodule")
    return _instantiate(cls, args.datamodule_init_args, args.datamodule, ("--datamodule", "--datamodule-init-args"))


def _attach_trainer(module: Any, datamodule: Any, args: argparse.Namespace, setup: EstimateSetup) -> Any:
    """A LightningModule gets a CPU Trainer attached, as ``Trainer.fit`` attaches one (with the
    datamodule), so that ``configure_optimizers()`` and ``train_dataloader()`` can read
    ``self.trainer`` (e.g. ``estimated_stepping_batches``, ``datamodule``); nothing is trained.
    Returns the Trainer (``None`` for a plain ``torch.nn.Module``)."""
    import logging

    from lightning.pytorch import LightningModule, Trainer

    if datamodule is not None:
        setup.datamodule = f"{type(datamodule).__module__}.{type(datamodule).__qualname__}"
    if not isinstance(module, LightningModule):
        if datamodule is not None:
            raise UsageError(
                f"`--datamodule`={args.datamodule!r} needs a LightningModule to train on its batches; "
                f"`MODULE:CLASS`={args.target!r} is a plain torch.nn.Module."
            )
        return None
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # no "GPU available: ..." lines in the command's output
    try:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=-1,
            max_steps=ESTIMATE_TRAINER_STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
    finally:
        quiet.setLevel(level)
    from lightning_gpuopt.callbacks import _lightning_compat as compat

    # what Trainer.fit does first: the model and the datamodule know the trainer, and it them
    compat.attach_data(trainer, module, datamodule=datamodule)
    trainer.strategy.connect(module)
    if datamodule is not None:
        compat.call_datamodule_hook(trainer, "prepare_data")
        compat.call_datamodule_hook(trainer, "setup", stage="fit")
    return trainer


def _batch_size_of(batch: Any) -> int | None:
    """The batch size, found as Lightning finds it (:func:`lightning.pytorch.utilities.data.extract_batch_size`:
    the first dimension of the first tensor, through dicts, lists and tuples); ``None`` without a tensor."""
    import warnings

    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Trying to infer the batch_size from an ambiguous collection"
            return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - no tensor with a dimension in it
        return None


def _signature(cls: type) -> str:
    """``(width: int = 64, depth: int = 2)``: the class's call signature as text (``(...)`` without one)."""
    signature = _init_signature(cls)
    return "(...)" if signature is None else str(signature)


def _init_signature(cls: type) -> inspect.Signature | None:
    """The signature of ``cls(...)``, annotations evaluated where they can be (``from __future__ import
    annotations``); ``None`` for a class without a readable one."""
    for eval_str in (True, False):
        try:
            return inspect.signature(cls, eval_str=eval_str)
        except Exception:  # noqa: BLE001 - an annotation's NameError, no signature: try the next way
            continue
    return None


def _init_parameters(cls: type) -> Mapping[str, inspect.Parameter] | None:
    signature = _init_signature(cls)
    return None if signature is None else signature.parameters


def _estimate_device(requested: str | None, precision: str) -> torch.device:
    import torch

    from lightning_gpuopt.core.device import cuda_available

    if requested == "cuda" and not cuda_available():
        raise UsageError("`--device`='cuda' but CUDA is not available here (see `gpuopt doctor`); use --device cpu.")
    device = torch.device(requested or ("cuda" if cuda_available() else "cpu"))
    if precision == "16-mixed" and device.type != "cuda":
        raise UsageError(
            f"`--precision`='16-mixed' needs CUDA and the device is {device.type}; on a CPU use --precision bf16-mixed."
        )
    return device


def _prepare_module(module: Any, device: torch.device, precision: str) -> Any:
    import torch

    module = module.to(device)
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    module.train()
    return module


# -- the batch and the loss


def _batch_and_loss(
    module: Any, args: argparse.Namespace, device: torch.device, setup: EstimateSetup, datamodule: Any = None
) -> tuple:
    """``(batch, loss_fn, forward_input)`` from --input-size, else the datamodule's or the model's
    dataloader, else example_input_array; fills ``setup``'s batch, loss and parameter fields."""
    setup.parameters = sum(p.numel() for p in module.parameters())
    if args.input_size:
        batch = _batch_of_sizes(module, args, device)
        setup.batch_source = f"random {args.dtype} tensors of size {' and '.join(args.input_size)} (--input-size)"
        return batch, _stand_in_loss_fn(module, setup), batch
    found = _loader_batch(module, args.batch_size, device, setup, datamodule)
    if found is not None:
        return found
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise UsageError(
            f"`MODULE:CLASS`={args.target!r} gives no batch: it has no train_dataloader() and no "
            "example_input_array; pass --input-size (e.g. --input-size 3,224,224, or --input-size 128 "
            "--dtype long for token ids), or for a LightningModule --datamodule MODULE:CLASS (a "
            "LightningDataModule whose train_dataloader() gives the batches)."
        )
    batch = _resized(_to_device(example, device, module), args.batch_size or DEFAULT_BATCH_SIZE)
    setup.batch_source = "example_input_array, resized to the batch size"
    return batch, _stand_in_loss_fn(module, setup), batch


def _batch_of_sizes(module: Any, args: argparse.Namespace, device: torch.device) -> Any:
    import torch

    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    tensors = []
    for text in args.input_size:
        if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", text) or any(int(n) < 1 for n in re.findall(r"\d+", text)):
            raise UsageError(
                f"`--input-size`={text!r} is not a list of positive integers; give one sample's shape "
                "without the batch dimension, e.g. --input-size 3,224,224."
            )
        shape = (batch_size, *(int(n) for n in re.findall(r"\d+", text)))
        if args.dtype == "long":
            tensors.append(torch.randint(0, _vocab(module, args.vocab), shape, device=device))
        else:
            dtype = getattr(torch, args.dtype)
            if args.precision == "bf16-true":
                dtype = torch.bfloat16
            tensors.append(torch.randn(shape, device=device).to(dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _vocab(module: Any, vocab: int | None) -> int:
    import torch

    if vocab is not None:
        return vocab
    for sub in module.modules():
        if isinstance(sub, torch.nn.Embedding):
            return int(sub.num_embeddings)
    raise UsageError(
        "`--dtype`='long' needs the range of the token ids and the model has no nn.Embedding; "
        "give it with --vocab N, e.g. --vocab 32000."
    )


def _loader_batch(
    module: Any, batch_size: int | None, device: torch.device, setup: EstimateSetup, datamodule: Any = None
) -> tuple | None:
    """A batch from the datamodule's or the LightningModule's own ``train_dataloader()`` (with the
    Trainer attached), with ``training_step`` as the loss."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_gpuopt.callbacks._training_step import loss_function

    if datamodule is not None:
        source, owner = "the datamodule's train_dataloader()", datamodule
    elif isinstance(module, LightningModule) and is_overridden("train_dataloader", module):
        source, owner = "the model's train_dataloader()", module
    else:
        return None
    if batch_size is not None and isinstance(getattr(owner, "batch_size", None), int):
        owner.batch_size = batch_size
    try:
        batch = next(iter(owner.train_dataloader()))
    except Exception as error:  # noqa: BLE001 - the user's loader failed: say where, and what else works
        if datamodule is not None:
            raise UsageError(
                f"{source} of `--datamodule`={type(datamodule).__name__} raised {type(error).__name__}: {error}"
            ) from None
        setup.notes.append(
            f"train_dataloader() failed with a Trainer attached ({type(error).__name__}: {error}); "
            "using example_input_array or --input-size instead"
        )
        return None
    batch = _to_device(batch, device, module)
    loaded = _batch_size_of(batch)
    if batch_size is not None and loaded is not None and loaded != batch_size:
        batch = _resized(batch, batch_size)
        setup.notes.append(f"the dataloader gives batches of {loaded}; its samples are repeated to make {batch_size}")
    setup.batch_source = source
    example = getattr(module, "example_input_array", None)
    forward_input = _to_device(example, device, module) if example is not None else _first_tensor(batch)
    if isinstance(forward_input, dict):
        forward_input = None  # a dict batch is not forward's keyword arguments: no torchinfo summary without
        setup.notes.append("no torchinfo summary: the batch is a dict and the model has no example_input_array")
    if is_overridden("training_step", module) and module.automatic_optimization:
        setup.loss = "the model's training_step()"
        return batch, loss_function(module), forward_input
    return batch, _stand_in_loss_fn(module, setup, forward_of=_first_tensor), forward_input


def _first_tensor(batch: Any) -> Any:
    import torch

    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch


def _to_device(data: Any, device: torch.device, module: Any) -> Any:
    """Tensors of ``data`` on ``device``; floating ones in the module's dtype under bf16-true."""
    import torch

    from lightning_gpuopt.core._torch_compat import tree_map

    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)

    def move(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() and dtype == torch.bfloat16 else value

    return tree_map(move, data)


def _resized(batch: Any, batch_size: int) -> Any:
    """``batch`` with every tensor of its leading dimension repeated or cut to ``batch_size`` rows
    (through dicts, lists and tuples)."""
    import torch

    from lightning_gpuopt.core._torch_compat import tree_map

    current = _batch_size_of(batch)
    if current is None or current == batch_size:
        return batch

    def resize(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == current:
            return value[torch.arange(batch_size, device=value.device) % current]
        return value

    return tree_map(resize, batch)


def _call_forward(module: Any, forward_input: Any) -> Any:
    if isinstance(forward_input, dict):
        return module(**forward_input)
    if isinstance(forward_input, (list, tuple)):
        return module(*forward_input)
    return module(forward_input)


def _stand_in_loss_fn(
    module: Any, setup: EstimateSetup, forward_of: Callable[[Any], Any] = lambda batch: batch
) -> Callable[[Any], Any]:
    """``batch -> sum of the means of forward's floating outputs``, for batches without a training_step."""
    import torch

    from lightning_gpuopt.core._torch_compat import tree_leaves

    setup.loss = "stand-in: the mean of forward's output"
    setup.notes.append(
        "no training_step for this batch: the loss is a stand-in, the mean of forward's output; "
        "a real loss adds little (targets and a few scalars)"
    )

    def loss_of(batch: Any) -> torch.Tensor:
        leaves = [
            leaf
            for leaf in tree_leaves(_call_forward(module, forward_of(batch)))
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        ]
        if not leaves:
            raise TypeError("forward returned no floating-point tensor to take a stand-in loss of")
        return cast(torch.Tensor, sum(leaf.float().mean() for leaf in leaves))  # leaves is not empty: no 0

    return loss_of


# -- the optimizer and the memory


def _optimizer(module: Any, choice: str, setup: EstimateSetup) -> Any:
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    if choice == "auto":
        configured = _configured_optimizer(module, setup)
        if configured is False:  # configure_optimizers() returned None: Lightning trains without one
            return None
        if isinstance(configured, list):
            setup.optimizer = f"{', '.join(type(o).__name__ for o in configured)} (configure_optimizers())"
            return configured
        if configured is not None:
            setup.optimizer = f"{type(configured).__name__} (configure_optimizers())"
            return configured
        choice = "adam"
    setup.optimizer = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD (momentum 0.9)", "none": "none"}[choice]
    if choice == "none" or not params:
        return None
    if choice == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return (torch.optim.AdamW if choice == "adamw" else torch.optim.Adam)(params, lr=1e-3)


def _configured_optimizer(module: Any, setup: EstimateSetup) -> Any:
    """The optimizer of a LightningModule's ``configure_optimizers()``, built as ``Trainer.fit``
    builds it (Lightning's ``_init_optimizers_and_lr_schedulers``: any return form -- an optimizer,
    a list, ``([optimizers], [schedulers])``, a dict or a list of dicts -- with the Trainer attached);
    ``None`` without one (then Adam).

    Raises:
        UsageError: ``configure_optimizers()`` raised, or Lightning refuses what it returned.
    """
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(module, LightningModule) or not is_overridden("configure_optimizers", module):
        setup.notes.append("the model defines no configure_optimizers(): estimating with Adam")
        return None
    from lightning_gpuopt.callbacks import _lightning_compat as compat

    try:
        optimizers, _ = compat.init_optimizers_and_lr_schedulers(module)
    except Exception as error:  # noqa: BLE001 - the user's configure_optimizers, or Lightning's checks of it
        raise UsageError(
            f"configure_optimizers() of {type(module).__name__} raised {type(error).__name__}: {error} "
            f"(with a CPU Trainer attached, max_steps={ESTIMATE_TRAINER_STEPS}); fix it, or estimate "
            "with one of ours: --optimizer adam|adamw|sgd|none."
        ) from None
    optimizers = [optimizer for optimizer in optimizers if not isinstance(optimizer, compat.MockOptimizer)]
    if not optimizers:
        setup.notes.append("configure_optimizers() returned no optimizer: estimating without optimizer state")
        setup.optimizer = "none (configure_optimizers() returned None)"
        return False
    if len(optimizers) > 1:  # Lightning allows it only with manual optimization
        setup.notes.append(
            f"configure_optimizers() returned {len(optimizers)} optimizers: the training_step steps each of them"
        )
        return optimizers
    return optimizers[0]


def memory_argument(text: str) -> int | float | str:
    """A ``--max-memory`` string as :func:`~lightning_gpuopt.core.memory.parse_memory` takes it.

    Example::

        >>> memory_argument("4096"), memory_argument("0.9"), memory_argument("20GiB")
        (4096, 0.9, '20GiB')
    """
    if re.fullmatch(r"\s*\d+\s*", text):
        return int(text)
    if re.fullmatch(r"\s*\d*\.\d+\s*", text):
        return float(text)
    return text


def _capacity(max_memory: str | None, device: torch.device, module: Any, setup: EstimateSetup) -> int:
    from lightning_gpuopt.core.memory import device_usable_memory, parse_memory

    if max_memory is None:
        setup.memory_source = f"what {device} can give a training step now (free + held by torch)"
        return device_usable_memory(device, existing=[module])
    try:
        capacity = parse_memory(memory_argument(max_memory), device, name="--max-memory")
    except ValueError as error:
        raise UsageError(str(error)) from None
    setup.memory_source = f"--max-memory {max_memory}"
    return capacity


# -- the output


def estimate_table(estimate: Any, setup: EstimateSetup) -> str:
    """The estimate and its setup as a text table (rich), notes below."""
    from lightning_gpuopt.core.report import format_bytes, format_seconds, render_table

    per_sample = "n/a"
    if estimate.bytes_per_sample is not None:
        per_sample = f"{format_bytes(estimate.fixed_bytes)} + {format_bytes(estimate.bytes_per_sample)} per sample"
    rows = [
        ("model", f"{setup.model}, {setup.parameters:,} parameters ({estimate.param_dtype})"),
        ("device, precision", f"{setup.device}, {setup.precision}"),
        ("optimizer", setup.optimizer),
        ("batch", f"{setup.batch_size} samples from {setup.batch_source}"),
        *([("datamodule", setup.datamodule)] if setup.datamodule else []),
        ("loss", setup.loss),
        ("method", estimate.method),
        ("parameters", format_bytes(estimate.params_bytes)),
        ("gradients", format_bytes(estimate.grads_bytes)),
        ("optimizer state", format_bytes(estimate.optimizer_bytes)),
        ("buffers", format_bytes(estimate.buffers_bytes)),
        ("batch tensors", format_bytes(estimate.batch_bytes)),
        ("activations and temporaries", format_bytes(estimate.activation_bytes)),
        (f"predicted peak at batch size {setup.batch_size}", format_bytes(estimate.predicted_peak_bytes)),
        ("peak = fixed + per sample", per_sample),
        ("memory to fit", f"{format_bytes(estimate.capacity_bytes)} ({setup.memory_source})"),
        ("largest batch that fits", "n/a" if estimate.max_batch_size is None else f"{estimate.max_batch_size:,}"),
        ("torchinfo total (for comparison)", format_bytes(estimate.torchinfo_total_bytes)),
        ("trace time", format_seconds(estimate.trace_seconds)),
    ]
    return render_table("gpuopt estimate", rows, notes=[f"  • {note}" for note in estimate.notes])
