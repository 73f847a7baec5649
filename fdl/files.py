"""Files several parts of fdl write and read: the one implementation of each primitive.

* :func:`write_atomic` / :func:`write_json_atomic` / :func:`atomic_replace` — the one way fdl
  replaces a file others may read (config.json, summary.json, metrics.jsonl, model.pt,
  checkpoint manifests, timeline and bench reports, the libtorch store's metadata). A reader
  sees the old file or the new one, never half of either; a write that fails (a value JSON
  cannot hold, a full disk) leaves the old one. A symbolic link planted at ``path`` is
  replaced by the new file (``os.replace`` renames over the link itself), never written through.
* :func:`open_for_writing` — the one way fdl opens one of its own files to write or append in
  place (run logs, a compare cell's log, the JSON-lines files below): never through a symbolic
  link at the last component (``O_NOFOLLOW``) and only a regular file; anything else there is a
  :class:`~fdl.errors.UsageError` naming the file, and its target is not touched.
  :func:`output_dir_problem` says, without writing, why a directory named by the user
  (``--tensorboard DIR``, ``--out DIR``) could not take fdl's files.
* :class:`JsonlAppender` / :func:`append_jsonl` — the one way fdl appends to a JSON-lines file
  (timelines, utilisation samples, metrics, bench results): one ``write`` per record, and
  opening makes sure the file ends with a newline first, so a record never glues onto the torn
  line a killed writer left (a resumed run's first event would be lost with it).
* :func:`read_jsonl` / :func:`scan_jsonl` — the records of such a file, tolerating the torn
  lines a killed writer leaves; :func:`scan_jsonl` also says which lines it skipped.
* :func:`hash_file` / :func:`sha256_file` — the one loop that reads a file to hash it (checkpoint
  manifests, cached datasets, a download resumed from the bytes already on disk)."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fdl import readback
from fdl.errors import UsageError

LINK_HINT = "remove it (fdl writes its file anew), or use another directory"
# Where no directory fdl writes into can be: the kernel's pseudo-filesystems (a --tensorboard
# under /proc fails inside the workers, after training started).
SYSTEM_DIRS = (Path("/proc"), Path("/sys"))


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


def finite_json(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, an infinity) replaced by None, in
    lists and dicts: what strict JSON (``allow_nan=False``) can hold, ``null`` where a figure
    could not be measured."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def write_json_atomic(path: Path, document: Any, *, durable: bool = False) -> Path:
    """Write ``document`` as indented JSON and a newline with :func:`write_atomic`. Values JSON
    has no type for are written as ``str(value)``; a document that still cannot be serialised
    (a cycle, a key that is not a string or number) raises before ``path`` is touched."""
    return write_atomic(path, json.dumps(document, indent=2, default=str) + "\n",
                        durable=durable)


def open_for_writing(path: Path, *, append: bool = False,
                     encoding: str | None = None) -> IO[Any]:
    """``path`` opened to write (emptied first) or, with ``append``, to add to its end; created
    (0644 less the umask) when absent. Binary and unbuffered, or text in ``encoding``.

    Never through a symbolic link at the last component: ``O_NOFOLLOW`` makes the kernel refuse
    one, so a link planted where fdl writes its own file (``logs/rank0.log`` pointing at a
    user's file) is a :class:`UsageError` naming ``path`` and the link's target is not touched.
    Anything but a regular file is refused the same way (``O_NONBLOCK``: a FIFO there never
    blocks the writer). Other failures are the usual ``OSError``."""
    flags = (os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
             | (os.O_APPEND if append else os.O_TRUNC))
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):  # O_NOFOLLOW's refusal
            raise UsageError(f"{path} is a symbolic link; fdl does not write its files "
                             "through a link", hint=LINK_HINT) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is not a regular file; fdl writes its files only as regular "
                         "files", hint=LINK_HINT)
    os.set_blocking(fd, True)
    if encoding is None:
        return os.fdopen(fd, "ab" if append else "wb", buffering=0)
    return os.fdopen(fd, "a" if append else "w", encoding=encoding)


def named_path(path: Path) -> Path:
    """``path`` made absolute with its parents resolved but its last component kept as named:
    a symbolic link there stays a link, for the check that refuses one (a run directory),
    where ``Path.resolve`` would silently follow it."""
    absolute = Path(os.path.abspath(path))
    return absolute.parent.resolve() / absolute.name if absolute.name else absolute


def output_dir_problem(path: Path) -> str | None:
    """Why fdl could not write files into the directory ``path`` (made when absent), or None.
    Reads only, so ``--dry-run`` can ask too: ``path`` or, when it does not exist yet, its
    nearest existing parent must be a writable directory, outside :data:`SYSTEM_DIRS`. The
    answer completes a sentence about ``path``: "is not a directory", "is under the file ..."."""
    target = Path(os.path.abspath(path))
    try:
        return _dir_problem(target)
    except OSError as exc:  # a name too long, a parent that cannot be searched
        return f"cannot be used: {exc.strerror or exc}"


def _dir_problem(target: Path) -> str | None:
    real = Path(os.path.realpath(target))
    system = next((d for d in SYSTEM_DIRS if real == d or d in real.parents), None)
    if system is not None:
        return f"is in {system}, where no files can be written"
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "is not a directory" if existing == target else f"is under the file {existing}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == target \
            else f"cannot be made: {existing} is not writable"
    return None


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
        self._file: IO[bytes] | None = open_for_writing(self.path, append=True)
        try:
            if _ends_mid_line(self._file.fileno()):
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


def _ends_mid_line(fd: int) -> bool:
    """Whether the file open as ``fd`` (readable) ends without a newline: read through the
    descriptor, not the path, so it is the very file that was opened."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


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
    unreadable or binary file, nor for one fdl would not read (a FIFO, a link, beyond
    ``readback.JSONL_BYTES``: see :mod:`fdl.readback` and :class:`JsonLines`)."""
    try:
        data = readback.read_bytes(path, limit=readback.JSONL_BYTES)
    except FileNotFoundError:
        return JsonLines(error="missing")
    except readback.ReadBackError as exc:
        return JsonLines(error=f"unreadable ({exc.problem})")
    except OSError as exc:
        return JsonLines(error=f"unreadable ({exc.strerror or exc})")
    return parse_jsonl(data.decode("utf-8", errors="replace"))


def parse_jsonl(text: str) -> JsonLines:
    """The records of JSON-lines ``text`` (for a caller that reads the file its own way)."""
    found = JsonLines()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = readback.parse_json(line)
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
    algorithm and ``OSError`` for an unreadable file (``ValueError`` for one that is not a
    regular file: a FIFO would never end)."""
    hashers = {name: hashlib.new(name) for name in algorithms}
    with readback.open_regular(path, follow=True) as handle:
        while chunk := handle.read(chunk_size):
            for hasher in hashers.values():
                hasher.update(chunk)
    return hashers


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    return hash_file(path)["sha256"].hexdigest()
