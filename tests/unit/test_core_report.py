"""Report plumbing: JSON round trips and tables that keep every character of the figures."""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import fsspec
import pytest
from helpers import memory_files, missing_protocol

from lightning_gpuopt.core import report
from lightning_gpuopt.core.report import from_dict, read_json, render_table, to_dict, update_json_section
from lightning_gpuopt.core.storage import (
    FilesystemUnavailableError,
    as_location,
    join_location,
    parent_location,
)


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


def test_report_file_mode_follows_the_umask_like_any_file_the_user_writes(tmp_path):
    for umask in (0o022, 0o077, 0o002):
        previous = os.umask(umask)
        try:
            written = update_json_section(tmp_path / f"report-{umask:o}.json", "s", {})
            by_hand = tmp_path / f"by-hand-{umask:o}.json"
            by_hand.write_text("{}")
        finally:
            os.umask(previous)
        assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(by_hand.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("garbage", [b'{"memory": {"peak": 1', b"[1, 2]", b"\xff\xfe not text"])
def test_unreadable_report_is_kept_aside_with_a_warning_never_dropped(tmp_path, garbage):
    path = tmp_path / "gpuopt_report.json"
    path.write_bytes(garbage)
    with pytest.warns(UserWarning, match=re.escape(f"{path.name}.corrupt-1")) as caught:
        update_json_section(path, "data_wait", {"steps": 3})
    assert str(path) in str(caught[0].message)
    assert (tmp_path / "gpuopt_report.json.corrupt-1").read_bytes() == garbage
    assert read_json(path) == {"data_wait": {"steps": 3}, "report_version": report.REPORT_VERSION}
    path.write_bytes(garbage)  # a second one does not overwrite the first one kept aside
    with pytest.warns(UserWarning, match="corrupt-2"):
        update_json_section(path, "data_wait", {"steps": 4})
    assert (tmp_path / "gpuopt_report.json.corrupt-2").read_bytes() == garbage


def test_full_disk_raises_enospc_and_leaves_the_old_report_whole(tmp_path, monkeypatch):
    path = update_json_section(tmp_path / "gpuopt_report.json", "memory", {"peak": 1})
    before = path.read_bytes()
    # the temporary file is /dev/full: the kernel answers every write with ENOSPC, as a full disk does
    monkeypatch.setattr(
        report,
        "_create_sibling",
        lambda target: (os.open("/dev/full", os.O_WRONLY), tmp_path / ".gpuopt_report.json.x.tmp"),
    )
    with pytest.raises(OSError) as raised:
        update_json_section(path, "data_wait", {"steps": 3})
    assert raised.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["gpuopt_report.json"]


def test_locations_keep_a_url_whole_and_a_local_path_a_path(tmp_path):
    assert as_location("lightning_logs/version_0") == Path("lightning_logs/version_0")
    assert as_location(tmp_path) == tmp_path and as_location(f"file://{tmp_path}") == tmp_path
    assert as_location("s3://bucket/run") == "s3://bucket/run"  # not Path's s3:/bucket/run
    assert join_location(as_location("memory://run/"), "gpuopt_report.json") == "memory://run/gpuopt_report.json"
    assert join_location(tmp_path, "gpuopt_report.json") == tmp_path / "gpuopt_report.json"
    assert parent_location("simplecache::s3://bucket/run/gpuopt_report.json") == "simplecache::s3://bucket/run"
    assert parent_location("memory://gpuopt_report.json") == "memory://"


def test_sections_merge_at_a_url_as_in_a_local_file(memory_url, tmp_path):
    url = f"{memory_url}/run/version_0/gpuopt_report.json"
    assert update_json_section(url, "memory", {"peak": 1}) == url  # a URL comes back as the URL
    update_json_section(url, "data_wait", {"steps": 3})
    assert read_json(url) == {"memory": {"peak": 1}, "report_version": report.REPORT_VERSION, "data_wait": {"steps": 3}}
    local = update_json_section(tmp_path / "gpuopt_report.json", "memory", {"peak": 1})
    update_json_section(local, "data_wait", {"steps": 3})
    assert memory_files(memory_url) == {url: local.read_bytes()}  # the same bytes, and no temporary file left
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpuopt_report.json"]  # no local `memory:` folder


def test_unreadable_report_at_a_url_is_kept_aside_with_a_warning(memory_url):
    url = f"{memory_url}/gpuopt_report.json"
    fsspec.filesystem("memory").pipe_file(url, b"[1, 2]")
    with pytest.warns(UserWarning, match=re.escape(f"{url}.corrupt-1")):
        update_json_section(url, "data_wait", {"steps": 3})
    written = b'{\n  "data_wait": {\n    "steps": 3\n  },\n  "report_version": 2\n}\n'
    assert memory_files(memory_url) == {url: written, f"{url}.corrupt-1": b"[1, 2]"}


def test_a_url_whose_filesystem_package_is_missing_names_the_url_and_the_package():
    protocol, package = missing_protocol()
    url = f"{protocol}://bucket/run/gpuopt_report.json"
    with pytest.raises(FilesystemUnavailableError) as raised:
        update_json_section(url, "data_wait", {"steps": 3})
    assert (raised.value.url, raised.value.protocol, raised.value.package) == (url, protocol, package)
    assert url in str(raised.value) and f"pip install {package}" in str(raised.value)
    with pytest.raises(FilesystemUnavailableError, match="Protocol not known") as raised:
        read_json("nosuchfs-gpuopt://bucket/gpuopt_report.json")
    assert raised.value.package is None and "fsspec.registry.known_implementations" in str(raised.value)
