"""The one HTTP download-and-verify of fdl (libtorch archives and bench datasets alike): fetch a
file from one URL, or the first of several mirrors that serves it, so that a crash at any point
leaves the previous state intact.

The bytes stream into ``<dest>.part`` beside the target (same filesystem, so the final
``os.replace`` is atomic), hashed while written (sha256 always, plus the expected digest's
algorithm when it is another, e.g. the md5 a dataset publishes), and only a complete, verified
file is renamed to ``dest``. An interrupted download keeps its ``.part``; the next attempt (or
call) continues it with an HTTP ``Range`` request, hashing the bytes already on disk first. A
server that ignores the range and answers ``200`` is followed from byte 0 again.

Failures:

* connection errors, timeouts, a stream slower than :data:`MIN_RATE` (1 KiB/s over 30 s: a
  drip keeps each read within its timeout; the ranges of a parallel download are not watched),
  a body shorter than its ``Content-Length``, HTTP 5xx and 429 are transient (``on_retry`` is
  told each failed round in one line): the next URL is tried (continuing the ``.part``:
  mirrors serve the same file, and several URLs require the expected digest that proves it);
  once every URL has failed, the round is repeated ``retries`` times with exponential backoff;
  after the last, ``FdlError`` names each URL's last cause and the ``.part`` stays for the next
  run;
* any other HTTP error (404, 403, ...) or an unreadable ``file://`` path rules that URL out: the
  next is tried, and ``FdlError`` names them all when none is left;
* a checksum mismatch deletes the ``.part`` and raises ``FdlError`` naming both digests;
* a file larger than ``max_bytes`` is refused and its ``.part`` deleted, never retried.

Large files come over several connections: when the file is at least ``parallel_min_bytes``
(64 MiB) and the first answer (``200``) offers ranges (``Accept-Ranges: bytes``, a
``Content-Length`` and an ``ETag`` or ``Last-Modified``), connections fetch byte ranges into the
``.part`` at their offsets (:mod:`fdl.download.ranged`). How many: ``connections`` (else
``FDL_DOWNLOAD_CONNECTIONS``; 1 is one request for the whole file, recorded like the others so
that its resume asks ``If-Range``) from the start; when neither is given, one, and up to 4 while
the link rather than this machine's CPU holds them back. The ranges on disk are recorded in
``<dest>.part.ranges.json`` (:mod:`fdl.download.ranges`), so an interrupted download resumes
only the missing ones; a record that cannot be trusted starts the download over, and so does a
file changed on the server (``If-Range``, and its ``ETag``, ``Last-Modified`` and size against
the first answer's; a transient failure: retried, then reported), so a file is never assembled
from two versions. Without ranges, a length or a validator, one stream.

``file://`` URLs are copied with the same hashing and progress reports (air-gapped sites). Plain
``http`` (a redirect hop included) is refused unless ``allow_http`` is set, and schemes other than
https, http and file always are (``fdl.download.urls``): a refused URL is skipped while others
remain, and when all are refused ``UsageError`` is raised before anything is written.

Example::

    result = download("https://download.pytorch.org/libtorch/cu126/libtorch-....zip",
                      store / "libtorch.zip", expected=digest)
    download([mirror + "t10k-labels-idx1-ubyte.gz", canonical + "t10k-labels-idx1-ubyte.gz"],
             folder / "t10k-labels-idx1-ubyte.gz", expected=md5, algorithm="md5")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from fdl.download.client import http_client
from fdl.download.partfile import PartFile, Progress, TooLarge
from fdl.download.ranged import Ranges, RangesIgnored, fetch_ranges, offers_ranges, start_ranges
from fdl.download.ranged import RuledOut as _RuledOut
from fdl.download.ranged import Transient as _Transient
from fdl.download.ranged import check_status as _check_status
from fdl.download.ranges import discard_state, load_state, state_path
from fdl.download.urls import HTTP_OPT_IN, check_url
from fdl.errors import FdlError, UsageError

__all__ = ["DownloadResult", "Progress", "download"]

_MAX_BACKOFF_S = 30.0
CONNECTIONS_ENV = "FDL_DOWNLOAD_CONNECTIONS"
# The most an unset setting opens (adaptive: see the module docstring). 4 clears the goal of 3x
# `curl -o` behind a per-connection cap and asks no more of a server than download managers
# commonly do (the figures: docs/libtorch.md "Verified here").
DEFAULT_CONNECTIONS = 4
PARALLEL_MIN_BYTES = 64 << 20


@dataclass(frozen=True)
class DownloadResult:
    """A complete, verified download."""

    path: Path  # the complete file (renamed from the .part staging file)
    sha256: str  # computed whatever algorithm the expected digest uses
    size: int
    resumed: bool  # True if an existing .part was continued with an HTTP Range request
    connections: int = 1  # the most connections that fetched it at once


def download(urls: str | Sequence[str], dest: Path, *, expected: str | None = None,
             algorithm: str = "sha256", progress: Progress | None = None,
             allow_http: bool = False, http_opt_in: str = HTTP_OPT_IN,
             source_hint: str = "check the URL", max_bytes: int | None = None,
             retries: int = 4, backoff_s: float = 0.5, timeout_s: float = 30.0,
             chunk_size: int = 1 << 20, connections: int | None = None,
             parallel_min_bytes: int = PARALLEL_MIN_BYTES,
             min_rate: MinRate | None = None,
             on_retry: Callable[[str], None] | None = None) -> DownloadResult:
    """Fetch ``dest`` from ``urls`` (one, or mirrors tried in order) atomically; see the module
    docstring for the contract.

    ``expected`` is the hex digest the file must have under ``algorithm`` (a hashlib name);
    required when several URLs are given. ``progress(bytes_done, total_or_None)`` is called as
    data arrives. A file larger than ``max_bytes`` is refused (when announced, before its body is
    read). ``http_opt_in`` names the user's way to allow plain http and ``source_hint`` where
    else the file may be found, in the errors. ``connections`` (else ``FDL_DOWNLOAD_CONNECTIONS``,
    else from 1 to 4 as the link needs) connections fetch a file of ``parallel_min_bytes`` or
    more when the server allows. A stream slower than ``min_rate`` (default
    :data:`MIN_RATE`) over its window is a transient failure, as a timeout is. ``on_retry`` is
    told, in one line, each failed round that another follows (its cause and the wait).
    Raises ``FdlError`` (``UsageError`` when every URL is refused by ``check_url``, or the
    number of connections is not 1 to 64, before anything is written)."""
    candidates = [urls] if isinstance(urls, str) else list(urls)
    if len(candidates) > 1 and expected is None:
        raise ValueError("several URLs are mirrors of one file only under an expected digest")
    usable, refused = _usable(candidates, allow_http=allow_http, opt_in=http_opt_in)
    chosen = connections is not None or bool(os.environ.get(CONNECTIONS_ENV, "").strip())
    ranges = Ranges(num_connections=num_connections(connections), min_bytes=parallel_min_bytes,
                    verified=expected is not None, adaptive=not chosen)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = PartFile(dest.with_name(dest.name + ".part"), algorithms={"sha256", algorithm},
                    progress=progress, max_bytes=max_bytes)
    try:
        url = _fill(part, usable, refused=refused, allow_http=allow_http, opt_in=http_opt_in,
                    source_hint=source_hint, retries=retries, backoff_s=backoff_s,
                    timeout_s=timeout_s, chunk_size=chunk_size, ranges=ranges,
                    min_rate=min_rate or MIN_RATE, on_retry=on_retry)
    except TooLarge:
        part.path.unlink(missing_ok=True)
        discard_state(part.path)
        raise
    digests = part.hexdigests()
    discard_state(part.path)  # complete: nothing to resume, whatever comes next
    if expected is not None and digests[algorithm] != expected.strip().lower():
        part.path.unlink(missing_ok=True)
        raise FdlError(f"checksum mismatch for {url}: expected {algorithm} {expected}, "
                       f"got {digests[algorithm]}",
                       hint="the partial file was deleted; run again, or check the URL and the "
                            "expected checksum (a mirror may serve a different file)")
    try:
        os.replace(part.path, dest)
    except OSError as exc:
        raise FdlError(f"cannot move the download into place at {dest}: {exc.strerror}",
                       hint=f"the verified file is kept as {part.path}") from exc
    return DownloadResult(path=dest, sha256=digests["sha256"], size=part.size,
                          resumed=part.resumed, connections=part.connections)


def num_connections(connections: int | None = None) -> int:
    """The most connections a large download uses: ``connections``, else
    ``FDL_DOWNLOAD_CONNECTIONS``, else 4; ``UsageError`` for anything but a whole number from 1
    to 64."""
    origin = "connections"
    if connections is None:
        text = os.environ.get(CONNECTIONS_ENV, "").strip()
        if not text:
            return DEFAULT_CONNECTIONS
        origin = f"{CONNECTIONS_ENV}={text!r}"
        connections = int(text) if text.isdigit() else 0
    if isinstance(connections, bool) or not 1 <= connections <= 64:
        raise UsageError(f"{origin}: expected a whole number of connections from 1 to 64",
                         hint=f"1 downloads in one stream; unset {CONNECTIONS_ENV} to let fdl "
                              "choose (up to 4)")
    return connections


def _usable(urls: list[str], *, allow_http: bool, opt_in: str) -> tuple[list[str], list[str]]:
    """The URLs ``check_url`` accepts, and why the others were refused; ``UsageError`` when it
    refuses them all (the one refusal itself for a single URL)."""
    usable, refused = [], []
    for url in urls:
        try:
            check_url(url, allow_http=allow_http, opt_in=opt_in)
            usable.append(url)
        except UsageError as exc:
            if len(urls) == 1:
                raise
            refused.append(exc.message)
    if not usable:
        raise UsageError(f"no URL to download from: {'; '.join(refused)}",
                         hint=f"use https URLs, or opt in with {opt_in} for a server you trust")
    return usable, refused


@dataclass(frozen=True)
class MinRate:
    """The slowest stream a download waits on: at least ``bytes_per_s`` over each
    ``window_s`` (a server that sends a byte a second keeps every read within its timeout and
    would take 17 minutes for 1,000 bytes)."""

    bytes_per_s: float = 1024.0
    window_s: float = 30.0

    def watched(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """``chunks`` as they come; ``_Transient`` once a whole window brought too few bytes."""
        start, got = time.monotonic(), 0
        for chunk in chunks:
            got += len(chunk)
            yield chunk
            now = time.monotonic()
            if now - start >= self.window_s:
                if got < self.bytes_per_s * self.window_s:
                    raise _Transient(f"the server sent {got} bytes in {now - start:.0f} s, under "
                                     f"the {self.bytes_per_s:g} bytes/s a download needs")
                start, got = now, 0


MIN_RATE = MinRate()


def _fill(part: PartFile, urls: list[str], *, refused: list[str], allow_http: bool, opt_in: str,
          source_hint: str, retries: int, backoff_s: float, timeout_s: float,
          chunk_size: int, ranges: Ranges, min_rate: MinRate,
          on_retry: Callable[[str], None] | None) -> str:
    """Fill ``part`` from the first of ``urls`` that serves the whole file, in rounds (see the
    module docstring); returns that URL, or raises ``FdlError`` naming every URL's failure."""
    causes: dict[str, str] = {}
    pending = list(urls)
    attempts = 0
    with _http_client(urls, allow_http=allow_http, opt_in=opt_in, timeout_s=timeout_s) as client:
        while pending and attempts <= retries:
            if attempts:
                delay = min(backoff_s * 2 ** (attempts - 1), _MAX_BACKOFF_S)
                if on_retry is not None:
                    last = "; ".join(f"{causes[url]} for {url}" for url in pending if url in causes)
                    on_retry(f"download attempt {attempts} of {retries + 1} failed ({last}); "
                             f"trying again in {delay:g} s")
                time.sleep(delay)
            attempts += 1
            for url in list(pending):
                try:
                    _from_url(client, url, part, chunk_size=chunk_size, ranges=ranges,
                              min_rate=min_rate)
                    return url
                except _Transient as exc:
                    causes[url] = str(exc)
                except _RuledOut as exc:
                    causes[url] = str(exc)
                    pending.remove(url)
    raise _failure(part, causes, retrying=bool(pending), attempts=attempts, refused=refused,
                   opt_in=opt_in, source_hint=source_hint)


