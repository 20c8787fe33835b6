"""Report plumbing shared by every callback: dataclasses to JSON and back, and to a terminal table.

Results are plain dataclasses (``DataWaitReport``, ...). This module turns them into

* JSON, written atomically (a temporary file renamed into place, so a crash never leaves a
  half-written report; an existing unreadable report is kept aside, never dropped), and read back into the same dataclass (:func:`from_dict`);
  a report's path may also be a URL of any fsspec filesystem (``s3://``, ``memory://``; see
  :mod:`lightning_gpuopt.core.storage`), written in one call;
* text tables rendered with ``rich`` into a string, which the callbacks hand to
  ``rank_zero_info`` (library code never prints).

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Point:
    ...     x: float
    ...     y: float = 0.0
    >>> from_dict(Point, to_dict(Point(1.5)))
    Point(x=1.5, y=0.0)
"""

from __future__ import annotations

import dataclasses
import errno
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

from lightning_gpuopt.core.findings import finding_lines
from lightning_gpuopt.core.storage import Location, as_location, filesystem, read_bytes, write_bytes

T = TypeVar("T")

#: file name of the combined report written into the trainer's log dir
REPORT_FILENAME = "gpuopt_report.json"


def to_dict(result: Any) -> dict[str, Any]:
    """A dataclass (nested dataclasses and lists included) as a JSON-ready dict."""
    return dataclasses.asdict(result)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild dataclass ``cls`` from :func:`to_dict`'s output, nested dataclasses included.

    Unknown keys are ignored so that a report written by a newer version still loads.
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data and field.init:
            kwargs[field.name] = _convert(hints[field.name], data[field.name])
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                return _convert(arg, value)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(typing.cast(type, hint), value)  # a dataclass hint is a class
    if origin in (list, Sequence) and args:
        return [_convert(args[0], item) for item in value]
    if origin is tuple and args:
        return tuple(_convert(arg, item) for arg, item in zip(args, value))
    if origin is dict and len(args) == 2:
        return {key: _convert(args[1], item) for key, item in value.items()}
    return value


