"""PNGs of a ``gpuopt_report.json`` (``gpuopt plot``; what each shows: docs/gpuopt.md), drawn with matplotlib (the
``[plot]`` extra), one a section: ``step_time.png`` (``"data_wait"``), ``memory.png`` (``"batch_size_search"``,
``"memory"``), ``loader.png`` (``"dataloader"``). Without matplotlib, drawing raises PlotUnavailableError."""

from __future__ import annotations

import io
import os
import statistics
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_gpuopt.core.diagnosis import DataWaitReport
from lightning_gpuopt.core.estimate import MemoryEstimate
from lightning_gpuopt.core.loader import LoaderTuneResult
from lightning_gpuopt.core.report import STOP_REASONS, from_dict, read_json
from lightning_gpuopt.core.search import BatchSizeSearchResult
from lightning_gpuopt.core.storage import Location, as_location, join_location, parent_location, write_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the figures :func:`report_figures` can draw, by name (the PNG is ``NAME.png``)
PLOT_NAMES = ("step_time", "memory", "loader")
_MIB = 2**20
_COLOURS = {"data wait": "#d62728", "transfer": "#ff7f0e", "compute": "#2ca02c", "other": "#9e9e9e"}


class PlotUnavailableError(ImportError):
    """matplotlib is not installed: the message names the extra that brings it."""


