"""The ``gpuopt`` console command: ``doctor``, ``presets``, ``estimate``, ``plot`` (``gpuopt COMMAND --help``).

Tables on stdout, or one JSON document with ``--json``. Exit status: 0 on success, 2 on bad usage (the
message names the argument, the value and what would work), 1 when ``doctor`` finds a "fail" or ``plot``
draws nothing. ``gpuopt estimate`` builds the model and ``--datamodule`` from ``--init-args`` as
LightningCLI builds its classes: jsonargparse checks the values against ``__init__``'s types and builds
those given as ``{class_path: ..., init_args: {...}}``.

Only the standard library is imported at the top; torch, Lightning, rich and jsonargparse are imported by
the subcommand that needs them, so ``gpuopt --help`` and ``gpuopt presets`` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

if TYPE_CHECKING:
    import torch

#: precisions ``gpuopt estimate`` accepts (Lightning's names), and the optimizers it builds
ESTIMATE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
ESTIMATE_OPTIMIZERS = ("auto", "adam", "adamw", "sgd", "none")
#: the batch size of ``--input-size`` and ``example_input_array`` batches without ``--batch-size``
DEFAULT_BATCH_SIZE = 8
#: ``max_steps`` of the Trainer attached to a LightningModule (``estimated_stepping_batches`` reads it)
ESTIMATE_TRAINER_STEPS = 1000

_STATUS_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


class UsageError(Exception):
    """Bad command-line input (exit status 2): the message names the argument, the value and what works."""


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
        sys.stderr.write(f"gpuopt {args.command}: error: {error}\n")
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``gpuopt`` argument parser and its subcommands."""
    from lightning_gpuopt import __version__

    parser = argparse.ArgumentParser(
        prog="gpuopt", description="Check a machine for GPU training, show presets, estimate a model's memory."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{doctor,presets,estimate,plot}")

    def command(name: str, handler: Callable[[argparse.Namespace], int], summary: str, description: str) -> Any:
        sub = commands.add_parser(name, parents=[common], help=summary, description=description)
        sub.set_defaults(handler=handler)
        return sub

    doctor = command(
        "doctor",
        run_doctor,
        "environment checks, each with a status and a fix",
        "Check torch/CUDA vs the driver and GPU, the GPUs and who else uses them, matmul speed, CPU cores and "
        "threads, BLAS, pinned memory and /dev/shm. Exit status 1 on a 'fail'.",
    )
    timing = doctor.add_mutually_exclusive_group()
    timing.add_argument("--quick", action="store_true", help="a 0.3 s matmul benchmark instead of 2 s")
    timing.add_argument(
        "--matmul-seconds", type=float, default=2.0, metavar="S", help="seconds of matmul benchmark (0 skips it)"
    )
    presets = command(
        "presets",
        run_presets,
        "list the presets, or show one's settings",
        "Without NAME: the shipped presets and what each does. With NAME (or a YAML file): its settings, "
        "`preset:` extensions resolved, and what each key means.",
    )
    presets.add_argument("name", nargs="?", metavar="NAME", help="a preset name or the path of a YAML file")
    _add_estimate_arguments(
        command(
            "estimate",
            run_estimate,
            "a model's training-step memory and the largest batch that fits",
            "Import MODULE:CLASS, build it, trace one training step on fake tensors (nothing is trained or "
            "allocated) and report the memory by part, the peak at --batch-size and the largest batch that fits "
            "--max-memory. The batch comes from --input-size, else --datamodule's train_dataloader(), else the "
            "model's, else its example_input_array. A LightningModule gets a CPU Trainer attached, so that "
            "configure_optimizers() and train_dataloader() can use self.trainer.",
        )
    )
    plot = command(
        "plot",
        run_plot,
        "draw a gpuopt_report.json as PNGs (needs the [plot] extra)",
        "Draw step time over training, memory vs batch size and the loader settings timed, each from its "
        "section of the report, as PNGs (lightning_gpuopt.core.plot.save_plots).",
    )
    plot.add_argument(
        "report", metavar="REPORT", help="a gpuopt_report.json: a path or a URL (s3://..., any fsspec filesystem)"
    )
    plot.add_argument("--out", metavar="DIR", help="where the PNGs go, a path or a URL (default: beside REPORT)")
    return parser


def _add_estimate_arguments(estimate: argparse.ArgumentParser) -> None:
    add = estimate.add_argument
    add(
        "target",
        metavar="MODULE:CLASS",
        help="the model class: a dotted module (importable, or under the current directory) or path/to/file.py, "
        "a colon, the class name; e.g. examples/models.py:TokenTransformer",
    )
    add(
        "--init-args",
        default="{}",
        metavar="ARGS",
        help="the class's keyword arguments as JSON or YAML text or a .yaml/.json file, checked against its "
        "__init__; an argument typed as a class takes {class_path: ..., init_args: {...}}; e.g. 'width: 256'",
    )
    add("--datamodule", metavar="MODULE:CLASS", help="a LightningDataModule whose train_dataloader() gives the batch")
    add("--datamodule-init-args", default="{}", metavar="ARGS", help="its keyword arguments, as --init-args")
    add(
        "--input-size",
        action="append",
        metavar="D1,D2,...",
        help="one sample's shape of forward's input, without the batch dimension, e.g. 3,224,224; repeat for "
        "several inputs; the loss is then a stand-in, the mean of the output",
    )
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "long"), help="of --input-size")
    add("--vocab", type=int, metavar="N", help="--dtype long: ids in [0, N) (default: the first nn.Embedding's)")
    add("--batch-size", type=int, metavar="N", help=f"default: the dataloader's, else {DEFAULT_BATCH_SIZE}")
    add(
        "--optimizer",
        default="auto",
        choices=ESTIMATE_OPTIMIZERS,
        help="auto: the model's configure_optimizers() (with a Trainer attached), else adam; sgd: momentum 0.9",
    )
    add("--precision", default="32-true", choices=ESTIMATE_PRECISIONS, help="16-mixed only on CUDA")
    add(
        "--max-memory",
        metavar="MEMORY",
        help='bytes, "20GiB", "300MB" or a fraction of the device (0.9); default: what the device can give now',
    )
    add("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")


