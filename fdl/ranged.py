"""A large file fetched over several connections at once, each a byte range written at its
offset in the ``.part``: a CDN that caps each connection's rate is then held to its cap times
the number of connections. Used by :mod:`fdl.download` when the server offers ranges.

* The pieces (:mod:`fdl.rangestate`) go to ``num_connections`` worker threads, first come first
  served; each asks ``Range: bytes=a-b`` with ``If-Range`` set to the file's validator, writes
  what arrives with ``os.pwritev`` and counts it done only once written.
* One more thread hashes the file in order as its written prefix grows, reading it back from
  the page cache, so the digest is ready soon after the last byte lands.
* The main thread reports progress (bytes across all connections) and saves the record every
  second; Ctrl-C saves it and leaves, so the next run fetches only what is missing.
* A response from another version of the file (a ``200`` to ``If-Range``, another ``ETag``,
  ``Last-Modified`` or size) stops every worker and raises :class:`FileChanged`: the caller
  discards the ``.part`` and its record, so a file is never assembled from two versions.
* A worker whose connection fails leaves its piece part done; the others go on, and the first
  failure is raised once they are through, for the caller's retry round to resume.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.partfile import PartFile, Progress
from fdl.rangestate import RangeState, discard_state, plan_state, save_state

_SAVE_EVERY_S = 1.0
_HASH_BLOCK = 4 << 20


class Transient(Exception):
    """A failure worth retrying (short body, 5xx, 429, a range the server would not serve)."""


class RuledOut(Exception):
    """This URL will not serve the file (HTTP 404, 403, ..., an unreadable file:// path)."""


class FileChanged(Transient):
    """The server answered from another version of the file than the pieces on disk."""


class RangesIgnored(Transient):
    """The server offered ranges, then answered a range request with the whole file."""


def check_status(status: int) -> None:
    if status in (200, 206):
        return
    if status == 429 or status >= 500:
        raise Transient(f"HTTP {status}")
    raise RuledOut(f"HTTP {status}")


@dataclass(frozen=True)
class Ranges:
    """When and how wide a download goes parallel."""

    num_connections: int
    min_bytes: int  # smaller files come in one stream
    # An expected digest will check the assembled file: pieces from another mirror of it may be
    # kept. Without one, a record made against another URL is not resumed (two servers' bytes).
    verified: bool = False


def offers_ranges(response: Any, total: int | None, ranges: Ranges) -> bool:
    """Whether this ``200`` from byte 0 may be fetched in ranges instead: large enough, with a
    length, ``Accept-Ranges: bytes`` and a validator for ``If-Range``."""
    etag = response.headers.get("ETag") or ""
    return (ranges.num_connections > 1 and total is not None and total >= ranges.min_bytes
            and response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
            and bool((etag and not etag.startswith("W/"))
                     or response.headers.get("Last-Modified")))


def start_ranges(part: PartFile, response: Any, *, url: str, size: int,
                 ranges: Ranges) -> RangeState:
    """A fresh record for ``response``'s file, and the ``.part`` sized for it."""
    etag, modified = validators(response)
    state = plan_state(url=url, size=size, etag=etag, last_modified=modified,
                       num_connections=ranges.num_connections,
                       min_piece_bytes=ranges.min_bytes // 8)  # 8 MiB by default
    part.check_size(size)
    part.restart()
    save_state(part.path, state)  # first the record, then the size it claims
    os.truncate(part.path, size)
    return state


def fetch_ranges(client: Any, url: str, part: PartFile, state: RangeState, *, first: Any,
                 num_connections: int, batch_bytes: int) -> None:
    """Fill ``part`` in ranges (:class:`RangedFetch`) and give it the hashes. On
    ``FileChanged`` or ``RangesIgnored`` the ``.part`` and its record are discarded first."""
    part.check_size(state.size)
    resumed = state.done_bytes > 0
    if state.url != url:  # a mirror of the same file: its validators are its own
        state.url, state.etag, state.last_modified = url, None, None
    fetch = RangedFetch(client, part.path, state, algorithms=part.algorithms,
                        num_connections=num_connections, batch_bytes=batch_bytes,
                        progress=part.progress)
    try:
        fetch.run(first)
    except (FileChanged, RangesIgnored):
        discard_state(part.path)
        part.restart()
        raise
    part.adopt(fetch.hashers, size=state.size, resumed=resumed)


def validators(response: Any) -> tuple[str | None, str | None]:
    """The response's (ETag, Last-Modified)."""
    return response.headers.get("ETag"), response.headers.get("Last-Modified")


class RangedFetch:
    """Fill ``part`` (already ``state.size`` bytes long) with the pieces ``state`` lacks."""

    def __init__(self, client: Any, part: Path, state: RangeState, *, algorithms: tuple[str, ...],
                 num_connections: int, batch_bytes: int, progress: Progress | None):
        self.client, self.part, self.state = client, part, state
        self.num_connections = num_connections
        self.batch_bytes = batch_bytes
        self.progress = progress
        self.hashers = {name: hashlib.new(name) for name in algorithms}
        self._cond = threading.Condition()
        self._todo = deque(i for i, piece in enumerate(state.pieces) if not piece.complete)
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self._running = 0

    def run(self, first: Any = None) -> None:
        """Fetch every missing piece; ``first`` is an open ``200`` response from byte 0 that
        serves the first piece. Returns when the file is complete and hashed; raises the first
        worker failure (``FileChanged`` or ``RangesIgnored`` before any other) otherwise."""
        fd = os.open(self.part, os.O_RDWR)
        firsts: list[tuple[Any, int] | None] = [None] * min(self.num_connections, len(self._todo))
        if first is not None and firsts and self._todo[0] == 0:
            firsts[0] = (first, self._todo.popleft())
        workers = [threading.Thread(target=self._work, args=(fd, given), daemon=True)
                   for given in firsts]
        hasher = threading.Thread(target=self._hash, args=(fd,), daemon=True)
        self._running = len(workers)
        for thread in [*workers, hasher]:
            thread.start()
        try:
            self._watch()
            if not self._errors:
                hasher.join()
        except BaseException:  # Ctrl-C: record what is on disk and leave; the workers are
            self._halt()       # daemons, and the fd stays open for a straggler's last write
            save_state(self.part, self.state)
            raise
        self._halt()
        hasher.join()
        os.close(fd)  # every worker is through: nothing writes to it any more
        if self._errors:
            save_state(self.part, self.state)
            changed = [e for e in self._errors if isinstance(e, FileChanged | RangesIgnored)]
            raise (changed or self._errors)[0]

    def _halt(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _watch(self) -> None:
        """Report progress and save the record until the workers are through."""
        saved_at = time.monotonic()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running == 0, timeout=0.2)
                running, done = self._running, self.state.done_bytes
            if self.progress is not None:
                self.progress(done, self.state.size)
            if not running:
                return
            if time.monotonic() - saved_at >= _SAVE_EVERY_S:
                with self._cond:
                    save_state(self.part, self.state)
                saved_at = time.monotonic()

    def _work(self, fd: int, given: tuple[Any, int] | None) -> None:
        try:
            if given is not None:
                response, index = given
                self._drain(fd, response, index)
                self._check_complete(index)
            while not self._stop.is_set():
                with self._cond:
                    if not self._todo:
                        return
                    index = self._todo.popleft()
                self._fetch(fd, index)
                self._check_complete(index)
        except BaseException as exc:
            if isinstance(exc, FileChanged | RangesIgnored):
                self._halt()
            with self._cond:
                self._errors.append(exc)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _check_complete(self, index: int) -> None:
        piece = self.state.pieces[index]
        if not piece.complete and not self._stop.is_set():
            raise Transient(f"the server closed the connection after {piece.done} of "
                            f"{piece.end - piece.start} bytes of the range from byte "
                            f"{piece.start}")

    def _fetch(self, fd: int, index: int) -> None:
        piece = self.state.pieces[index]
        begin = piece.start + piece.done
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={begin}-{piece.end - 1}"}
        if_range = self.state.if_range()
        if if_range:
            headers["If-Range"] = if_range
        with self.client.stream("GET", self.state.url, headers=headers) as response:
            if response.status_code == 416:
                raise FileChanged(f"HTTP 416: the file no longer has bytes from {begin}")
            check_status(response.status_code)
            self._check_same_file(response, begin)
            self._drain(fd, response, index)

    def _check_same_file(self, response: Any, begin: int) -> None:
        """``FileChanged`` unless ``response`` is the asked range of the recorded version."""
        got = validators(response)
        with self._cond:
            recorded = (self.state.etag, self.state.last_modified)
            if recorded == (None, None):  # a mirror's first answer: learn its validators
                self.state.etag, self.state.last_modified = recorded = got
        if got != recorded:
            raise FileChanged(f"the file changed on the server during the download (ETag, "
                              f"Last-Modified {recorded} became {got})")
        if response.status_code != 206:
            raise RangesIgnored("the server answered a range request with the whole file")
        spec = response.headers.get("Content-Range", "")
        if not (spec.startswith(f"bytes {begin}-") and spec.endswith(f"/{self.state.size}")):
            raise FileChanged(f"HTTP 206 with Content-Range {spec!r}, asked for bytes from "
                              f"{begin} of a {self.state.size}-byte file")

    def _drain(self, fd: int, response: Any, index: int) -> None:
        """Write the body at the piece's offset, never past its end; keep what arrived."""
        piece = self.state.pieces[index]
        pos = piece.start + piece.done
        batch: list[bytes] = []
        pending = 0
        try:
            for chunk in response.iter_raw():
                if self._stop.is_set():
                    return
                room = piece.end - pos - pending
                batch.append(chunk if len(chunk) <= room else chunk[:room])
                pending += min(len(chunk), room)
                if pending >= self.batch_bytes or pending == piece.end - pos:
                    pos = self._write(fd, batch, pos, index)
                    batch, pending = [], 0
                if pos >= piece.end:
                    return
        finally:
            if batch and not self._stop.is_set():
                self._write(fd, batch, pos, index)

    def _write(self, fd: int, batch: list[bytes], pos: int, index: int) -> int:
        size = sum(map(len, batch))
        written = os.pwritev(fd, batch, pos)
        if written < size:  # rare (a signal, a full disk): write the rest, or fail
            rest = b"".join(batch)[written:]
            while rest:
                count = os.pwrite(fd, rest, pos + size - len(rest))
                if count <= 0:
                    raise OSError(f"wrote no bytes at offset {pos + size - len(rest)}")
                rest = rest[count:]
        with self._cond:
            self.state.pieces[index].done += size
            self._cond.notify_all()
        return pos + size

    def _hash(self, fd: int) -> None:
        """Hash the file in order as its written prefix grows; a failure (a ``.part`` cut short
        behind our back) is the fetch's failure, never a digest of part of the file."""
        try:
            self._hash_prefix(fd)
        except BaseException as exc:
            with self._cond:
                self._errors.append(exc)

    def _hash_prefix(self, fd: int) -> None:
        buffer = bytearray(_HASH_BLOCK)
        view = memoryview(buffer)
        pos, size = 0, self.state.size
        hashers = list(self.hashers.values())
        while pos < size:
            with self._cond:
                self._cond.wait_for(lambda at=pos: self._prefix() > at or self._stop.is_set())
                if self._stop.is_set():
                    return
                ready = self._prefix()
            while pos < ready:
                n = os.preadv(fd, [view[:min(_HASH_BLOCK, ready - pos)]], pos)
                if n <= 0:
                    raise OSError(f"{self.part} ends at byte {pos}, before its {size} bytes")
                for hasher in hashers:
                    hasher.update(view[:n])
                pos += n

    def _prefix(self) -> int:
        """How far from byte 0 the file is written without a gap."""
        for piece in self.state.pieces:
            if not piece.complete:
                return piece.start + piece.done
        return self.state.size
