"""The dataset cache's files: fetched with :func:`fdl.download.download` (mirrors tried in order,
resumed, verified against the published ``algo:hex`` checksum, renamed into place only when it
matches) and remembered as verified, so a file in place is hashed once.

The marker ``.<file>.verified`` records the checksum a file matched and its size and mtime then;
a file without a current marker (copied in by hand, replaced, or the expected checksum changed)
is hashed again.

Plain ``http`` (a URL, a mirror, or a redirect hop) is refused unless ``FDL_ALLOW_HTTP=1``, as
for libtorch downloads (``fdl.download.urls``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fdl.download.fetch import Progress
from fdl.download.fetch import download as download_file
from fdl.download.urls import ALLOW_HTTP_ENV, http_allowed
from fdl.errors import FdlError
from fdl.files import hash_file


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
    got = hash_file(path, algorithms=(algorithm,))[algorithm].hexdigest()
    if got != want:
        raise FdlError(f"cached file {path} does not match its checksum: expected {algorithm} "
                       f"{want}, got {got}",
                       hint="delete it and run again to download a fresh copy")
    _mark_verified(path, expected)


def download(urls: list[str], dest: Path, *, expected: str,
             progress: Progress | None, on_retry: Callable[[str], None] | None = None) -> None:
    """Fetch ``dest`` from the first of ``urls`` that serves it, verified against ``expected``
    (``algo:hex``), and mark it verified. A URL the http rule refuses is skipped (and named in
    the error if none works); when every URL is refused, ``UsageError`` (exit 2) before any
    request."""
    algorithm, want = expected.split(":", 1)
    download_file(urls, dest, expected=want, algorithm=algorithm, progress=progress,
                  allow_http=http_allowed(), http_opt_in=f"{ALLOW_HTTP_ENV}=1",
                  source_hint="check the network, or set FDL_DATA_MIRROR to a base URL that "
                              f"serves {dest.name}", on_retry=on_retry)
    _mark_verified(dest, expected)
