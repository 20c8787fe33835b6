"""Regenerate ``docs/images/gpuopt_plots.png``, the README's picture, from a real run.

The run is the one behind ``tests/data/gpuopt_report.json`` (``tests/data/make_gpuopt_report.py``): a
CPU ``fit`` under a simulated 64 MiB T4, ``BatchSizeSearch`` in front of
``GpuOpt("diagnose", tune_loader=True)``, on a dataset that sleeps per sample. Its report is drawn with
:mod:`lightning_gpuopt.core.plot`, the three figures stacked, 800 px wide::

    PYTHONPATH=. python docs/images/make_readme_figure.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "data"))

from make_gpuopt_report import make_report  # noqa: E402

from lightning_gpuopt.core.diagnosis import DataWaitReport  # noqa: E402
from lightning_gpuopt.core.estimate import MemoryEstimate  # noqa: E402
from lightning_gpuopt.core.loader import LoaderTuneResult  # noqa: E402
from lightning_gpuopt.core.plot import loader_figure, memory_figure, step_time_figure  # noqa: E402
from lightning_gpuopt.core.report import from_dict, read_json  # noqa: E402
from lightning_gpuopt.core.search import BatchSizeSearchResult  # noqa: E402

OUT = Path(__file__).parent / "gpuopt_plots.png"
CARD, MEMORY = "T4", "64MiB"  # make_report's simulated card


def main() -> None:
    logging.getLogger("lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        report = read_json(make_report(Path(tmp), steps=150, memory=MEMORY))
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 13), dpi=100, layout="constrained")  # 800 px wide: a README column
    panels = figure.subfigures(3, 1, height_ratios=[1.25, 0.8, 1])  # each panel laid out on its own
    memory_axes, loader_axes, step_axes = (panel.subplots() for panel in panels)
    figure.suptitle(f"A CPU fit on SimulatedGpu({CARD!r}, memory={MEMORY!r}), not a real card", fontsize=11)
    memory_figure(
        from_dict(BatchSizeSearchResult, report["batch_size_search"]),
        from_dict(MemoryEstimate, report["memory"]),
        axes=memory_axes,
    )
    loader_figure(from_dict(LoaderTuneResult, report["dataloader"]), axes=loader_axes)
    step_time_figure(from_dict(DataWaitReport, report["data_wait"]), axes=step_axes)
    figure.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