def _failure(part: PartFile, causes: dict[str, str], *, retrying: bool, attempts: int,
             refused: list[str], opt_in: str, source_hint: str) -> FdlError:
    """The error when no URL served the file: each URL's last cause; the ``.part`` kept (when
    it holds anything) for the next run to resume."""
    failures = [f"{cause} for {url}" for url, cause in causes.items()] + refused
    state = load_state(part.path)
    kept = state.done_bytes if state is not None else \
        part.path.stat().st_size if part.path.exists() else 0
    if not kept:
        part.path.unlink(missing_ok=True)
        discard_state(part.path)
    hint = source_hint if not refused else \
        f"{source_hint} (only https, file and, with {opt_in}, http URLs are fetched)"
    if retrying:  # transient to the end: the next run may well succeed
        resume = f"run again to resume from the {kept} bytes kept in {part.path}" if kept \
            else "run again"
        hint = f"{resume}; if it keeps failing, {hint}"
    after = f" after {attempts} attempts" if retrying else ""
    return FdlError(f"download failed{after}: {'; '.join(failures)}", hint=hint)


def _http_client(urls: list[str], *, allow_http: bool, opt_in: str, timeout_s: float
                 ) -> contextlib.AbstractContextManager[Any]:
    """The HTTP client (:mod:`fdl.download.client`); none when every URL is a file."""
    if all(_is_file(url) for url in urls):
        return contextlib.nullcontext()
    return http_client(allow_http=allow_http, timeout_s=timeout_s, opt_in=opt_in)


