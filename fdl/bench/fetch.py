"""Fetching and verifying dataset files: each download streams into a temporary file beside
its target, hashed as it arrives, and is renamed into place only when it matches its published
checksum (``algo:hex``); a mismatch deletes it. A file in place is hashed once: the marker
``.<file>.verified`` records the checksum it matched and the file's size and mtime then.

Plain ``http`` (a URL, a mirror, or a redirect hop) is refused unless ``FDL_ALLOW_HTTP=1``, as
for libtorch downloads (``fdl.urls``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fdl.errors import FdlError, UsageError

Progress = Callable[[int, int | None], None]
_CHUNK = 1 << 20


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def _fingerprint(path: Path, expected: str) -> list[str]:
    """What a marker records: the checksum matched, and the file's size and mtime then."""
    info = path.stat()
    return [expected, str(info.st_size), str(info.st_mtime_ns)]


def _mark_verified(path: Path, expected: str) -> None:
    _marker(path).write_text(" ".join(_fingerprint(path, expected)) + "\n")


def verify_cached(path: Path, *, expected: str) -> None:
    """Check a file already in place against ``expected`` (``algo:hex``), once: a marker
    remembers a match until the file changes."""
    marker = _marker(path)
    if marker.is_file() and marker.read_text().split() == _fingerprint(path, expected):
        return
    algorithm, want = expected.split(":", 1)
    hasher = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    if hasher.hexdigest() != want:
        raise FdlError(f"cached file {path} does not match its checksum: expected {algorithm} "
                       f"{want}, got {hasher.hexdigest()}",
                       hint="delete it and run again to download a fresh copy")
    _mark_verified(path, expected)


def download(urls: list[str], dest: Path, *, expected: str,
             progress: Progress | None) -> None:
    """Fetch ``dest`` from the first of ``urls`` that answers; verify; rename into place.

    A URL the http rule refuses is skipped (named in the error if none works); when every URL
    is refused, ``UsageError`` (exit 2) before any request."""
    import httpx

    from fdl.urls import ALLOW_HTTP_ENV, check_url, http_allowed, redirect_guard

    allow_http, opt_in = http_allowed(), f"{ALLOW_HTTP_ENV}=1"
    failures, usable = [], []
    for url in urls:
        try:
            check_url(url, allow_http=allow_http, opt_in=opt_in)
            usable.append(url)
        except UsageError as exc:
            failures.append(exc.message)
    if not usable:
        raise UsageError(f"cannot download {dest.name}: {'; '.join(failures)}",
                         hint=f"set FDL_DATA_MIRROR to an https base URL, or opt in with {opt_in} "
                              "for a server you trust (files are still checked against their "
                              "checksums)")
    with httpx.Client(timeout=30.0, follow_redirects=True,
                      event_hooks=redirect_guard(allow_http=allow_http, opt_in=opt_in)) as client:
        for url in usable:
            try:
                _fetch_verified(client, url, dest, expected=expected, progress=progress)
                return
            except httpx.TransportError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
            except _HttpStatus as exc:
                failures.append(f"{url}: {exc}")
    raise FdlError(f"cannot download {dest.name}: {'; '.join(failures)}",
                   hint="check the network, or set FDL_DATA_MIRROR to a base URL that serves "
                        f"{dest.name}" + (f" (plain http needs {opt_in})" if len(usable) <
                                          len(urls) else ""))


class _HttpStatus(Exception):
    """The server answered something other than 200."""


def _fetch_verified(client: Any, url: str, dest: Path, *, expected: str,
                    progress: Progress | None) -> None:
    algorithm, want = expected.split(":", 1)
    hasher = hashlib.new(algorithm)
    fd, staging = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise _HttpStatus(f"HTTP {response.status_code}")
            length = response.headers.get("Content-Length")
            total, done = (int(length) if length else None), 0
            for chunk in response.iter_raw(_CHUNK):  # raw: hash the bytes as published
                out.write(chunk)
                hasher.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        got = hasher.hexdigest()
        if got != want:
            raise FdlError(f"checksum mismatch for {dest.name} from {url}: expected {algorithm} "
                           f"{want}, got {got}",
                           hint="the download was deleted; the server may hold a different "
                                "file (check FDL_DATA_MIRROR), or run again")
        os.replace(staging, dest)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    _mark_verified(dest, f"{algorithm}:{want}")
