"""Where a report and its PNGs live: a local path (no protocol, or ``file://``) is a :class:`~pathlib.Path`; any other
URL (``s3://bucket/run``, ``memory://run``, ``simplecache::s3://...``) goes through fsspec as Lightning's loggers do, a
file written in one call (``pipe_file``: on an object store, whole or not at all).

    >>> as_location("lightning_logs/version_0"), as_location("s3://bucket/run")
    (PosixPath('lightning_logs/version_0'), 's3://bucket/run')
    >>> join_location("s3://bucket/run/", "gpuopt_report.json"), parent_location("memory://run/report.json")
    ('s3://bucket/run/gpuopt_report.json', 'memory://run')
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any, Optional, Union

#: a local directory or file (a ``Path``), or the URL of one on an fsspec filesystem (a ``str``)
Location = Union[Path, str]


class FilesystemUnavailableError(ImportError):
    """No fsspec filesystem for the URL's protocol (unknown, or its package missing); the message says what to do."""

    def __init__(self, url: str, protocol: str, package: Optional[str], reason: str) -> None:
        self.url, self.protocol, self.package, self.reason = url, protocol, package, reason
        known = "use a local path or a protocol fsspec knows (`fsspec.registry.known_implementations`)"
        remedy = f"install it with `pip install {package}`" if package else known
        message = f"{url} needs the fsspec filesystem of {protocol!r}, which is not available ({reason}): {remedy}"
        super().__init__(message)


def is_url(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is on a non-local fsspec filesystem: Lightning's ``_is_local_file_protocol``, negated."""
    if isinstance(path, Path):
        return False
    from fsspec.utils import get_protocol

    return get_protocol(os.fspath(path)) != "file"


def as_location(path: Union[str, os.PathLike]) -> Location:
    """``path`` as a :data:`Location`: a ``Path`` when local (a ``file://`` prefix dropped), else the URL."""
    if is_url(path):
        return str(os.fspath(path))
    text = os.fspath(path)
    return Path(text.removeprefix("file://") if isinstance(text, str) else path)


def join_location(location: Location, name: str) -> Location:
    """``location / name``: a ``Path`` joined as a path, a URL with one ``/``."""
    return location / name if isinstance(location, Path) else f"{location.rstrip('/')}/{name}"


def parent_location(location: Location) -> Location:
    """The directory ``location`` is in: ``Path.parent``, or the URL without its last part."""
    if isinstance(location, Path):
        return location.parent
    head, scheme, rest = location.rpartition("://")
    rest = rest.rstrip("/")
    return f"{head}{scheme}{rest.rsplit('/', 1)[0] if '/' in rest else ''}"


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``, else :class:`FilesystemUnavailableError`."""
    from fsspec.core import url_to_fs
    from fsspec.registry import known_implementations
    from fsspec.utils import get_protocol

    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as error:
        missing = isinstance(error, ImportError)  # else a ValueError: is it an unknown protocol?
        if not missing and "protocol not known" not in str(error).lower():
            raise
        # the protocol (of a chain ``a::b://...``, the one whose import failed) and its package in fsspec's registry
        protocols = [get_protocol(part) for part in url.split("::")]
        known = [protocol for protocol in protocols if protocol in known_implementations]
        failed = [name for name in known if missing and known_implementations[name].get("err") == str(error)]
        protocol = (failed or known or protocols)[0]
        package = known_implementations[protocol]["class"].split(".")[0] if missing and protocol in known else None
        raise FilesystemUnavailableError(url, protocol, package, str(error) or type(error).__name__) from error


def read_bytes(location: Location) -> bytes:
    """The content of the file at ``location`` (``FileNotFoundError`` when there is none)."""
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = filesystem(location)
    return bytes(fs.cat_file(path))


def write_bytes(location: Location, payload: bytes) -> Location:
    """Write ``payload`` to ``location`` in one call, making missing parent folders; returns ``location``."""
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
        location.write_bytes(payload)
        return location
    fs, path = filesystem(location)
    try:
        fs.pipe_file(path, payload)
    except FileNotFoundError:  # a filesystem with real folders (sftp, local://): make them, once
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, payload)
    return location