def _is_file(url: str) -> bool:
    return urlparse(url).scheme.lower() == "file"


def _from_url(client: Any, url: str, part: PartFile, *, chunk_size: int,
              ranges: Ranges, min_rate: MinRate) -> None:
    """One attempt at ``url``; failures become ``_Transient`` or ``_RuledOut``, except a
    refused redirect, a file too large and a local write error (``FdlError``: stop)."""
    if _is_file(url):
        _copy_local(url, part, chunk_size=chunk_size)
        return
    import httpx

    try:
        _attempt(client, url, part, chunk_size=chunk_size, ranges=ranges, min_rate=min_rate)
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise _Transient(f"{exc or 'no detail'} ({type(exc).__name__})") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _RuledOut(str(exc)) from exc
    except OSError as exc:
        raise FdlError(f"download failed: cannot write {part.path}: {exc}",
                       hint="check free space and permissions there") from exc


def _copy_local(url: str, part: PartFile, *, chunk_size: int) -> None:
    source = Path(url2pathname(urlparse(url).path))
    try:
        with open(source, "rb") as src:
            total = os.fstat(src.fileno()).st_size
            part.restart()
            part.append(iter(lambda: src.read(chunk_size), b""), total=total,
                        batch_bytes=chunk_size)
    except OSError as exc:
        raise _RuledOut(f"{exc.strerror or exc}: {exc.filename or source}") from exc


