"""The figures the GPU tests measured, as a table to paste into benchmarks/RESULTS.md.

Each test hands what it measured to the ``figures`` fixture (``figures(idle_s=0.18, expected_s=0.18)``);
at the end pytest prints one markdown table of them, and writes it to the file ``GPUOPT_FIGURES`` names
(``make test-gpu`` sets ``$(OUT)/test_gpu.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

_ROWS: list[tuple[str, str]] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    def record(**values: Any) -> None:
        shown = ", ".join(
            f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in values.items()
        )
        _ROWS.append((request.node.name, shown))

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no card"
    table = "\n".join(
        [f"make test-gpu on {card}, torch {torch.__version__}", "", "| test | figures |", "|---|---|"]
        + [f"| {name} | {shown} |" for name, shown in _ROWS]
    )
    terminalreporter.write_sep("-", "figures (for benchmarks/RESULTS.md)")
    terminalreporter.write_line(table)
    path = os.environ.get("GPUOPT_FIGURES")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(table + "\n")
