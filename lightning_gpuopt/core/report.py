"""Report plumbing shared by every callback: results to JSON and back, ``gpuopt_report.json``'s sections, text tables.

Memory is named alike in every table, in MiB: the **memory limit** is ``max_memory`` (without one, a CUDA card's free
memory plus what torch holds); the **budget**, what a trial's peak may reach, is the limit less a numeric ``margin``
(with ``"auto"``, none: a size fits only if 1/32 more samples would). A largest batch is *trained* or *predicted*."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import textwrap
import types
import typing
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar, Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from lightning_gpuopt.core.diagnosis import DataWaitReport
    from lightning_gpuopt.core.loader import LoaderTuneResult
    from lightning_gpuopt.core.search import BatchSizeSearchResult

from lightning_gpuopt.core.storage import Location, as_location, filesystem, read_bytes, write_bytes

_T = TypeVar("_T")

REPORT_FILENAME = "gpuopt_report.json"  #: file name of the combined report written into the trainer's log dir
#: the layout of that file, kept in its ``report_version`` key: 1 is 0.1.0's (no key), 2 nests ``data_wait``
REPORT_VERSION = 2
#: why a batch size search stopped, in words, by its ``stop_reason``
STOP_REASONS = {
    "bracketed": "stopped: the next size up did not fit",
    "within tolerance": "stopped: a size within 1/64 above it did not fit",
    "upper bound": "stopped at the upper bound (max_batch_size, or the samples a rank holds): larger were not tried",
    "max trials": "stopped after max_trials",
    "nothing fits": "stopped: not even the smallest size fits",
}


def to_dict(result: Any) -> Any:
    """A dataclass (nested ones, lists, dicts) as JSON-ready data, its class's ``JSON_PROPERTIES`` beside the fields."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        data = {field.name: to_dict(getattr(result, field.name)) for field in dataclasses.fields(result)}
        return data | {name: to_dict(getattr(result, name)) for name in getattr(result, "JSON_PROPERTIES", ())}
    if isinstance(result, (list, tuple)):
        return [to_dict(item) for item in result]
    return {key: to_dict(value) for key, value in result.items()} if isinstance(result, dict) else result


def from_dict(cls: type[_T], data: dict[str, Any]) -> _T:
    """Rebuild dataclass ``cls`` from :func:`to_dict`'s output; unknown keys (a newer version's) are ignored."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.name: _convert(hints[f.name], data[f.name]) for f in fields if f.name in data and f.init})


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return _convert(next(arg for arg in args if arg is not type(None)), value)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(typing.cast(type, hint), value)  # a dataclass hint is a class
    if origin in (list, Sequence) and args:
        return [_convert(args[0], item) for item in value]
    if origin is tuple and args:
        return tuple(_convert(arg, item) for arg, item in zip(args, value))
    if origin is dict and len(args) == 2:
        return {key: _convert(args[1], item) for key, item in value.items()}
    return value


def _create_sibling(path: Path) -> tuple[int, Path]:
    """A temporary file beside ``path``, open for writing, mode ``0o666`` less the umask as ``open()`` gives."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def update_json_section(
    path: str | os.PathLike, section: str, data: dict[str, Any], warn: Callable[[str], None] | None = None
) -> Location:
    """Set ``section`` of the JSON object at ``path`` (local or an fsspec URL) to ``data``, keeping the others; returns
    where. A local file is replaced atomically (mode ``0o666`` less the umask); a file that is no JSON object is renamed
    ``<name>.corrupt-<n>`` and ``warn`` (default :func:`warnings.warn`) says so. ``OSError``: it cannot be written."""
    location = as_location(path)
    content = _existing_sections(location, warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3)))
    content |= {section: data, "report_version": REPORT_VERSION}
    text = json.dumps(content, indent=2, default=str) + "\n"
    if not isinstance(location, Path):
        return write_bytes(location, text.encode())
    location.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_sibling(location)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, location)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return location