def _attempt(client, url: str, part: PartFile, *, chunk_size: int, ranges: Ranges,
             min_rate: MinRate) -> None:
    """One GET, continuing the ``.part`` when the server honours the range; the missing ranges
    when the ``.part`` is a parallel download's, and a parallel download when it may be one.
    A server that offers ranges and then ignores them gets one stream, from the start."""
    try:
        _one_get(client, url, part, chunk_size=chunk_size, ranges=ranges, min_rate=min_rate)
    except RangesIgnored:
        _one_get(client, url, part, chunk_size=chunk_size,
                 ranges=dataclasses.replace(ranges, ranged=False), min_rate=min_rate)


def _one_get(client, url: str, part: PartFile, *, chunk_size: int, ranges: Ranges,
             min_rate: MinRate) -> None:
    """The missing ranges of a recorded parallel download, else one GET from the ``.part``'s
    end (a record that cannot be trusted empties the ``.part`` first)."""
    state = load_state(part.path)
    if state is not None and state.url != url and not ranges.verified:
        state = None  # another server's pieces, and no digest to check the whole against
    if state is not None:
        fetch_ranges(client, url, part, state, first=None, batch_bytes=chunk_size,
                     ranges=ranges)
        return
    if state_path(part.path).exists():  # a record not to be trusted (or not here): start over
        discard_state(part.path)
        part.restart()
    offset = part.offset()
    headers = {"Accept-Encoding": "identity"}  # the bytes as stored: what Content-Length counts
    if offset:
        headers["Range"] = f"bytes={offset}-"
    with client.stream("GET", url, headers=headers) as response:
        status = response.status_code
        if status == 416 and offset:  # the .part is not a prefix of what is served now
            part.restart()
            raise _Transient(f"HTTP 416: the server would not resume from byte {offset}")
        _check_status(status)
        start, total = _body_span(response)
        if status == 206 and start == offset:
            part.resumed = part.resumed or offset > 0
        elif start == 0:
            if offset:  # the server ignored the range: take the whole file again
                part.restart()
        else:
            part.restart()
            raise _Transient(f"the server sent a range from byte {start}, asked for {offset}")
        if status == 200 and offers_ranges(response, total, ranges):
            state = start_ranges(part, response, url=url, size=total, ranges=ranges)
            fetch_ranges(client, url, part, state, first=response, batch_bytes=chunk_size,
                         ranges=ranges)
            return
        part.append(min_rate.watched(response.iter_raw()), total=total, batch_bytes=chunk_size)
    if total is not None and part.size != total:
        raise _Transient(f"the server closed the connection after {part.size} of {total} bytes")


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
