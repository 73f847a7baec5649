"""The staging file a download streams into: ``<dest>.part``, hashed as bytes are appended.

:class:`PartFile` keeps running hashes (several algorithms in one pass) of what it holds, so the
digest is ready when the last byte lands; after an interruption it re-hashes the bytes already
on disk (:func:`fdl.files.hash_file`) and appending goes on from there. Writing and hashing run
in threads beside the caller's reads (:class:`Fanout`). A file growing past ``max_bytes``
raises :class:`TooLarge`. Used by :mod:`fdl.download.fetch` (and :mod:`fdl.download.ranged`,
which fills it in ranges) only; a module of its own to keep the download's retry and mirror
logic readable in one screen."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from fdl.errors import FdlError
from fdl.files import hash_file

Progress = Callable[[int, int | None], None]


class TooLarge(FdlError):
    """The file is larger than the caller allows: never retried, its ``.part`` is deleted."""


class PartFile:
    """The ``.part`` staging file and the running hashes of the bytes in it."""

    def __init__(self, path: Path, *, algorithms: Iterable[str], progress: Progress | None,
                 max_bytes: int | None = None):
        self.path = path
        self.algorithms = tuple(sorted(algorithms))
        self.progress = progress
        self.max_bytes = max_bytes
        self.size = 0
        self.resumed = False
        self.connections = 1  # the most connections that filled it at once
        self._hashers: dict[str, hashlib._Hash] | None = None

    def offset(self) -> int:
        """Bytes already on disk, hashed (again, if the running hashes do not cover them)."""
        on_disk = self.path.stat().st_size if self.path.exists() else 0
        if self._hashers is None or on_disk != self.size:
            self._hashers = hash_file(self.path, algorithms=self.algorithms) if on_disk \
                else {name: hashlib.new(name) for name in self.algorithms}
            self.size = on_disk
        return on_disk

    def restart(self) -> None:
        """Empty the staging file: the next bytes written are the file's first."""
        self.path.write_bytes(b"")
        self._hashers, self.size, self.resumed = None, 0, False
        self.offset()

    def append(self, chunks: Iterable[bytes], *, total: int | None, batch_bytes: int) -> None:
        """Write ``chunks`` after the bytes on disk, hashing and reporting progress."""
        self.offset()
        self.check_size(total or 0)
        hashers = list(self._hashers.values())

        def hash_batch(batch: list[bytes]) -> None:
            for chunk in batch:
                for hasher in hashers:
                    hasher.update(chunk)

        pending: list[bytes] = []
        pending_bytes = 0
        with open(self.path, "ab") as f, Fanout([f.writelines, hash_batch]) as fanout:
            try:
                for chunk in chunks:
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    self.check_size(self.size + pending_bytes)
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

    def check_size(self, size: int) -> None:
        if self.max_bytes is not None and size > self.max_bytes:
            raise TooLarge(f"refusing a download of more than {self.max_bytes} bytes "
                            f"(the size limit): {self.path.name} is at least {size} bytes",
                            hint="a libtorch archive is a few GB; if this one is genuine, "
                                 "raise FDL_MAX_EXTRACT_BYTES (e.g. 64G)")

    def adopt(self, hashers: dict[str, hashlib._Hash], *, size: int, resumed: bool,
              connections: int) -> None:
        """Take the hashes of a file filled by someone else (a parallel download, which hashes
        as its pieces land, over up to ``connections`` connections at once) as this one's:
        ``size`` bytes, all of them hashed."""
        self._hashers, self.size, self.resumed = hashers, size, resumed
        self.connections = connections

    def _hand_over(self, fanout: Fanout, batch: list[bytes]) -> None:
        fanout.put(batch)
        self.size += sum(map(len, batch))

    def _report(self, total: int | None) -> None:
        if self.progress is not None:
            self.progress(self.size, total)

    def hexdigests(self) -> dict[str, str]:
        assert self._hashers is not None
        return {name: hasher.hexdigest() for name, hasher in self._hashers.items()}


class Fanout:
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

    def __enter__(self) -> Fanout:
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