def _existing_sections(location: Location, warn: Callable[[str], None]) -> dict[str, Any]:
    """The sections already in the report; a file that is no JSON object is set aside, with a warning."""
    try:
        raw = read_bytes(location)
    except FileNotFoundError:
        return {}
    try:
        content = json.loads(raw)
        problem = None if isinstance(content, dict) else f"it holds a JSON {type(content).__name__}, not an object"
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = f"it is not valid JSON ({error})"
    if problem is None:
        return content
    fs, path = (None, str(location)) if isinstance(location, Path) else filesystem(location)
    exists, move = (os.path.exists, os.replace) if fs is None else (fs.exists, fs.mv)
    number = 1
    while exists(f"{path}.corrupt-{number}"):
        number += 1
    move(path, f"{path}.corrupt-{number}")
    kept = f"It was kept as {location}.corrupt-{number}; the new report starts empty."
    warn(f"gpuopt: the existing report {location} could not be read: {problem}. {kept}")
    return {}


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON report (a local path or a URL)."""
    return json.loads(read_bytes(as_location(path)))


def render_table(title: str, rows: Iterable[tuple[str, str]], notes: Sequence[str] = (), width: int = 100) -> str:
    """Render ``(name, value)`` rows and trailing notes as a rich table, returned as plain text."""
    table = Table(title=title, show_header=False, title_justify="left", expand=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    for name, value in rows:
        table.add_row(Text(name), Text(value))  # plain text: brackets in figures are not rich markup
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    console.print(table)
    text = console.file.getvalue().rstrip()  # type: ignore[attr-defined]
    return "\n".join([text, *(textwrap.fill(note, width, subsequent_indent="    ") for note in notes)])


def format_seconds(seconds: float | None) -> str:
    """``0.0123`` -> ``'12.3 ms'``; ``None`` -> ``'n/a'``."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms" if seconds < 1.0 else f"{seconds:.2f} s"


def format_fraction(fraction: float | None) -> str:
    """``0.623`` -> ``'62.3%'``; ``None`` -> ``'n/a'``."""
    return "n/a" if fraction is None else f"{fraction * 100:.1f}%"


def format_bytes(num_bytes: float | None, decimal: bool = False) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'n/a'``; ``decimal``: ``40e6`` -> ``'38.1 MiB (40 MB)'``."""
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    text = f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
    return f"{text} ({num_bytes / 1e6:,.6g} MB)" if decimal else text


def data_wait_table(report: DataWaitReport) -> str:
    """The ``DataWaitMonitor`` report as a text table, its recommendations and findings below."""
    totals = report.totals

    def share_row(name: str, seconds: float) -> tuple[str, str]:
        per_step = format_seconds(totals.per_step(seconds))
        return name, f"{format_fraction(totals.share(seconds)):>6} of the step  ({per_step}/step)"

    samples = f"  ({totals.samples_per_second:,.0f} samples/s)" if totals.samples_per_second else ""
    measured = f"{totals.steps} steps after {report.warmup_steps} warm-up, {report.settings.epochs} epoch(s),"
    rows = [
        ("verdict", f"{report.verdict.upper()}: {report.verdict_reason}"),
        ("measured", f"{measured} {report.world_size} rank(s), {report.device}"),
        ("step time", format_seconds(totals.step_time_s if totals.steps else None) + samples),
        share_row("data wait", totals.data_wait_s),
    ]
    if totals.loader_cpu_fraction is not None:
        rows.append(("main thread busy while waiting", format_fraction(totals.loader_cpu_fraction)))
    rows += [
        share_row("batch transfer", totals.transfer_s),
        share_row("compute", totals.compute_s),
        share_row("other (hooks, logging)", totals.other_s),
        ("GPU idle", format_fraction(totals.gpu_idle_fraction)),
        ("GPU utilisation (NVML)", "n/a" if totals.gpu_util_mean is None else f"{totals.gpu_util_mean:.0f}%"),
    ]
    apart = {"validation (apart)": totals.validation_s, "checkpoint saving (apart)": totals.checkpoint_s}
    for name, seconds in apart.items():
        if seconds:
            share = format_fraction(totals.training_share(seconds))
            rows.append((name, f"{format_seconds(seconds)}  ({share} of training time)"))
    if totals.worker_startup_s:
        rows.append(("loader start-up at epoch starts", format_seconds(totals.worker_startup_s)))
    for name, (low, mean, high) in report.rank_spread.items():
        shown = format_seconds if name.endswith("_s") else (lambda value: f"{value:,.1f}")
        label = f"ranks: {name.removesuffix('_s').replace('_', ' ')}"
        rows.append((label, f"min {shown(low)} · mean {shown(mean)} · max {shown(high)}"))
    if report.world_size > 1:
        straggler = report.diagnosis.straggler_rank
        rows.append(("straggler", "none" if straggler is None else f"rank {straggler}"))
    for gpu in report.gpus:
        util = "n/a" if gpu.util_mean is None else f"{gpu.util_mean:.0f}% mean, {gpu.util_max:.0f}% max"
        flag = "  IDLE" if gpu.index in report.diagnosis.idle_gpus else ("" if gpu.visible else "  (not visible)")
        memory = f"{format_bytes(gpu.memory_used_max_bytes)} / {format_bytes(gpu.memory_total_bytes)}"
        rows.append((f"GPU {gpu.index} {gpu.name}", f"{util}; memory {memory}{flag}"))
    notes = [f"  • {advice}" for advice in report.recommendations] or ["  • nothing to change in the input pipeline"]
    if report.findings:
        notes.append(f"Slow patterns found ({len(report.findings)}):")
        for finding in report.findings:
            where = f" [{finding.where}]" if finding.where else ""
            notes += [f"  • {finding.kind}{where}: {finding.message}", f"      fix: {finding.fix}"]
    return render_table("gpuopt · DataWaitMonitor", rows, ["Recommendations:", *notes])


def loader_summary(result: LoaderTuneResult) -> str:
    """What the tuner did, in one line: kept the user's setting, or changed it and by how much; and why."""
    if (base := result.baseline) is not None and result.setting == base.setting:
        return f"kept your setting {base.setting.describe()} ({result.reason})"
    speedup = "" if result.speedup is None else f": {result.speedup:.2f}x the samples/s of your setting"
    return f"{base.setting.describe() + ' → ' if base else ''}{result.setting.describe()}{speedup} ({result.reason})"