def _console() -> Any:
    from rich.console import Console

    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 120))
    return Console(width=width, highlight=False)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _table(title: str, columns: Sequence[str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


# ----------------------------------------------------------------------------- gpuopt doctor


def run_doctor(args: argparse.Namespace) -> int:
    """``gpuopt doctor``: :func:`lightning_gpuopt.core.doctor.run_checks`; 1 if one "fail"s."""
    from rich.text import Text

    from lightning_gpuopt.core.doctor import run_checks, worst_status

    if args.matmul_seconds < 0:
        raise UsageError(f"`--matmul-seconds`={args.matmul_seconds} is negative; use e.g. 2 (or 0 to skip).")
    checks = run_checks(matmul_seconds=0.3 if args.quick else args.matmul_seconds)
    status = worst_status(checks)
    if args.json:
        _print_json({"status": status, "checks": [dataclasses.asdict(check) for check in checks]})
        return 1 if status == "fail" else 0
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
    return 1 if status == "fail" else 0


# ----------------------------------------------------------------------------- gpuopt presets


def run_presets(args: argparse.Namespace) -> int:
    """``gpuopt presets [NAME]``: the presets, or one preset's settings with each key's meaning."""
    from rich.text import Text

    from lightning_gpuopt.presets import PRESET_KEYS, available_presets, load_preset, preset_description, preset_path

    if args.name is None:
        listing = [
            {"name": name, "description": preset_description(name), "path": str(preset_path(name))}
            for name in available_presets()
        ]
        if args.json:
            _print_json({"presets": listing})
            return 0
        table = _table("gpuopt presets  (gpuopt presets NAME shows one)", ["preset", "what it does"])
        for item in listing:
            table.add_row(item["name"], item["description"])
        _console().print(table)
        return 0
    try:
        settings, description = load_preset(args.name), preset_description(args.name)
    except ValueError as error:
        raise UsageError(f"`NAME`={args.name!r}: {error}") from None
    meanings = {key: PRESET_KEYS[key] for key in settings}
    if args.json:
        shown = {"name": args.name, "path": str(preset_path(args.name)), "description": description}
        _print_json({**shown, "settings": settings, "meanings": meanings})
        return 0
    table = _table(f"gpuopt preset {args.name}", ["key", "value", "meaning"])
    for key, value in settings.items():
        table.add_row(Text(key), Text(json.dumps(value)), Text(meanings[key]))
    console = _console()
    console.print(Text(description))
    console.print(table)
    return 0


# ----------------------------------------------------------------------------- gpuopt plot


def run_plot(args: argparse.Namespace) -> int:
    """``gpuopt plot REPORT [--out DIR]``: the PNGs written, one a line; 1 when nothing could be drawn.
    ``REPORT`` and ``--out`` may be URLs of any fsspec filesystem; one whose package is missing is exit 2."""
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
            f"`REPORT`={args.report!r} is not a readable JSON report ({error}); expected the gpuopt_report.json "
            "in the trainer's log dir, e.g. lightning_logs/version_0/gpuopt_report.json"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"`REPORT`={args.report!r} holds {type(data).__name__}, not a gpuopt report's JSON object")
    out = as_location(args.out) if args.out is not None else parent_location(report)
    try:
        written = save_plots(data, out)
    except PlotUnavailableError as error:
        sys.stderr.write(f"gpuopt plot: error: {error}\n")
        return 1
    except FilesystemUnavailableError as error:
        raise UsageError(f"`--out`={str(out)!r}: {error}") from None
    except Exception as error:
        if isinstance(out, Path):  # writing to a URL: what its filesystem raises is a message, not a traceback
            raise
        sys.stderr.write(
            f"gpuopt plot: error: the PNGs could not be written to {out}: {type(error).__name__}: {error}\n"
        )
        return 1
    if args.json:
        _print_json({"written": [str(path) for path in written]})
    else:
        sys.stdout.writelines(f"{path}\n" for path in written)
    if not written:
        sys.stderr.write(
            f"gpuopt plot: nothing to draw: {args.report} has none of the sections data_wait, batch_size_search, "
            f"dataloader with figures (plots: {', '.join(PLOT_NAMES)})\n"
        )
    return 0 if written else 1


# ----------------------------------------------------------------------------- gpuopt estimate


def run_estimate(args: argparse.Namespace) -> int:
    """``gpuopt estimate``: the :class:`~lightning_gpuopt.core.estimate.MemoryEstimate` of one model."""
    import torch

    from lightning_gpuopt.core.estimate import estimate_memory, host_step_context, learn_workspaces
    from lightning_gpuopt.core.report import to_dict

    _check_estimate_numbers(args)
    device = _estimate_device(args.device, args.precision)
    cls = _import_class(args.target, "MODULE:CLASS", torch.nn.Module, "torch.nn.Module")
    module = _instantiate(cls, args.init_args, "--init-args", "model")
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
    capacity = _capacity(args.max_memory, device, module, setup)
    trace = dict(
        optimizer=optimizer,
        batch_size=setup.batch_size,
        step_context=host_step_context(args.precision),
        device=device,
        manual_step=_manual_step(module, trainer, optimizer, args, setup),
    )
    # kernel workspaces learned once (on the host), for the estimate and the re-traces near the limit
    trace["workspaces"] = learn_workspaces(
        module,
        loss_fn,
        batch,
        batch_size=setup.batch_size,
        step_context=trace["step_context"],
        device=device,
        manual_step=trace["manual_step"],
        optimizer=optimizer,
    )
    estimate = estimate_memory(module, loss_fn, batch, forward_input=forward_input, capacity_bytes=capacity, **trace)
    estimate = refined_near_capacity(estimate, module, loss_fn, batch, trace)
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


def _manual_step(module: Any, trainer: Any, optimizer: Any, args: argparse.Namespace, setup: EstimateSetup) -> Any:
    """For a LightningModule under manual optimization with a batch from a dataloader: its whole
    ``training_step`` (its backward passes and optimizer steps), traced with the Trainer attached
    (see :func:`lightning_gpuopt.callbacks.memory_estimator.manual_step`); else ``None``."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_gpuopt.callbacks.memory_estimator import manual_step
    from lightning_gpuopt.core.estimate import optimizer_list

    if (
        trainer is None
        or module.automatic_optimization
        or args.input_size
        or not setup.batch_source.endswith("train_dataloader()")
        or not is_overridden("training_step", module)
    ):
        return None
    trainer.strategy.optimizers = optimizer_list(optimizer)  # what self.optimizers() reads outside the trace
    setup.loss = "the model's training_step() (manual optimization: its own backward passes and optimizer steps)"
    setup.notes[:] = [note for note in setup.notes if "stand-in" not in note]
    return manual_step(trainer, module)


def _check_estimate_numbers(args: argparse.Namespace) -> None:
    for name, value in (("--batch-size", args.batch_size), ("--vocab", args.vocab)):
        if value is not None and value < 1:
            raise UsageError(f"`{name}`={value} must be a positive integer, e.g. {name} 8.")


# -- the model


def _import_class(target: str, argument: str, base: type, base_name: str) -> type:
    """The ``base`` class named by ``target``, ``MODULE:CLASS``: a dotted module or ``path/to/file.py``
    (imported with its folder first on ``sys.path``). Errors name ``argument`` and the part that failed."""
    label = f"`{argument}`={target!r}"
    module_part, _, class_part = target.rpartition(":")
    if not module_part or not class_part:
        raise UsageError(
            f"{label} is not MODULE:CLASS: give the module (dotted, or path/to/file.py), a colon and the class, "
            "e.g. examples/models.py:TokenTransformer or my_package.models:MyModel."
        )
    path, folder, name = None, os.getcwd(), module_part
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise UsageError(
                f"{label}: the file {module_part!r} does not exist (looked for {path}); give an existing "
                "path/to/file.py or a dotted module."
            )
        folder, name = str(path.parent), path.stem
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - the user's module, or a module it imports, failed
        raise UsageError(
            f"{label}: the module part {module_part!r} cannot be imported ({type(error).__name__}: {error}); "
            f"modules are looked up on sys.path and in the current directory {os.getcwd()}."
        ) from None
    if path is not None and Path(getattr(module, "__file__", None) or "").resolve() != path:
        raise UsageError(f"{label}: another module named {name!r} is imported already ({module}); rename the file.")
    cls = getattr(module, class_part, None)
    if isinstance(cls, type) and issubclass(cls, base):
        return cls
    classes = sorted(
        key
        for key, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, base) and value.__module__ == module.__name__
    )
    if cls is None:
        close = difflib.get_close_matches(class_part, classes, 1)
        problem = f"the module {module_part!r} has no attribute {class_part!r}"
        problem += f"; did you mean {close[0]!r}?" if close else ""
    elif isinstance(cls, type):
        problem = f"{class_part!r} is not a {base_name} class"
    else:
        problem = f"{class_part!r} is a {type(cls).__name__}, not a {base_name} class"
    raise UsageError(f"{label}: {problem}; the module's {base_name} classes: {', '.join(classes) or 'none'}.")


def _instantiate(cls: type, text: str, flag: str, key: str) -> Any:
    """``cls`` built from ``flag``'s ``text`` as LightningCLI builds its ``key`` group: jsonargparse checks the
    typed arguments against ``__init__`` and builds those given as ``class_path``; untyped arguments and
    ``**kwargs`` pass as given. Errors name ``flag``, the value and the signature."""
    from lightning.pytorch.cli import LightningArgumentParser

    label, signature = f"`{flag}`={text!r}", _signature(cls)
    shown = f"{cls.__name__}{signature or '(...)'}"
    given = _init_args(text, label, shown)
    parameters = signature.parameters if signature is not None else {}
    by_name = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [name for name in given if name not in by_name]
    if signature is not None and unknown and all(p.kind is not p.VAR_KEYWORD for p in parameters.values()):
        close = difflib.get_close_matches(unknown[0], by_name, 1)
        raise UsageError(
            f"{label}: unexpected keyword argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
            f"(unknown key{f'; did you mean {close[0]!r}?' if close else ''}); the signature is {shown}."
        )
    untyped = {name for name, parameter in parameters.items() if parameter.annotation is parameter.empty}
    typed = {name: value for name, value in given.items() if name in by_name and name not in untyped}
    parser = LightningArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, key, skip=untyped, instantiate=False, fail_untyped=False, sub_configs=True)
    except Exception:  # noqa: BLE001 - a signature jsonargparse cannot read: the constructor checks its arguments
        typed = {}
    else:
        try:
            config = parser.parse_object({key: typed}, defaults=False)
            built = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(config)  # 4.49 renamed it
        except Exception as error:  # noqa: BLE001 - jsonargparse's checks, or a class given as class_path raised
            reason = " ".join(str(error).split())
            if not isinstance(error, argparse.ArgumentError):
                reason = f"building the classes given as class_path raised {type(error).__name__}: {reason}"
            raise UsageError(f"{label}: {reason}; the signature is {shown}.") from None
        typed = {name: built[key][name] for name in typed}
    try:
        return cls(**{**given, **typed})
    except Exception as error:  # noqa: BLE001 - the class's own checks of its arguments
        raise UsageError(
            f"{label}: {cls.__name__}(...) raised {type(error).__name__}: {error}; the signature is {shown}."
        ) from None


def _init_args(text: str, label: str, signature: str) -> dict[str, Any]:
    """The keyword arguments in ``text``: a JSON or YAML mapping, or a .yaml/.json file of one (empty: none)."""
    from jsonargparse import get_loader

    works = (
        "give a mapping of keyword arguments as JSON or YAML, e.g. '{\"width\": 256}' or 'width: 256', or a "
        f".yaml/.json file of one; the signature is {signature}."
    )
    path = Path(text.strip()).expanduser()
    if "\n" not in text.strip() and path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise UsageError(
                f"{label}: the file {text.strip()!r} does not exist (looked for {path.resolve()}); {works}"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{label}: the file cannot be read ({error}); {works}") from None
    try:
        value = get_loader("yaml")(text) if text.strip() else None
    except Exception as error:  # noqa: BLE001 - the YAML parser's errors
        raise UsageError(f"{label} is not JSON or YAML ({' '.join(str(error).split())}); {works}") from None
    if value is not None and not (isinstance(value, dict) and all(isinstance(name, str) for name in value)):
        raise UsageError(f"{label} is a {type(value).__name__} ({value!r:.200}), not a mapping of names; {works}")
    return value or {}


def _signature(cls: type) -> inspect.Signature | None:
    """``cls``'s call signature, its annotations evaluated where they can be; ``None`` without one."""
    for eval_str in (True, False):
        try:
            return inspect.signature(cls, eval_str=eval_str).replace(return_annotation=inspect.Signature.empty)
        except Exception:  # noqa: BLE001 - an annotation's NameError, or no signature: the next way
            continue
    return None


def _datamodule(args: argparse.Namespace) -> Any:
    """The ``--datamodule`` instance (``None`` without one)."""
    from lightning.pytorch import LightningDataModule

    if args.datamodule is not None:
        cls = _import_class(
            args.datamodule, "--datamodule", LightningDataModule, "lightning.pytorch.LightningDataModule"
        )
        return _instantiate(cls, args.datamodule_init_args, "--datamodule-init-args", "data")
    if args.datamodule_init_args.strip() not in ("", "{}"):
        raise UsageError(
            f"`--datamodule-init-args`={args.datamodule_init_args!r} without --datamodule: name the class too, "
            "e.g. --datamodule my_package.data:MyData."
        )
    return None


def _attach_trainer(module: Any, datamodule: Any, args: argparse.Namespace, setup: EstimateSetup) -> Any:
    """A CPU Trainer attached to a LightningModule and the datamodule as ``Trainer.fit`` attaches it, so that
    ``configure_optimizers()`` and ``train_dataloader()`` can read ``self.trainer``; ``None`` for a plain
    ``torch.nn.Module``. Nothing is trained."""
    import logging

    from lightning.pytorch import LightningModule, Trainer

    from lightning_gpuopt.callbacks import _lightning_compat as compat

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
    compat.attach_data(trainer, module, datamodule=datamodule)
    trainer.strategy.connect(module)
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup(stage="fit")
    return trainer


def _batch_size_of(batch: Any) -> int | None:
    """The batch size as Lightning finds it (``extract_batch_size``); ``None`` without a tensor."""
    import warnings

    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Trying to infer the batch_size from an ambiguous collection"
            return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - no tensor with a dimension in it
        return None


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
    return module.train()


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
    """Random tensors of the ``--input-size`` shapes and ``--dtype`` (the module's under bf16-true)."""
    import torch

    tensors = []
    for text in args.input_size:
        sizes = [int(size) for size in re.findall(r"\d+", text)]
        if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", text) or min(sizes) < 1:
            raise UsageError(
                f"`--input-size`={text!r} is not a list of positive integers; give one sample's shape "
                "without the batch dimension, e.g. --input-size 3,224,224."
            )
        shape = (args.batch_size or DEFAULT_BATCH_SIZE, *sizes)
        if args.dtype == "long":
            tensors.append(torch.randint(0, _vocab(module, args.vocab), shape, device=device))
        else:
            dtype = torch.bfloat16 if args.precision == "bf16-true" else getattr(torch, args.dtype)
            tensors.append(torch.randn(shape, device=device).to(dtype))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _vocab(module: Any, vocab: int | None) -> int:
    import torch

    embeddings = [sub.num_embeddings for sub in module.modules() if isinstance(sub, torch.nn.Embedding)]
    if vocab is None and not embeddings:
        raise UsageError(
            "`--dtype`='long' needs the range of the token ids and the model has no nn.Embedding; "
            "give it with --vocab N, e.g. --vocab 32000."
        )
    return int(embeddings[0] if vocab is None else vocab)


def _loader_batch(
    module: Any, batch_size: int | None, device: torch.device, setup: EstimateSetup, datamodule: Any = None
) -> tuple | None:
    """A batch from the datamodule's or the LightningModule's ``train_dataloader()`` (the Trainer attached),
    with ``training_step`` as the loss; ``None`` without one."""
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
    """``batch`` with each tensor of the batch's leading dimension repeated or cut to ``batch_size`` rows."""
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
        inputs = forward_of(batch)
        if isinstance(inputs, dict):
            output = module(**inputs)
        else:
            output = module(*inputs) if isinstance(inputs, (list, tuple)) else module(inputs)
        leaves = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        if not leaves:
            raise TypeError("forward returned no floating-point tensor to take a stand-in loss of")
        return cast(torch.Tensor, sum(leaf.float().mean() for leaf in leaves))  # leaves is not empty: no 0

    return loss_of


# -- the optimizer and the memory


def _optimizer(module: Any, choice: str, setup: EstimateSetup) -> Any:
    """``--optimizer``'s optimizer; for ``auto``, a LightningModule's ``configure_optimizers()`` as
    ``Trainer.fit`` builds it (any return form, the Trainer attached), else Adam. ``None``: none."""
    import torch
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_gpuopt.callbacks import _lightning_compat as compat

    if choice == "auto" and isinstance(module, LightningModule) and is_overridden("configure_optimizers", module):
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
            return None
        setup.optimizer = f"{', '.join(type(o).__name__ for o in optimizers)} (configure_optimizers())"
        if len(optimizers) == 1:
            return optimizers[0]
        setup.notes.append(  # Lightning allows several only with manual optimization
            f"configure_optimizers() returned {len(optimizers)} optimizers: the training_step steps each of them"
        )
        return optimizers
    if choice == "auto":
        setup.notes.append("the model defines no configure_optimizers(): estimating with Adam")
        choice = "adam"
    setup.optimizer = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD (momentum 0.9)", "none": "none"}[choice]
    params = [p for p in module.parameters() if p.requires_grad]
    if choice == "none" or not params:
        return None
    if choice == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return (torch.optim.AdamW if choice == "adamw" else torch.optim.Adam)(params, lr=1e-3)


def _capacity(max_memory: str | None, device: torch.device, module: Any, setup: EstimateSetup) -> int:
    """The bytes to fit: ``--max-memory`` (``0.9``: a fraction of the device), else what the device can give."""
    from lightning_gpuopt.core.memory import device_usable_memory, parse_memory

    if max_memory is None:
        setup.memory_source = f"what {device} can give a training step now (free + held by torch)"
        return device_usable_memory(device, existing=[module])
    text = max_memory.strip()
    value = int(text) if text.isdigit() else float(text) if re.fullmatch(r"\d*\.\d+", text) else max_memory
    try:
        capacity = parse_memory(value, device, name="--max-memory")
    except ValueError as error:
        raise UsageError(str(error)) from None
    setup.memory_source = f"--max-memory {max_memory}"
    return capacity


def refined_near_capacity(estimate: Any, module: Any, loss_fn: Any, batch: Any, trace: dict) -> Any:
    """The estimate with its line re-traced near the largest batch, as ``BatchSizeSearch`` does
    (:func:`~lightning_gpuopt.core.estimate.refine_near_capacity`). The peak at the batch size
    itself stays the exact trace."""
    from lightning_gpuopt.core.estimate import refine_near_capacity, trace_training_step

    first = estimate.max_batch_size
    if estimate.method != "traced" or not trace["batch_size"] or not first or first <= 2 * trace["batch_size"]:
        return estimate
    refined = refine_near_capacity(
        lambda size: trace_training_step(module, loss_fn, batch, trace_batch_size=size, **trace),
        first,
        estimate.capacity_bytes,
        estimate.untraced_bytes,
    )
    if refined.fixed_bytes is None:
        return estimate
    note = (
        f"the line was re-traced near the limit (the line through batch sizes {trace['batch_size']} and "
        f"{2 * trace['batch_size']} gave {first:,})"
        if refined.max_batch_size != first
        else ""
    )
    return dataclasses.replace(
        estimate,
        fixed_bytes=refined.fixed_bytes,
        bytes_per_sample=refined.bytes_per_sample,
        max_batch_size=refined.max_batch_size,
        trace_seconds=(estimate.trace_seconds or 0.0) + refined.seconds,
        notes=[*estimate.notes, note] if note else estimate.notes,
    )


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
