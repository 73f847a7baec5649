"""Files several parts of fdl write and read: the one implementation of each primitive.

* :func:`write_atomic` / :func:`write_json_atomic` / :func:`atomic_replace` — the one way fdl
  replaces a file others may read (config.json, summary.json, metrics.jsonl, model.pt,
  checkpoint manifests, timeline and bench reports, the libtorch store's metadata). A reader
  sees the old file or the new one, never half of either; a write that fails (a value JSON
  cannot hold, a full disk) leaves the old one.
* :class:`JsonlAppender` / :func:`append_jsonl` — the one way fdl appends to a JSON-lines file
  (timelines, utilisation samples, metrics, bench results): one ``write`` per record, and
  opening makes sure the file ends with a newline first, so a record never glues onto the torn
  line a killed writer left (a resumed run's first event would be lost with it).
* :func:`read_jsonl` / :func:`scan_jsonl` — the records of such a file, tolerating the torn
  lines a killed writer leaves; :func:`scan_jsonl` also says which lines it skipped.
* :func:`hash_file` / :func:`sha256_file` — the one loop that reads a file to hash it (checkpoint
  manifests, cached datasets, a download resumed from the bytes already on disk)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_replace(path: Path) -> Iterator[Path]:
    """A unique temporary path beside ``path``, for writers that want a file name (e.g.
    ``torch.save``): renamed over ``path`` when the block ends normally, removed when it
    raises, so ``path`` holds the old file or the complete new one. Temporary names are
    ``.<name>.<random>.tmp`` (what fdl.rundir.layout recognises as leftovers of a kill)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; fdl's files are as readable as their dir
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> Path:
    """Write ``data`` to a unique temporary file beside ``path`` and rename it over ``path``;
    ``durable`` also flushes it to disk first (for what a crash must not lose). Returns
    ``path``. On any failure the temporary file is removed and ``path`` is left as it was."""
    with atomic_replace(path) as tmp, open(tmp, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    return path


def write_json_atomic(path: Path, document: Any, *, durable: bool = False) -> Path:
    """Write ``document`` as indented JSON and a newline with :func:`write_atomic`. Values JSON
    has no type for are written as ``str(value)``; a document that still cannot be serialised
    (a cycle, a key that is not a string or number) raises before ``path`` is touched."""
    return write_atomic(path, json.dumps(document, indent=2, default=str) + "\n",
                        durable=durable)


class JsonlAppender:
    """Appends JSON records to ``path``, one line each, creating the file if needed.

    Opening adds a newline when the file does not end with one (a writer killed mid-line), so
    the first record starts on a fresh line; each record is then written with one unbuffered
    ``write``, so a reader (or a crash) sees whole lines. ``durable`` fsyncs after every record
    (for a record that commits work, e.g. a bench cell). ``default`` is json.dumps's, for
    values JSON has no type for."""

    def __init__(self, path: Path, *, durable: bool = False,
                 default: Callable[[Any], Any] = str):
        self.path = Path(path)
        self._durable = durable
        self._default = default
        self._file: IO[bytes] | None = self.path.open("ab", buffering=0)
        try:
            if _ends_mid_line(self.path):
                self._file.write(b"\n")
        except BaseException:
            self.close()
            raise

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        data = memoryview((json.dumps(record, default=self._default) + "\n").encode("utf-8"))
        while data:  # a raw write may take less than all (a signal, a nearly full disk)
            written = self._file.write(data)
            if not written:
                raise OSError(f"cannot append to {self.path}")
            data = data[written:]
        if self._durable:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def append_jsonl(path: Path, record: dict[str, Any], *, durable: bool = False,
                 default: Callable[[Any], Any] = str) -> None:
    """Append one record to ``path`` on a line of its own (see :class:`JsonlAppender`)."""
    with JsonlAppender(path, durable=durable, default=default) as appender:
        appender.append(record)


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return False
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"


@dataclass
class JsonLines:
    """What :func:`scan_jsonl` found: the records (each a JSON object) with their 1-based line
    numbers, the lines skipped (not JSON, or not an object; blank lines are not counted), and
    ``error`` when the file could not be read at all (``missing`` for no such file)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    error: str | None = None


def scan_jsonl(path: Path) -> JsonLines:
    """The records of a JSON-lines file and what is wrong with it; never raises for a missing,
    unreadable or binary file (see :class:`JsonLines`)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return JsonLines(error="missing")
    except OSError as exc:
        return JsonLines(error=f"unreadable ({exc.strerror or exc})")
    return parse_jsonl(text)


def parse_jsonl(text: str) -> JsonLines:
    """The records of JSON-lines ``text`` (for a caller that reads the file its own way)."""
    found = JsonLines()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            found.records.append(record)
            found.line_numbers.append(number)
        else:
            found.bad_lines.append(number)
    return found


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, skipping lines that do not parse (a writer killed
    mid-line) or are not objects; empty when the file does not exist."""
    found = scan_jsonl(path)
    if found.error is not None and found.error != "missing":
        raise OSError(f"cannot read {path}: {found.error}")
    return found.records


def hash_file(path: Path, *, algorithms: Iterable[str] = ("sha256",),
              chunk_size: int = 1 << 20) -> dict[str, hashlib._Hash]:
    """Hash the bytes of ``path`` with each of ``algorithms`` (hashlib's names) in one read.

    Returns the running hashers, not their digests, so a caller can go on feeding them (a
    download resumed after the bytes already on disk). Raises ``ValueError`` for an unknown
    algorithm and ``OSError`` for an unreadable file."""
    hashers = {name: hashlib.new(name) for name in algorithms}
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            for hasher in hashers.values():
                hasher.update(chunk)
    return hashers


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    return hash_file(path)["sha256"].hexdigest()