def write_json(data: dict[str, Any], path: str | os.PathLike) -> Location:
    """Write ``data`` as indented JSON to ``path`` atomically; returns the path (a URL stays a ``str``).

    A local file gets the mode any file the user writes gets (``0o666`` less the umask, e.g. ``0o644``),
    not the ``0o600`` of a private temporary file. A URL (``s3://...``, ``memory://...``) is written
    through fsspec in one call (see :mod:`lightning_gpuopt.core.storage`). Raises ``OSError`` when it
    cannot be written (a read-only directory, a full disk), :class:`~lightning_gpuopt.core.storage.FilesystemUnavailableError` when the
    URL's filesystem package is not installed: the callbacks turn both into a warning (see
    :func:`update_json_section`).
    """
    location = as_location(path)
    if not isinstance(location, Path):
        return write_bytes(location, _json_text(data).encode())
    path = location
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_sibling(path)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(_json_text(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_text(data: dict[str, Any]) -> str:
    """The report's text: indented JSON, keys in their order, what JSON cannot hold as ``str()``."""
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def _create_sibling(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path``, opened for writing, with the umask-respecting mode."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:  # os.open applies the umask to 0o666, as open() does; mkstemp would give 0o600
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))


def update_json_section(
    path: str | os.PathLike, section: str, data: dict[str, Any], warn: Callable[[str], None] | None = None
) -> Location:
    """Set ``section`` of the JSON object in ``path`` to ``data``, keeping other sections.

    Several callbacks share one ``gpuopt_report.json``; each owns one top-level key. An existing
    file that is not a JSON object (a crash of another tool, a hand edit) is never dropped in
    silence: it is renamed to ``<name>.corrupt-<n>`` and ``warn`` (default :func:`warnings.warn`)
    says so; the new file then holds only ``section``. ``path`` may be a URL of any fsspec
    filesystem (``s3://bucket/run/gpuopt_report.json``); it is then returned as that URL. Raises
    ``OSError`` when the file cannot be written, :class:`~lightning_gpuopt.core.storage.FilesystemUnavailableError` when the URL's
    filesystem package is not installed.

    Example::

        >>> import tempfile
        >>> report = Path(tempfile.mkdtemp()) / "gpuopt_report.json"
        >>> _ = update_json_section(report, "a", {"x": 1})
        >>> _ = update_json_section(report, "b", {"y": 2})
        >>> read_json(report)
        {'a': {'x': 1}, 'b': {'y': 2}}
    """
    location = as_location(path)
    content: dict[str, Any] = {}
    if not isinstance(location, Path):
        content = _existing_remote_sections(location, warn or _warn)
    elif location.exists():
        content = _existing_sections(location, warn or _warn)
    content[section] = data
    return write_json(content, location)


def _existing_sections(path: Path, warn: Callable[[str], None]) -> dict[str, Any]:
    """The sections already in ``path``; a file that is no JSON object is set aside, with a warning."""
    content, problem = _parse_sections(path.read_bytes())
    if problem is None:
        return content
    aside = Path(_free_name(str(path), "corrupt", os.path.exists))
    os.replace(path, aside)
    _warn_set_aside(warn, path, aside, problem)
    return {}


def _existing_remote_sections(url: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """:func:`_existing_sections` of a URL, through fsspec (no report yet: no sections)."""
    fs, path = filesystem(url)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return {}
    content, problem = _parse_sections(raw)
    if problem is None:
        return content
    aside = _free_name(path, "corrupt", fs.exists)
    fs.mv(path, aside)
    _warn_set_aside(warn, url, url + aside.removeprefix(path), problem)  # the URL + ".corrupt-<n>"
    return {}


def _parse_sections(raw: bytes) -> tuple[dict[str, Any], str | None]:
    """``(sections, None)`` for a JSON object, ``({}, what is wrong)`` for anything else."""
    try:
        content = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return {}, f"it is not valid JSON ({error})"
    if not isinstance(content, dict):
        return {}, f"it holds a JSON {type(content).__name__}, not an object"
    return content, None


def _warn_set_aside(warn: Callable[[str], None], path: Location, aside: Location, problem: str) -> None:
    warn(
        f"gpuopt: the existing report {path} could not be read: {problem}. It was kept as {aside}; "
        "the new report starts empty."
    )


def _free_name(path: str, tag: str, exists: Callable[[str], bool]) -> str:
    """``<path>.<tag>-<n>`` with the smallest ``n`` >= 1 that names no file (``exists``: the local
    filesystem's or a remote one's)."""
    number = 1
    while exists(f"{path}.{tag}-{number}"):
        number += 1
    return f"{path}.{tag}-{number}"


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON report written by :func:`write_json` (a local path or a URL)."""
    location = as_location(path)
    if not isinstance(location, Path):
        return json.loads(read_bytes(location))
    return json.loads(location.read_text())


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
    wrapped = [textwrap.fill(note, width, subsequent_indent="    ") for note in notes]
    return "\n".join([text, *wrapped])


def format_seconds(seconds: float | None) -> str:
    """``0.0123`` -> ``'12.3 ms'``; ``None`` -> ``'n/a'``."""
    if seconds is None:
        return "n/a"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_fraction(fraction: float | None) -> str:
    """``0.623`` -> ``'62.3%'``; ``None`` -> ``'n/a'``."""
    return "n/a" if fraction is None else f"{fraction * 100:.1f}%"


def format_bytes(num_bytes: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'n/a'``."""
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def data_wait_table(report: DataWaitReport) -> str:
    """The ``DataWaitMonitor`` report as a text table with its recommendations below."""
    per_step = (lambda seconds: seconds / report.steps) if report.steps else (lambda seconds: 0.0)
    rows = [
        ("verdict", f"{report.verdict.upper()}: {report.verdict_reason}"),
        (
            "measured",
            f"{report.steps} steps after {report.warmup_steps} warm-up, {report.epochs} epoch(s),"
            f" {report.world_size} rank(s), {report.device}",
        ),
        (
            "step time",
            f"{format_seconds(report.step_time_s)}"
            + (f"  ({report.samples_per_second:,.0f} samples/s)" if report.samples_per_second else ""),
        ),
    ]
    for name, seconds, fraction in (
        ("data wait", report.data_wait_s, report.data_wait_fraction),
        ("batch transfer", report.transfer_s, report.transfer_fraction),
        ("compute", report.compute_s, report.compute_fraction),
        ("other (hooks, logging)", report.other_s, report.other_fraction),
    ):
        rows.append((name, f"{format_fraction(fraction):>6} of the step  ({format_seconds(per_step(seconds))}/step)"))
    rows.append(("GPU idle", format_fraction(report.gpu_idle_fraction)))
    rows.append(("GPU utilisation (NVML)", "n/a" if report.gpu_util_mean is None else f"{report.gpu_util_mean:.0f}%"))
    for name, seconds, fraction in (
        ("validation (apart)", report.validation_s, report.validation_fraction),
        ("checkpoint saving (apart)", report.checkpoint_s, report.checkpoint_fraction),
    ):
        if seconds:
            rows.append((name, f"{format_seconds(seconds)}  ({format_fraction(fraction)} of training time)"))
    if report.worker_startup_s:
        rows.append(("loader start-up at epoch starts", format_seconds(report.worker_startup_s)))
    for name, spread in report.rank_spread.items():
        rows.append(
            (
                f"ranks: {name.removesuffix('_s').replace('_', ' ')}",
                _spread_text(name, spread.min, spread.mean, spread.max),
            )
        )
    if report.world_size > 1:
        rows.append(("straggler", "none" if report.straggler_rank is None else f"rank {report.straggler_rank}"))
    for gpu in report.gpus:
        util = "n/a" if gpu.util_mean is None else f"{gpu.util_mean:.0f}% mean, {gpu.util_max:.0f}% max"
        flag = "  IDLE" if gpu.index in report.idle_gpus else ("" if gpu.visible else "  (not visible)")
        memory = f"{format_bytes(gpu.memory_used_max_bytes)} / {format_bytes(gpu.memory_total_bytes)}"
        rows.append((f"GPU {gpu.index} {gpu.name}", f"{util}; memory {memory}{flag}"))
    notes = [f"  • {advice}" for advice in report.recommendations] or ["  • nothing to change in the input pipeline"]
    if report.findings:
        notes += [f"Slow patterns found ({len(report.findings)}):", *finding_lines(report.findings)]
    if report.loader_cpu_fraction is not None:
        rows.insert(4, ("main thread busy while waiting", format_fraction(report.loader_cpu_fraction)))
    return render_table("gpuopt · DataWaitMonitor", rows, ["Recommendations:", *notes])


def _spread_text(name: str, low: float, mean: float, high: float) -> str:
    if name.endswith("_s"):
        return f"min {format_seconds(low)} · mean {format_seconds(mean)} · max {format_seconds(high)}"
    return f"min {low:,.1f} · mean {mean:,.1f} · max {high:,.1f}"


def loader_tune_table(result: LoaderTuneResult, message: str) -> str:
    """The ``DataLoaderTuner`` result: one row per timed setting, the chosen one marked."""
    rows = []
    for timing in result.candidates:
        marks = [
            mark
            for mark, on in (
                ("CHOSEN", timing.setting == result.setting),
                ("yours", result.baseline is timing),
                ("stopped early", timing.stopped_early),
            )
            if on
        ]
        cpu = "" if timing.worker_cpu_fraction is None else f", workers {timing.worker_cpu_fraction:.0%} CPU"
        rows.append(
            (
                timing.setting.short(),
                f"{timing.samples_per_second:>10,.0f} samples/s, start-up {format_seconds(timing.startup_s)}{cpu}"
                + (f"  [{', '.join(marks)}]" if marks else ""),
            )
        )
    kept = result.baseline is not None and result.setting == result.baseline.setting
    speedup = f"; {result.speedup:.2f}x your setting" if result.speedup is not None and not kept else ""
    notes = [f"  {message}{speedup}" if message else f"  {loader_tune_summary(result)}"]
    return render_table("gpuopt · DataLoaderTuner", rows, notes)


def loader_tune_summary(result: LoaderTuneResult) -> str:
    """One line on what the tuner did: kept the user's setting, or changed it and by how much.

    Example::

        >>> from lightning_gpuopt.core.loader import LoaderSetting, LoaderTiming, LoaderTuneResult
        >>> yours = LoaderTiming(LoaderSetting(2, 2), 8, 256, 0.1, 0.5, 512.0, None)
        >>> loader_tune_summary(LoaderTuneResult(2, 2, False, False, 512.0, yours, [yours], reason="fastest"))
        'kept your setting num_workers=2, prefetch_factor=2, persistent_workers=False, pin_memory=False (fastest)'
    """
    reason = f" ({result.reason})" if result.reason else ""
    if result.baseline is not None and result.setting == result.baseline.setting:
        return f"kept your setting {result.setting.describe()}{reason}"
    before = f"{result.baseline.setting.describe()} → " if result.baseline is not None else ""
    speedup = f": {result.speedup:.2f}x the samples/s of your setting" if result.speedup is not None else ""
    return f"{before}{result.setting.describe()}{speedup}{reason}"


def batch_search_table(result: BatchSizeSearchResult) -> str:
    """The ``BatchSizeSearch`` result: one row per trial in the order run, the chosen size marked."""
    rows = [
        (
            "batch size",
            f"{result.batch_size} (was {result.initial_batch_size}; estimate predicted {result.predicted_batch_size})",
        ),
        ("budget", f"{format_bytes(result.budget_bytes)} per rank, {result.world_size} rank(s)"),
        (
            "search",
            f"{len(result.trials)} trials x {result.steps_per_trial} steps in "
            f"{format_seconds(result.seconds)}; stopped: {result.stop_reason}",
        ),
    ]
    for number, trial in enumerate(result.trials, 1):
        mark = "  [CHOSEN]" if trial.fits and trial.batch_size == result.batch_size else ""
        outcome = "fits" if trial.fits else "does not fit"
        figures = f"peak {format_bytes(trial.peak_bytes)}, {format_seconds(trial.seconds)}"
        rows.append((f"trial {number}: {trial.batch_size}", f"{outcome:>12}, {figures}{mark}"))
    return render_table("gpuopt · BatchSizeSearch", rows, [f"  {note}" for note in result.notes])
