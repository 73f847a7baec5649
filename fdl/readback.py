"""The one guarded way fdl reads back a file it did not just write.

Run directories, checkpoint manifests, bench and compare results, the libtorch store's
metadata, ``fdl.toml`` and the survey fixture may all have been edited, torn or planted by
someone else, so every read goes through here:

* **a regular file only**: opened with ``O_NONBLOCK`` and checked with ``fstat`` before a byte
  is read, so a FIFO never hangs fdl and ``/dev/zero`` never fills its memory;
* **no final symlink** where fdl owns the file (``follow=False``, the default): a link planted
  in a run directory is refused, not read through; a file the user names (``fdl.toml``, a
  survey file) may be a link (``follow=True``) and must still be a regular file;
* **a size cap per contract** (the ``*_BYTES`` limits below, what fdl itself writes with room
  to spare);
* **JSON with a depth cap** (:data:`MAX_DEPTH`), and number literals that do not fit a double
  (``1e400``) or 64 bits (a 400-digit integer) refused at parse time, so no later arithmetic
  meets an ``OverflowError`` from them. Each field's own range (finite, at most so much) is its
  reader's business: ``NaN`` is what fdl writes for a diverged loss.

Every refusal is a :class:`ReadBackError` that names the file and what was wrong (its
``problem`` always reads after the file's name: "is a FIFO, not a regular file"). It is a
``ValueError`` so a reader that already skips a malformed file skips these too; a reader that
must stop turns it into a ``UsageError`` with its own hint. A missing file is the usual
``FileNotFoundError``.

This lives in the base layer, not in ``fdl.rundir``, because the libtorch store, the survey
fixture and the config file are read the same way and may not import the run directory layer.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

MAX_DEPTH = 64  # fdl's deepest document (a summary's nested figures) is under 8
SMALL_BYTES = 1 << 20  # config.json, manifests, variant.json, fdl.toml, plan.json, crash records
DOCUMENT_BYTES = 64 << 20  # summary.json, bench reports: a long run's per-round history
JSONL_BYTES = 1 << 30  # timelines, metrics, results: appended for a whole run
_INT_LIMIT = 1 << 64  # seeds are the widest integers fdl writes


class ReadBackError(ValueError):
    """A file fdl would not read, or JSON it would not take: ``path`` and ``problem``."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path} {problem}")
        self.path = Path(path)
        self.problem = problem


def open_regular(path: Path, *, follow: bool = False) -> BinaryIO:
    """``path`` opened for reading in binary if it is a regular file (and not a symlink unless
    ``follow``); :class:`ReadBackError` otherwise, ``FileNotFoundError`` when it does not
    exist, another ``OSError`` when it cannot be opened. Opening never blocks (a FIFO)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise ReadBackError(path, "is a symbolic link; fdl does not read its own files "
                                      "through a link") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ReadBackError(path, f"is {_kind(mode)}, not a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, *, limit: int, follow: bool = False) -> bytes:
    """The bytes of ``path`` (see :func:`open_regular`) if it holds at most ``limit`` bytes;
    :class:`ReadBackError` if it holds more."""
    with open_regular(path, follow=follow) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise ReadBackError(path, f"is {size} bytes long, more than the {_size(limit)} fdl "
                                      f"reads from such a file")
        data = handle.read(limit + 1)
    if len(data) > limit:  # grew while it was read
        raise ReadBackError(path, f"is longer than the {_size(limit)} fdl reads from such a file")
    return data


def read_text(path: Path, *, limit: int, follow: bool = False) -> str:
    """:func:`read_bytes` decoded as UTF-8 (not UTF-8 is a :class:`ReadBackError`)."""
    try:
        return read_bytes(path, limit=limit, follow=follow).decode("utf-8")
    except UnicodeDecodeError:
        raise ReadBackError(path, "is not UTF-8 text") from None


def read_json(path: Path, *, limit: int = SMALL_BYTES, follow: bool = False) -> Any:
    """The JSON document in ``path``, read with :func:`read_text` and parsed with
    :func:`parse_json`."""
    text = read_text(path, limit=limit, follow=follow)
    try:
        return parse_json(text)
    except ValueError as exc:
        raise ReadBackError(path, f"is not valid JSON ({exc})") from None


def parse_json(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that refuses (``ValueError``) nesting deeper than ``max_depth``, number
    literals beyond a double (``1e400``) and integers of 64 bits or more. ``NaN`` and
    ``Infinity`` are taken: fdl writes them for a diverged loss, and each field's reader
    decides whether it may be one."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if nesting_depth(text, stop_above=max_depth) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return json.loads(text, parse_float=_finite_float, parse_int=_bounded_int)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str, *, stop_above: int) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings do not
    count); counting stops once it passes ``stop_above``."""
    if text.count("[") + text.count("{") <= stop_above:
        return 0  # cannot nest deeper than it has openers: the common case costs two counts
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > stop_above:
            break
    return deepest


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{_short(text)} does not fit a double")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 21:  # 2**64 has 20 digits: longer ones need no conversion to be refused
        raise ValueError(f"{_short(text)} is an integer of {len(text)} digits, beyond 64 bits")
    value = int(text)
    if not -_INT_LIMIT < value < _INT_LIMIT:
        raise ValueError(f"{_short(text)} is beyond 64 bits")
    return value


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]}"


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISDIR, "a directory"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _size(limit: int) -> str:
    return f"{limit >> 30} GiB" if limit >= 1 << 30 else f"{limit >> 20} MiB"
