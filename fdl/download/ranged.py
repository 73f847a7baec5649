"""A large file fetched over several connections at once, each a byte range written at its
offset in the ``.part``: a CDN that caps each connection's rate is then held to its cap times
the number of connections. Used by :mod:`fdl.download.fetch` when the server offers ranges.

* The pieces (:mod:`fdl.download.ranges`) go to worker threads, one connection each, first come
  first served; each asks ``Range: bytes=a-b`` with ``If-Range`` set to the file's validator,
  writes what arrives with ``os.pwritev`` and counts it done only once written. The first
  answer (the whole file from byte 0) serves the first piece, and the ones after it while its
  connection is the only one.
* How many connections: ``num_connections`` from the start, or, ``adaptive``, one, and then
  every quarter second as many again (up to ``num_connections``) while each open one spent less
  than half of that time on its CPU (:func:`more_connections`). A connection held back by the
  link (a per-connection cap, a long path) waits on the network and gets company; one held back
  by this machine's CPU (a fast local mirror) keeps a core busy, and a second would only
  compete with it.
* One more thread hashes the file in order as its written prefix grows, reading it back from
  the page cache, so the digest is ready soon after the last byte lands. (Hashing the batches
  from memory instead, as they are written in order, was tried and not kept: it was no faster
  in A/B runs, and it holds up to a window of batches in memory; docs/libtorch.md "Verified
  here".)
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.download.partfile import PartFile, Progress
from fdl.download.ranges import RangeState, discard_state, if_range_value, plan_state, save_state

_SAVE_EVERY_S = 1.0
_HASH_BLOCK = 4 << 20
_WATCH_EVERY_S = 0.1
# An adaptive download looks at its connections this often, and opens more while each spent
# less than this fraction of the time on its CPU (the rest waiting for the network).
_RAMP_EVERY_S = 0.25
_WAITING_BELOW = 0.5


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

    num_connections: int  # at most this many at once
    min_bytes: int  # smaller files come in one stream
    # Open one connection, and more while they wait on the network (:func:`more_connections`);
    # else all of them from the start.
    adaptive: bool = False
    # False: one plain stream whatever the server offers (it answered a range with the whole
    # file once). With one connection and ranges, the file still comes in one request, but
    # with a record, so that a resume asks If-Range and never mixes two versions.
    ranged: bool = True
    # An expected digest will check the assembled file: pieces from another mirror of it may be
    # kept. Without one, a record made against another URL is not resumed (two servers' bytes).
    verified: bool = False


def offers_ranges(response: Any, total: int | None, ranges: Ranges) -> bool:
    """Whether this ``200`` from byte 0 may be fetched in ranges instead: large enough, with a
    length, ``Accept-Ranges: bytes`` and a validator for ``If-Range``."""
    return (ranges.ranged and total is not None and total >= ranges.min_bytes
            and response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
            and if_range_value(*validators(response)) is not None)


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
                 ranges: Ranges, batch_bytes: int) -> None:
    """Fill ``part`` in ranges (:class:`RangedFetch`) and give it the hashes. On
    ``FileChanged`` or ``RangesIgnored`` the ``.part`` and its record are discarded first."""
    part.check_size(state.size)
    resumed = state.done_bytes > 0
    if state.url != url:  # a mirror of the same file: its validators are its own
        state.url, state.etag, state.last_modified = url, None, None
    fetch = RangedFetch(client, part.path, state, algorithms=part.algorithms,
                        num_connections=ranges.num_connections, batch_bytes=batch_bytes,
                        progress=part.progress, adaptive=ranges.adaptive)
    try:
        fetch.run(first)
    except (FileChanged, RangesIgnored):
        discard_state(part.path)
        part.restart()
        raise
    part.adopt(fetch.hashers, size=state.size, resumed=resumed,
               connections=fetch.most_connections)


def validators(response: Any) -> tuple[str | None, str | None]:
    """The response's (ETag, Last-Modified)."""
    return response.headers.get("ETag"), response.headers.get("Last-Modified")


def more_connections(*, running: int, maximum: int, pieces_left: int,
                     busy: list[float]) -> int:
    """How many connections an adaptive download opens now: as many again as are ``running``
    (at most ``maximum`` in all, and no more than the pieces nobody has taken) when each of
    them spent less than half of the last window on its CPU (``busy``, 0 to 1), that is, mostly
    waiting for the network; else none. A connection that keeps its CPU busy is held back by
    this machine, and another one would only compete with it for the same cores."""
    if not busy or running >= maximum or any(b >= _WAITING_BELOW for b in busy):
        return 0
    return max(0, min(running, maximum - running, pieces_left))


