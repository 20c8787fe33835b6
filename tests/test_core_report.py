"""Report plumbing: JSON round trips and tables that keep every character of the figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_gpuopt.core.report import from_dict, read_json, render_table, to_dict, update_json_section


@dataclass
class Inner:
    value: float


@dataclass
class Outer:
    name: str
    inner: Optional[Inner] = None
    items: list[Inner] = field(default_factory=list)
    by_key: dict[str, Inner] = field(default_factory=dict)


def test_nested_dataclasses_round_trip_through_json(tmp_path):
    original = Outer("x", Inner(1.5), [Inner(2.0)], {"a": Inner(3.0)})
    path = update_json_section(tmp_path / "report.json", "outer", to_dict(original))
    update_json_section(path, "other", {"kept": True})
    content = read_json(path)
    assert from_dict(Outer, content["outer"]) == original and content["other"] == {"kept": True}
    assert not list(tmp_path.glob(".report.json.*"))  # no temporary file left behind


def test_table_cells_are_plain_text_not_markup():
    text = render_table("title", [("setting", "1,000 samples/s  [yours]"), ("[bold]name[/bold]", "x")])
    assert "[yours]" in text and "[bold]name[/bold]" in text
