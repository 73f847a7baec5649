"""Download one file so that a crash at any point leaves the previous state intact.

The bytes stream into ``<dest>.part`` beside the target (same filesystem, so the final
``os.replace`` is atomic), sha256 is computed while writing, and only a complete, verified file is
renamed to ``dest``. An interrupted download keeps its ``.part``; the next call continues it with
an HTTP ``Range`` request (hashing the bytes already on disk first). A server that ignores the
range and answers ``200`` is followed from byte 0 again.

Failures:

* connection errors, timeouts, a body shorter than its ``Content-Length``, HTTP 5xx and 429 are
  transient: retried ``retries`` times with exponential backoff, each retry resuming from what is
  on disk; after the last one ``FdlError`` names the last cause and the ``.part`` stays;
* any other HTTP error (404, 403, ...) raises ``FdlError`` at once;
* a checksum mismatch deletes the ``.part`` and raises ``FdlError`` naming both digests.

``file://`` URLs are copied with the same hashing and progress reports (air-gapped sites).

Plain ``http`` (a redirect hop included) is refused unless ``allow_http`` is set, and schemes
other than https, http and file always are, before anything is written (``fdl.urls``).

Example::

    result = download("https://download.pytorch.org/libtorch/cu126/libtorch-....zip",
                      store / "libtorch.zip", expected_sha256=digest)
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from fdl.errors import FdlError
from fdl.urls import check_url, redirect_guard

Progress = Callable[[int, int | None], None]

_URL_HINT = ("check the URL, pass another with --url, or point FDL_LIBTORCH_MIRROR at a mirror "
             "that has this file")
_MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class DownloadResult:
    """A complete, verified download."""

    path: Path  # the complete file (renamed from the .part staging file)
    sha256: str
    size: int
    resumed: bool  # True if an existing .part was continued with an HTTP Range request


class _Transient(Exception):
    """A failure worth retrying (short body, 5xx, 429, a range the server would not serve)."""


class _TooLarge(FdlError):
    """The file is larger than the caller allows: never retried, its ``.part`` is deleted."""


def sha256_file(path: Path, *, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of the file at ``path``."""
    return _hash_file(path, chunk_size=chunk_size).hexdigest()


def download(url: str, dest: Path, *, expected_sha256: str | None = None,
             progress: Progress | None = None, allow_http: bool = False,
             max_bytes: int | None = None, retries: int = 4, backoff_s: float = 0.5,
             timeout_s: float = 30.0, chunk_size: int = 1 << 20) -> DownloadResult:
    """Fetch ``url`` into ``dest`` atomically; see the module docstring for the contract.

    ``progress(bytes_done, total_or_None)`` is called as data arrives. A file larger than
    ``max_bytes`` is refused (when announced, before its body is read) and its ``.part``
    deleted. Raises ``FdlError`` (``UsageError`` for a URL refused by ``check_url``, before
    anything is written).
    """
    check_url(url, allow_http=allow_http)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = _Part(dest.with_name(dest.name + ".part"), progress=progress, max_bytes=max_bytes)
    try:
        if urlparse(url).scheme.lower() == "file":
            _copy_local(url, part, chunk_size=chunk_size)
        else:
            _fetch(url, part, allow_http=allow_http, retries=retries, backoff_s=backoff_s,
                   timeout_s=timeout_s, chunk_size=chunk_size)
    except _TooLarge:
        part.path.unlink(missing_ok=True)
        raise
    digest = part.hexdigest()
    if expected_sha256 is not None and digest != expected_sha256.strip().lower():
        part.path.unlink(missing_ok=True)
        raise FdlError(f"checksum mismatch for {url}: expected sha256 {expected_sha256}, "
                       f"got {digest}",
                       hint="the partial file was deleted; run again, or check the URL and the "
                            "expected checksum (a mirror may serve a different build)")
    try:
        os.replace(part.path, dest)
    except OSError as exc:
        raise FdlError(f"cannot move the download into place at {dest}: {exc.strerror}",
                       hint=f"the verified file is kept as {part.path}") from exc
    return DownloadResult(path=dest, sha256=digest, size=part.size, resumed=part.resumed)