@dataclass
class _CpuClock:
    """A worker thread's CPU time (``time.thread_time``), as of its last write."""

    now_s: float = 0.0
    window_s: float = 0.0  # at the start of the controller's window
    done: bool = False


class RangedFetch:
    """Fill ``part`` (already ``state.size`` bytes long) with the pieces ``state`` lacks."""

    def __init__(self, client: Any, part: Path, state: RangeState, *, algorithms: tuple[str, ...],
                 num_connections: int, batch_bytes: int, progress: Progress | None,
                 adaptive: bool = False):
        self.client, self.part, self.state = client, part, state
        self.num_connections = num_connections
        self.adaptive = adaptive
        self.batch_bytes = batch_bytes
        self.progress = progress
        self.hashers = {name: hashlib.new(name) for name in algorithms}
        self.most_connections = 0  # the most connections open at once, for the caller to tell
        self._cond = threading.Condition()
        self._todo = deque(i for i, piece in enumerate(state.pieces) if not piece.complete)
        self._errors: list[BaseException] = []
        self._stop = threading.Event()
        self._running = 0
        self._clocks: list[_CpuClock] = []
        self._fd = -1
        self._fd_users = 0  # threads that may still read or write it: the workers, the hasher
        self._abandoned = False  # run() left early (Ctrl-C): the last user closes the fd

    def run(self, first: Any = None) -> None:
        """Fetch every missing piece; ``first`` is an open ``200`` response from byte 0 that
        serves the first piece (and the ones after it, while no other connection has taken
        them). Returns when the file is complete and hashed; raises the first worker failure
        (``FileChanged`` or ``RangesIgnored`` before any other) otherwise."""
        self._fd = os.open(self.part, os.O_RDWR)
        opening = 1 if self.adaptive else self.num_connections
        given = None
        if first is not None and self._todo and self._todo[0] == 0:
            given = (first, self._todo.popleft())
        hasher = threading.Thread(target=self._hash, daemon=True)
        self._fd_users += 1
        hasher.start()
        self._open(min(opening, len(self._todo) + (given is not None)), given)
        try:
            self._watch()
            if not self._errors:
                hasher.join()
        except BaseException:  # Ctrl-C: record what is on disk and leave. The workers are
            self._halt()       # daemons; the fd stays open until the last of them is through
            try:
                self._save()
            finally:
                self._abandon_fd()
            raise
        self._halt()
        hasher.join()
        if self._errors:
            self._save()
        os.close(self._fd)  # every worker is through: nothing writes to it any more
        if self._errors:
            changed = [e for e in self._errors if isinstance(e, FileChanged | RangesIgnored)]
            raise (changed or self._errors)[0]

    def _save(self) -> None:
        """Record the pieces on disk. The bytes the record counts are flushed to the disk
        first, so that not even a power cut leaves a record claiming bytes the disk lost
        (libtorch archives come with no published digest to catch them at the end)."""
        with self._cond:
            record = self.state.to_dict()
        _datasync(self._fd)
        save_state(self.part, record)

    def _abandon_fd(self) -> None:
        """Leave the fd to the threads still using it: the last one through closes it (a
        worker may still write what it has read; closed early, the number could be reused
        by another file and written to)."""
        with self._cond:
            self._abandoned = True
            if self._fd_users == 0:
                os.close(self._fd)

    def _leave_fd(self) -> None:
        """A worker or the hasher is through with the fd (call with the lock held)."""
        self._fd_users -= 1
        if self._fd_users == 0 and self._abandoned:
            os.close(self._fd)

    def _open(self, count: int, given: tuple[Any, int] | None = None) -> None:
        """Start ``count`` workers, the first of them on ``given``."""
        for i in range(count):
            clock = _CpuClock()
            thread = threading.Thread(target=self._work, args=(clock, given if i == 0 else None),
                                      daemon=True)
            with self._cond:
                self._running += 1
                self._fd_users += 1
                self._clocks.append(clock)
                self.most_connections = max(self.most_connections, self._running)
            thread.start()

    def _halt(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _watch(self) -> None:
        """Report progress, save the record and (adaptive) open more connections until the
        workers are through."""
        saved_at = window_at = time.monotonic()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running == 0, timeout=_WATCH_EVERY_S)
                running, done = self._running, self.state.done_bytes
            if self.progress is not None:
                self.progress(done, self.state.size)
            if not running:
                return
            now = time.monotonic()
            if self.adaptive and now - window_at >= _RAMP_EVERY_S:
                self._ramp(now - window_at)
                window_at = now
            if now - saved_at >= _SAVE_EVERY_S:
                self._save()
                saved_at = time.monotonic()

    def _ramp(self, window_s: float) -> None:
        """Open more connections when the running ones wait on the network
        (:func:`more_connections`)."""
        with self._cond:
            clocks = [c for c in self._clocks if not c.done]
            busy = [(c.now_s - c.window_s) / window_s for c in clocks]
            for clock in clocks:
                clock.window_s = clock.now_s
            count = more_connections(running=self._running, maximum=self.num_connections,
                                     pieces_left=len(self._todo), busy=busy)
        if count and not self._stop.is_set():
            self._open(count)

    def _work(self, clock: _CpuClock, given: tuple[Any, int] | None) -> None:
        clock.now_s = clock.window_s = time.thread_time()
        try:
            if given is not None:
                self._stream(clock, *given)
            while not self._stop.is_set():
                with self._cond:
                    if not self._todo:
                        return
                    index = self._todo.popleft()
                self._fetch(clock, index)
                self._check_complete(index)
        except BaseException as exc:
            if isinstance(exc, FileChanged | RangesIgnored):
                self._halt()
            with self._cond:
                self._errors.append(exc)
        finally:
            with self._cond:
                clock.done = True
                self._running -= 1
                self._leave_fd()
                self._cond.notify_all()

    def _stream(self, clock: _CpuClock, response: Any, index: int) -> None:
        """Drain the first response (the file from byte 0) into piece ``index``, and on into
        the pieces after it while this is the only connection (one request for the whole file
        where one connection is enough); then close it, so that the server stops sending what
        other connections fetch."""
        body = _Body(response.iter_raw())
        try:
            while True:
                self._drain(clock, body, index)
                self._check_complete(index)
                with self._cond:
                    alone = self._running == 1 and not self._stop.is_set()
                    untouched = bool(self._todo) and self._todo[0] == index + 1 \
                        and self.state.pieces[index + 1].done == 0  # the body goes on there
                    if not (alone and untouched):
                        return
                    index = self._todo.popleft()
        finally:
            response.close()

    def _check_complete(self, index: int) -> None:
        piece = self.state.pieces[index]
        if not piece.complete and not self._stop.is_set():
            raise Transient(f"the server closed the connection after {piece.done} of "
                            f"{piece.end - piece.start} bytes of the range from byte "
                            f"{piece.start}")

    def _fetch(self, clock: _CpuClock, index: int) -> None:
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
            self._drain(clock, _Body(response.iter_raw()), index)

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

    def _drain(self, clock: _CpuClock, body: _Body, index: int) -> None:
        """Write the body at the piece's offset up to the piece's end (what arrives past it
        stays in ``body``); keep what arrived before a failure."""
        piece = self.state.pieces[index]
        pos = piece.start + piece.done
        batch: list[bytes] = []
        pending = 0
        try:
            for chunk in body.upto(piece.end - pos):
                if self._stop.is_set():
                    return
                batch.append(chunk)
                pending += len(chunk)
                if pending >= self.batch_bytes:
                    pos = self._write(clock, batch, pos, index)
                    batch, pending = [], 0
        finally:
            if batch and not self._stop.is_set():
                self._write(clock, batch, pos, index)

    def _write(self, clock: _CpuClock, batch: list[bytes], pos: int, index: int) -> int:
        size = sum(map(len, batch))
        written = os.pwritev(self._fd, batch, pos)
        if written < size:  # rare (a signal, a full disk): write the rest, or fail
            rest = b"".join(batch)[written:]
            while rest:
                count = os.pwrite(self._fd, rest, pos + size - len(rest))
                if count <= 0:
                    raise OSError(f"wrote no bytes at offset {pos + size - len(rest)}")
                rest = rest[count:]
        clock.now_s = time.thread_time()
        with self._cond:
            self.state.pieces[index].done += size
            self._cond.notify_all()
        return pos + size

    def _hash(self) -> None:
        """Hash the file in order as its written prefix grows; a failure (a ``.part`` cut short
        behind our back) is the fetch's failure, never a digest of part of the file."""
        try:
            self._hash_prefix(self._fd)
        except BaseException as exc:
            with self._cond:
                self._errors.append(exc)
        finally:
            with self._cond:
                self._leave_fd()

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


def _datasync(fd: int) -> None:
    """Flush ``fd``'s data to the disk (``fsync`` where there is no ``fdatasync``: macOS)."""
    getattr(os, "fdatasync", os.fsync)(fd)


class _Body:
    """A response body's chunks, handed out a piece at a time: what arrives past a piece's end
    is kept for the next piece."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._left = b""

    def upto(self, count: int) -> Iterator[bytes]:
        """The next ``count`` bytes (fewer when the body ends first), in chunks."""
        while count > 0:
            chunk = self._left or next(self._chunks, b"")
            self._left = b""
            if not chunk:
                return
            if len(chunk) > count:
                chunk, self._left = chunk[:count], chunk[count:]
            count -= len(chunk)
            yield chunk
