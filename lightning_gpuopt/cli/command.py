"""The ``gpuopt`` console command: ``doctor``, ``presets``, ``estimate``, ``plot`` (``gpuopt COMMAND --help``).

Tables on stdout, or one JSON document with ``--json``. Exit status: 0, 2 on bad usage, 1 when ``doctor`` finds a
"fail" or ``plot`` draws nothing. Only the standard library is imported at the top, for a quick ``gpuopt --help``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

ESTIMATE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
ESTIMATE_OPTIMIZERS = ("auto", "adam", "adamw", "sgd", "none")
#: the batch size of ``--input-size`` and ``example_input_array`` batches without ``--batch-size``
DEFAULT_BATCH_SIZE = 8
_STATUS_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}
_INIT_ARGS_HELP = "the class's keyword arguments: JSON or YAML text, or a .yaml/.json file; a class-typed one takes {class_path: ..., init_args: {...}}; e.g. 'width: 256'"
_INPUT_SIZE_HELP = "a sample's shape without the batch dimension, e.g. 3,224,224 (once per input of forward): random inputs and a stand-in loss, the mean of the output"


class UsageError(Exception):
    """Bad command-line input (exit status 2): the message names the argument, the value and what works."""


def main(argv: list[str] | None = None) -> int:
    """Run ``gpuopt`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: 2 on bad usage, 0 for --help
        return int(exit_.code or 0)
    try:
        return int(args.handler(args))
    except UsageError as error:
        sys.stderr.write(f"gpuopt {args.command}: error: {error}\n")
        return 2


def _build_parser() -> argparse.ArgumentParser:
    from lightning_gpuopt import __version__

    about = "Check a machine for GPU training, show presets, estimate a model's memory."
    parser = argparse.ArgumentParser(prog="gpuopt", description=about)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{doctor,presets,estimate,plot}")
    sub = {}
    for name, handler, summary in (
        ("doctor", _run_doctor, "environment checks, each with a status and a fix"),
        ("presets", _run_presets, "list the presets, or show one's settings"),
        ("estimate", _run_estimate, "a model's training-step memory and the largest batch that fits"),
        ("plot", _run_plot, "draw a gpuopt_report.json as PNGs (needs the [plot] extra)"),
    ):
        description = " ".join((handler.__doc__ or "").split())  # the handler's docstring
        sub[name] = commands.add_parser(name, parents=[common], help=summary, description=description)
        sub[name].set_defaults(handler=handler)
    timing = sub["doctor"].add_mutually_exclusive_group()
    timing.add_argument("--quick", action="store_true", help="a 0.3 s matmul benchmark instead of 2 s")
    timing.add_argument("--matmul-seconds", type=float, default=2.0, metavar="S", help="default 2; 0 skips it")
    sub["presets"].add_argument("name", nargs="?", metavar="NAME", help="a preset name or a YAML file")
    sub["plot"].add_argument("report", metavar="REPORT", help="a gpuopt_report.json: a path or any fsspec URL")
    sub["plot"].add_argument("--out", metavar="DIR", help="where the PNGs go (default: beside REPORT)")
    estimate, cls = sub["estimate"].add_argument, "MODULE:CLASS"
    estimate("target", metavar=cls, help="dotted.module:Class or path/to/file.py:Class")
    estimate("--init-args", default="{}", metavar="ARGS", help=_INIT_ARGS_HELP)
    estimate("--datamodule", metavar=cls, help="a LightningDataModule whose train_dataloader() gives the batch")
    estimate("--datamodule-init-args", default="{}", metavar="ARGS", help="its keyword arguments, as --init-args")
    estimate("--input-size", action="append", metavar="D1,D2,...", help=_INPUT_SIZE_HELP)
    estimate("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "long"), help="of --input-size")
    estimate("--vocab", type=int, metavar="N", help="--dtype long: ids in [0, N) (default: the first nn.Embedding's)")
    estimate("--batch-size", type=int, metavar="N", help=f"default: the dataloader's, else {DEFAULT_BATCH_SIZE}")
    auto = "auto: the model's configure_optimizers() (a Trainer attached), else adam; sgd: momentum 0.9"
    estimate("--optimizer", default="auto", choices=ESTIMATE_OPTIMIZERS, help=auto)
    estimate("--precision", default="32-true", choices=ESTIMATE_PRECISIONS, help="16-mixed only on CUDA")
    memory = 'the memory to fit: bytes, "20GiB" or a fraction of the device (0.9); default: what it can give now'
    estimate("--max-memory", metavar="MEMORY", help=memory)
    estimate("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    return parser


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 120)), highlight=False)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _print_table(title: str, columns: list[str], rows: list[list[Any]], above: str = "", below: Any = None) -> None:
    from rich.table import Column, Table

    table = Table(*(Column(c, overflow="fold") for c in columns), title=title, title_justify="left", show_lines=False)
    for row in rows:
        table.add_row(*row)
    console = _console()
    if above:
        console.print(above, markup=False)
    console.print(table)
    if below is not None:
        console.print(below)


def _run_doctor(args: argparse.Namespace) -> int:
    """Check torch/CUDA vs the driver and GPU, the GPUs and who else uses them, matmul speed, CPU cores and
    threads, BLAS, pinned memory and /dev/shm (lightning_gpuopt.core.doctor). Exit status 1 on a 'fail'."""
    from rich.text import Text

    from lightning_gpuopt.core.doctor import CHECKS, STATUSES, run_check

    if args.matmul_seconds < 0:
        raise UsageError(f"`--matmul-seconds`={args.matmul_seconds} is negative; use e.g. 2 (or 0 to skip).")
    seconds = 0.3 if args.quick else args.matmul_seconds  # the benchmark's
    checks = [run_check(name, seconds) if name == "matmul" else run_check(name) for name in CHECKS]
    status = max((check.status for check in checks), key=STATUSES.index)  # the worst
    if args.json:
        _print_json({"status": status, "checks": [dataclasses.asdict(check) for check in checks]})
        return 1 if status == "fail" else 0
    rows = []
    for check in checks:
        finding = Text(check.value).append(f"\n→ {check.fix}" if check.fix else "", style="italic")
        rows.append([Text(check.status.upper(), style=_STATUS_STYLE[check.status]), Text(check.name), finding])
    counts = ", ".join(f"{sum(c.status == s for c in checks)} {s}" for s in ("ok", "info", "warn", "fail"))
    summary = Text(f"{len(checks)} checks: {counts}; overall {status.upper()}", style=_STATUS_STYLE[status])
    _print_table("gpuopt doctor", ["status", "check", "finding  (→ fix)"], rows, below=summary)
    return 1 if status == "fail" else 0


def _run_presets(args: argparse.Namespace) -> int:
    """Without NAME: the shipped presets and what each does. With NAME (or a YAML file): its settings,
    `preset:` extensions resolved, and what each key means."""
    from rich.text import Text

    from lightning_gpuopt.presets import PRESET_KEYS, available_presets, load_preset, preset_description, preset_path

    if args.name is None:
        presets = available_presets()
        listing = [{"name": n, "description": preset_description(n), "path": str(preset_path(n))} for n in presets]
        if args.json:
            _print_json({"presets": listing})
        else:
            names = [[item["name"], item["description"]] for item in listing]
            _print_table("gpuopt presets  (gpuopt presets NAME shows one)", ["preset", "what it does"], names)
        return 0
    try:
        settings, description = load_preset(args.name), preset_description(args.name)
    except ValueError as error:
        raise UsageError(f"`NAME`={args.name!r}: {error}") from None
    meanings = {key: PRESET_KEYS[key] for key in settings}
    if args.json:
        shown = {"name": args.name, "path": str(preset_path(args.name)), "description": description}
        _print_json({**shown, "settings": settings, "meanings": meanings})
    else:
        rows = [[Text(key), Text(json.dumps(value)), Text(meanings[key])] for key, value in settings.items()]
        _print_table(f"gpuopt preset {args.name}", ["key", "value", "meaning"], rows, above=description)
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    """Draw the report's step times, memory vs batch size and loader timings as PNGs and print their paths
    (REPORT and --out may be fsspec URLs). Exit status 1 when nothing could be drawn."""
    from lightning_gpuopt.core.plot import PLOT_NAMES, PlotUnavailableError, save_plots
    from lightning_gpuopt.core.report import REPORT_VERSION
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
        why = f"is not a readable JSON report ({error}); expected the gpuopt_report.json in the trainer's log dir, e.g. lightning_logs/version_0/gpuopt_report.json"
        raise UsageError(f"`REPORT`={args.report!r} {why}") from None
    if not isinstance(data, dict):
        raise UsageError(f"`REPORT`={args.report!r} holds {type(data).__name__}, not a gpuopt report's JSON object")
    if data and data.get("report_version", 1) != REPORT_VERSION:  # 0.1.0's reports have no `report_version`
        found = f"a version-{data.get('report_version', 1)} report, and this gpuopt reads version {REPORT_VERSION}"
        raise UsageError(f"`REPORT`={args.report!r} is {found}: draw it with the gpuopt that wrote it, or fit again")
    out = as_location(args.out) if args.out is not None else parent_location(report)
    try:
        written = save_plots(data, out)
    except FilesystemUnavailableError as error:
        raise UsageError(f"`--out`={str(out)!r}: {error}") from None
    except Exception as error:
        no_matplotlib = isinstance(error, PlotUnavailableError)
        if isinstance(out, Path) and not no_matplotlib:  # at a URL, what its filesystem raises is a message
            raise
        why = f"the PNGs could not be written to {out}: {type(error).__name__}: {error}"
        sys.stderr.write(f"gpuopt plot: error: {error if no_matplotlib else why}\n")
        return 1
    if args.json:
        _print_json({"written": [str(path) for path in written]})
    else:
        sys.stdout.writelines(f"{path}\n" for path in written)
    if not written:
        sections = f"data_wait, batch_size_search, dataloader with figures (plots: {', '.join(PLOT_NAMES)})"
        sys.stderr.write(f"gpuopt plot: nothing to draw: {args.report} has none of the sections {sections}\n")
    return 0 if written else 1


def _run_estimate(args: argparse.Namespace) -> int:
    """Build MODULE:CLASS, trace one training step on fake tensors (nothing is trained or allocated) and report
    the memory by part, the peak at --batch-size and the largest batch that fits --max-memory. The batch: from
    --input-size, else --datamodule's or the model's train_dataloader(), else example_input_array. A
    LightningModule gets a CPU Trainer attached, for configure_optimizers() and train_dataloader()."""
    from lightning_gpuopt.cli._estimate_inputs import estimate_of
    from lightning_gpuopt.core.report import format_bytes, format_seconds, render_table, to_dict

    estimate, setup = estimate_of(args)
    if args.json:
        setup_figures = {key: value for key, value in dataclasses.asdict(setup).items() if key != "notes"}
        _print_json({**to_dict(estimate), "setup": setup_figures})  # notes: in the estimate's
        return 0
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
    table = render_table("gpuopt estimate", rows, notes=[f"  • {note}" for note in estimate.notes])
    _console().print(table, markup=False, highlight=False)
    return 0