def loader_tune_table(result: LoaderTuneResult, message: str = "") -> str:
    """The ``DataLoaderTuner`` result: a row per setting, the chosen one marked; ``message`` (or the summary) below."""
    rows = []
    for timing in result.candidates:
        on = (timing.setting == result.setting, result.baseline is timing, timing.stopped_early)
        marks = [mark for mark, shown in zip(("CHOSEN", "yours", "stopped early"), on) if shown]
        cpu = "" if timing.worker_cpu_fraction is None else f", workers {timing.worker_cpu_fraction:.0%} CPU"
        figures = f"{timing.samples_per_second:>10,.0f} samples/s, start-up {format_seconds(timing.startup_s)}{cpu}"
        rows.append((timing.setting.short(), figures + (f"  [{', '.join(marks)}]" if marks else "")))
    title = f"gpuopt · DataLoaderTuner · {len(rows)} settings, each at its fastest"
    return render_table(title, rows, [f"  {message or loader_summary(result)}"])


def batch_search_table(result: BatchSizeSearchResult, applied: bool = True) -> str:
    """The ``BatchSizeSearch`` result, a row per trial in order; ``applied``: its size was set (else MemoryFill's)."""
    predicted = "no estimate" if result.predicted_batch_size is None else f"{result.predicted_batch_size} (estimate)"
    search = f"{len(result.trials)} trial(s), {result.steps} steps in {format_seconds(result.seconds)}"
    kept = "the memory limit less margin" if result.budget_bytes < (result.limit_bytes or 0) else "the memory limit"
    trained = max((trial.batch_size for trial in result.trials if trial.fits), default=None)
    rows = [
        *([("batch size", f"{result.initial_batch_size} → {result.batch_size}")] if applied else []),
        ("largest batch: predicted / trained", f"{predicted} / {trained} (trials)"),
        ("memory limit", f"{format_bytes(result.limit_bytes, decimal=True)} per rank, {result.world_size} rank(s)"),
        ("budget", f"{format_bytes(result.budget_bytes)} ({kept})"),
        ("search", f"{search}; {STOP_REASONS.get(result.stop_reason, result.stop_reason)}"),
    ]
    for number, trial in enumerate(result.trials, 1):
        mark = "  [CHOSEN]" if trial.fits and trial.batch_size == result.batch_size else ""
        outcome = "fits" if trial.fits else "does not fit"
        figures = f"peak {format_bytes(trial.peak_bytes)}, {format_seconds(trial.seconds)}"
        rows.append((f"trial {number}: {trial.batch_size}", f"{outcome:>12}, {figures}{mark}"))
    title = "gpuopt · BatchSizeSearch" + ("" if applied else " (MemoryFill's last search)")
    return render_table(title, rows, [f"  {note}" for note in result.notes])