def _new_figure(axes: Any = None, width: float = 8.0, height: float = 4.5) -> tuple[Figure, Any]:
    """``(axes.figure, axes)``, or a new one-plot figure on an Agg canvas (not pyplot's: no global state)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        needs = "Drawing the gpuopt report needs matplotlib: `pip install lightning-gpuopt[plot]` (or `pip install matplotlib`)."
        raise PlotUnavailableError(f"{needs} ({error})") from None
    if axes is not None:
        return axes.figure, axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def step_time_figure(report: DataWaitReport, axes: Any = None) -> Figure:
    """``step_time.png`` (into ``axes`` when given); a report without a timeline is one bar of the means."""
    figure, axes = _new_figure(axes)
    timeline, totals = report.timeline, report.totals
    if timeline is None or not timeline.step:
        left = 0.0
        for name, seconds in zip(_COLOURS, (totals.data_wait_s, totals.transfer_s, totals.compute_s, totals.other_s)):
            per_step_ms = 1e3 * totals.per_step(seconds)
            axes.barh(["mean step"], [per_step_ms], left=left, label=name, color=_COLOURS[name])
            left += per_step_ms
        axes.set_xlabel("ms per step")
    else:
        steps, every = timeline.step, timeline.steps_per_point
        columns = (timeline.data_wait_s, timeline.transfer_s, timeline.compute_s, timeline.other_s)
        ms = [[1e3 * value for value in values] for values in columns]
        axes.stackplot(steps, *ms, labels=list(_COLOURS), colors=list(_COLOURS.values()), step="post", alpha=0.85)
        if timeline.gpu_idle_s is not None:
            idle_ms = [1e3 * value for value in timeline.gpu_idle_s]
            axes.step(steps, idle_ms, where="post", color="#1f77b4", linewidth=1.5, label="GPU idle before the step")
        label = "training step" + (f" (mean of {every} steps a point)" if every > 1 else "")
        axes.set(xlabel=label, ylabel="ms per step", xlim=(steps[0], steps[-1] + every), ylim=(0, None))
    shares = {"data wait": totals.data_wait_fraction, "compute": totals.compute_fraction}
    shares["GPU idle"] = totals.gpu_idle_fraction
    shown = ", ".join(f"{name} {part:.0%}" for name, part in shares.items() if part is not None)
    axes.set_title(f"Step time over training · {report.verdict}\n{shown}", fontsize=10)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    return figure


def memory_figure(search: BatchSizeSearchResult, estimate: Optional[MemoryEstimate] = None, axes: Any = None) -> Figure:
    """``memory.png`` (into ``axes`` when given)."""
    figure, axes = _new_figure(axes)
    sizes = [trial.batch_size for trial in search.trials] + [search.batch_size or 0]
    right = max(sizes) * 1.15 if max(sizes) > 0 else 1.0
    peaks = [search.budget_bytes or 0, (estimate.capacity_bytes or 0) if estimate else 0]
    ceiling = max(peaks + [trial.peak_bytes or 0 for trial in search.trials]) / _MIB
    fitted = [trial for trial in search.trials if trial.fits and trial.peak_bytes is not None]
    missed = [trial.batch_size for trial in search.trials if not trial.fits]
    dots = dict(marker="o", zorder=3, label="fits: peak compared with the budget")
    axes.scatter([t.batch_size for t in fitted], [(t.peak_bytes or 0) / _MIB for t in fitted], color="#2ca02c", **dots)
    crosses = dict(marker="x", zorder=3, clip_on=False, label="out of memory (drawn at the top)")
    axes.scatter(missed, [ceiling] * len(missed), color="#d62728", **crosses)
    for number, trial in enumerate(search.trials, 1):
        place = (trial.batch_size, (trial.peak_bytes or 0) / _MIB if trial.fits else ceiling)
        axes.annotate(str(number), place, textcoords="offset points", xytext=(4, 4), fontsize=8, color="#555555")
    points = {trial.batch_size: trial.peak_bytes for trial in search.trials if trial.fits and trial.peak_bytes}
    fixed, per_sample, label = 0.0, 0.0, "line through the trials that fit"
    if estimate is not None and estimate.fixed_bytes is not None and estimate.bytes_per_sample:
        fixed, per_sample = estimate.fixed_bytes, estimate.bytes_per_sample
        label = f"estimate, allocated: {fixed / _MIB:,.1f} MiB + {per_sample / 1024:,.1f} KiB x batch"
    elif len(points) >= 2 and (fit := statistics.linear_regression(list(points), list(points.values()))).slope > 0:
        per_sample, fixed = fit
    if per_sample:
        ends = [fixed / _MIB, (fixed + per_sample * right) / _MIB]
        axes.plot([0, right], ends, linestyle="--", color="#555555", label=label)
    if estimate is not None and estimate.measured_peak_bytes and estimate.batch_size:
        error = f", estimate {estimate.estimate_error:+.1%}" if estimate.estimate_error is not None else ""
        label = f"measured at {estimate.batch_size}: allocated{error}"
        measured = estimate.measured_peak_bytes / _MIB
        axes.scatter([estimate.batch_size], [measured], color="#9467bd", marker="D", zorder=4, label=label)
    if search.budget_bytes:
        budget = search.budget_bytes / _MIB
        axes.axhline(budget, color="#ff7f0e", label=f"budget ({budget:,.1f} MiB)")
    if estimate is not None and estimate.capacity_bytes:
        capacity = estimate.capacity_bytes / _MIB
        axes.axhline(capacity, color="#000000", linewidth=0.8, label=f"memory limit ({capacity:,.1f} MiB)")
    if search.batch_size is not None:
        axes.axvline(search.batch_size, color="#1f77b4", linestyle=":", label=f"chosen batch size {search.batch_size}")
    axes.set(xlim=(0, right), ylim=(0, ceiling * 1.08), xlabel="batch size (per rank)", ylabel="peak memory (MiB)")
    stop = STOP_REASONS.get(search.stop_reason, search.stop_reason)
    axes.set_title(f"Memory vs batch size · {len(search.trials)} trials · {stop}", fontsize=10)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    return figure


def loader_figure(result: LoaderTuneResult, axes: Any = None) -> Figure:
    """``loader.png``, the best setting at the top (into ``axes`` when given)."""
    timings = sorted(result.candidates, key=lambda timing: timing.samples_per_second)
    figure, axes = _new_figure(axes, height=max(2.5, 1.2 + 0.4 * len(timings)))
    baseline = result.baseline.setting if result.baseline is not None else None
    labels, colours = [], []
    for timing in timings:
        on = (timing.setting == result.setting, timing.setting == baseline, timing.stopped_early)
        marks = [mark for mark, shown in zip(("chosen", "yours", "stopped early"), on) if shown]
        labels.append(timing.setting.short() + (f"  [{', '.join(marks)}]" if marks else ""))
        colours.append("#2ca02c" if on[0] else "#1f77b4" if on[1] else "#9e9e9e")
    bars = axes.barh(range(len(timings)), [timing.samples_per_second for timing in timings], color=colours)
    axes.bar_label(bars, labels=[f"{timing.samples_per_second:,.0f}" for timing in timings], padding=3, fontsize=8)
    axes.set_yticks(range(len(timings)), labels, fontsize=8)
    axes.set_xlabel("samples / s (loader alone, steady state)")
    axes.margins(x=0.15)
    speedup = f" · {result.speedup:.2f}x your setting" if result.speedup is not None else ""
    axes.set_title(f"DataLoader settings timed · {len(timings)} in {result.seconds:.1f} s{speedup}", fontsize=10)
    return figure


def report_figures(report: Union[dict[str, Any], str, os.PathLike]) -> dict[str, Figure]:
    """Every figure the report (``gpuopt_report.json``'s content or its path) has data for, by name."""
    data = read_json(report) if isinstance(report, (str, os.PathLike)) else report
    wait, search, loader = (data.get(key) or {} for key in ("data_wait", "batch_size_search", "dataloader"))
    figures = {}
    if wait.get("totals", {}).get("steps"):
        figures["step_time"] = step_time_figure(from_dict(DataWaitReport, wait))
    if search.get("trials"):
        estimate = from_dict(MemoryEstimate, data["memory"]) if data.get("memory") else None
        figures["memory"] = memory_figure(from_dict(BatchSizeSearchResult, search), estimate)
    if loader.get("candidates"):
        figures["loader"] = loader_figure(from_dict(LoaderTuneResult, loader))
    return figures


def save_plots(
    report: Union[dict[str, Any], str, os.PathLike], out_dir: Optional[Union[str, os.PathLike]] = None
) -> list[Location]:
    """Save each of :func:`report_figures` (``report``: also an fsspec URL) as ``out_dir/NAME.png`` (a path or a URL;
    ``None``: beside the report) and return where (URL strings for a URL)."""
    if out_dir is None:
        if not isinstance(report, (str, os.PathLike)):
            raise ValueError("a report given as a dict needs an `out_dir` for its PNGs, e.g. out_dir='plots/'.")
        out_dir = parent_location(as_location(report))
    out, written = as_location(out_dir), []
    for name, figure in report_figures(report).items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        written.append(write_bytes(join_location(out, f"{name}.png"), buffer.getvalue()))
    return written