class _Part:
    """The ``.part`` staging file and the running sha256 of the bytes in it."""

    def __init__(self, path: Path, *, progress: Progress | None, max_bytes: int | None = None):
        self.path = path
        self.progress = progress
        self.max_bytes = max_bytes
        self.size = 0
        self.resumed = False
        self._hasher: hashlib._Hash | None = None

    def offset(self) -> int:
        """Bytes already on disk, hashed (again, if the running hash does not cover them)."""
        on_disk = self.path.stat().st_size if self.path.exists() else 0
        if self._hasher is None or on_disk != self.size:
            self._hasher = _hash_file(self.path) if on_disk else hashlib.sha256()
            self.size = on_disk
        return on_disk

    def restart(self) -> None:
        """Empty the staging file: the next bytes written are the file's first."""
        self.path.write_bytes(b"")
        self._hasher, self.size, self.resumed = hashlib.sha256(), 0, False

    def append(self, chunks: Iterable[bytes], *, total: int | None, batch_bytes: int) -> None:
        """Write ``chunks`` after the bytes on disk, hashing and reporting progress."""
        if self._hasher is None:
            self.offset()
        self._check_size(total or 0)
        hasher = self._hasher
        assert hasher is not None

        def hash_batch(batch: list[bytes]) -> None:
            for chunk in batch:
                hasher.update(chunk)

        pending: list[bytes] = []
        pending_bytes = 0
        with open(self.path, "ab") as f, _Fanout([f.writelines, hash_batch]) as fanout:
            try:
                for chunk in chunks:
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    self._check_size(self.size + pending_bytes)
                    if pending_bytes >= batch_bytes:
                        self._hand_over(fanout, pending)
                        pending, pending_bytes = [], 0
                        self._report(total)
            finally:  # keep what arrived before a dropped connection: the next attempt resumes
                tail = bool(pending)
                if tail:
                    self._hand_over(fanout, pending)
        if tail:
            self._report(total)

    def _check_size(self, size: int) -> None:
        if self.max_bytes is not None and size > self.max_bytes:
            raise _TooLarge(f"refusing a download of more than {self.max_bytes} bytes "
                            f"(the size limit): {self.path.name} is at least {size} bytes",
                            hint="a libtorch archive is a few GB; if this one is genuine, "
                                 "raise FDL_MAX_EXTRACT_BYTES (e.g. 64G)")

    def _hand_over(self, fanout: _Fanout, batch: list[bytes]) -> None:
        fanout.put(batch)
        self.size += sum(map(len, batch))

    def _report(self, total: int | None) -> None:
        if self.progress is not None:
            self.progress(self.size, total)

    def hexdigest(self) -> str:
        assert self._hasher is not None
        return self._hasher.hexdigest()


class _Fanout:
    """Hand each batch to every consumer, each in its own thread, in order.

    Writing and hashing run beside the network reads (file writes and ``hashlib`` release the
    GIL), so a download costs about the slowest of the three rather than their sum. At most
    ``depth`` batches wait per consumer. A consumer's error is raised in the caller's thread.
    """

    def __init__(self, consumers: list[Callable[[list[bytes]], object]], *, depth: int = 8):
        self._errors: list[BaseException] = []
        self._queues: list[queue.Queue[list[bytes] | None]] = [queue.Queue(depth) for _ in consumers]
        self._threads = [threading.Thread(target=self._serve, args=(q, consume), daemon=True)
                         for q, consume in zip(self._queues, consumers, strict=True)]

    def __enter__(self) -> _Fanout:
        for thread in self._threads:
            thread.start()
        return self

    def put(self, batch: list[bytes]) -> None:
        if self._errors:
            raise self._errors[0]
        for q in self._queues:
            q.put(batch)

    def __exit__(self, exc_type, exc, tb) -> None:
        for q in self._queues:  # drain: what was handed over is written and hashed
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._errors and exc_type is None:
            raise self._errors[0]

    def _serve(self, q: queue.Queue[list[bytes] | None], consume) -> None:
        while (batch := q.get()) is not None:
            if not self._errors:  # after a failure keep draining so the producer never blocks
                try:
                    consume(batch)
                except BaseException as exc:
                    self._errors.append(exc)


