"""Shared by the benchmark scripts: the machine description and appending to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {cores} usable cores, {device}; torch {torch.__version__}"


def command() -> str:
    return " ".join(shlex.quote(arg) for arg in [Path(sys.executable).name, *sys.argv])


def append(title: str, markdown_table: str, notes: str = "") -> Path:
    """Append a dated section to benchmarks/RESULTS.md (never rewrites earlier sections)."""
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section was appended by the script it names.\n")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"\n## {title} — {stamp}\n\n- machine: {machine()}\n- command: `{command()}`\n\n{markdown_table}\n"
    if notes:
        section += f"\n{notes}\n"
    with RESULTS.open("a") as handle:
        handle.write(section)
    return RESULTS