def _hash_file(path: Path, *, chunk_size: int = 1 << 20) -> hashlib._Hash:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            hasher.update(chunk)
    return hasher


def _copy_local(url: str, part: _Part, *, chunk_size: int) -> None:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise FdlError(f"download failed: file:// URL names a remote host ({parsed.netloc}): {url}",
                       hint="use file:///absolute/path on this machine")
    source = Path(url2pathname(parsed.path))
    try:
        with open(source, "rb") as src:
            total = os.fstat(src.fileno()).st_size
            part.restart()
            part.append(iter(lambda: src.read(chunk_size), b""), total=total,
                        batch_bytes=chunk_size)
    except OSError as exc:
        raise FdlError(f"download failed: {exc.strerror or exc}: {exc.filename or source}",
                       hint=_URL_HINT) from exc


def _fetch(url: str, part: _Part, *, allow_http: bool, retries: int, backoff_s: float,
           timeout_s: float, chunk_size: int) -> None:
    import httpx

    last_cause = "no attempt made"
    with httpx.Client(timeout=timeout_s, follow_redirects=True,
                      event_hooks=redirect_guard(allow_http=allow_http)) as client:
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                _attempt(client, url, part, chunk_size=chunk_size)
                return
            except _Transient as exc:
                last_cause = str(exc)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last_cause = f"{exc or 'no detail'} ({type(exc).__name__})"
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise FdlError(f"download failed: {exc} for {url}", hint=_URL_HINT) from exc
            except OSError as exc:
                raise FdlError(f"download failed: cannot write {part.path}: {exc}",
                               hint="check free space and permissions there") from exc
    kept = part.path.stat().st_size if part.path.exists() else 0
    if not kept:
        part.path.unlink(missing_ok=True)
    resume = f"run again to resume from the {kept} bytes kept in {part.path}" if kept \
        else "run again"
    raise FdlError(f"download failed after {retries + 1} attempts: {last_cause} for {url}",
                   hint=f"{resume}; if it keeps failing, {_URL_HINT}")


def _attempt(client, url: str, part: _Part, *, chunk_size: int) -> None:
    """One GET, continuing the ``.part`` when the server honours the range."""
    offset = part.offset()
    headers = {"Accept-Encoding": "identity"}  # the bytes as stored: what Content-Length counts
    if offset:
        headers["Range"] = f"bytes={offset}-"
    with client.stream("GET", url, headers=headers) as response:
        status = response.status_code
        if status == 416 and offset:  # the .part is not a prefix of what is served now
            part.restart()
            raise _Transient(f"HTTP 416: the server would not resume from byte {offset}")
        _check_status(status, url)
        start, total = _body_span(response)
        if status == 206 and start == offset:
            part.resumed = part.resumed or offset > 0
        elif start == 0:
            if offset:  # the server ignored the range: take the whole file again
                part.restart()
        else:
            part.restart()
            raise _Transient(f"the server sent a range from byte {start}, asked for {offset}")
        part.append(response.iter_raw(), total=total, batch_bytes=chunk_size)
    if total is not None and part.size != total:
        raise _Transient(f"the server closed the connection after {part.size} of {total} bytes")


def _check_status(status: int, url: str) -> None:
    if status in (200, 206):
        return
    if status == 429 or status >= 500:
        raise _Transient(f"HTTP {status}")
    raise FdlError(f"download failed: HTTP {status} for {url}", hint=_URL_HINT)


def _body_span(response) -> tuple[int, int | None]:
    """(first byte of the body within the file, the file's total size or None)."""
    length = response.headers.get("Content-Length")
    length = int(length) if length and length.isdigit() else None
    if response.status_code != 206:
        return 0, length
    # Content-Range: bytes 100-999/1000   (the total may be "*": unknown)
    spec = response.headers.get("Content-Range", "")
    unit, _, rest = spec.partition(" ")
    first_last, _, total = rest.partition("/")
    start_text = first_last.split("-")[0]
    if unit != "bytes" or not start_text.isdigit():
        raise _Transient(f"HTTP 206 with an unreadable Content-Range {spec!r}")
    start = int(start_text)
    if total.isdigit():
        return start, int(total)
    return start, None if length is None else start + length
