"""Which byte ranges of a parallel download are on disk: the sidecar ``<dest>.part.ranges.json``.

A parallel download (:mod:`fdl.download.ranged`) writes each range at its offset in a ``.part`` file
sized to the whole file up front, so the ``.part``'s size says nothing about what it holds; this
record does. It names the URL, the file's size and the validators the server gave (``ETag``,
``Last-Modified``), and for each range ``[start, end)`` how many of its bytes, from ``start``, are
written. The bytes are written before the record counts them, so a crash at any point leaves a
record that claims no more than the disk holds.

The record is written atomically (:func:`fdl.files.write_json_atomic`). One that cannot be read,
is not this shape, or does not fit the ``.part`` beside it (out-of-bounds, overlapping or
missing ranges, another size) is ignored: :func:`load_state` returns None and the download
starts over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.files import write_json_atomic

_VERSION = 1


@dataclass
class Piece:
    """One byte range ``[start, end)`` of the file; ``done`` bytes from ``start`` are written."""

    start: int
    end: int
    done: int = 0

    @property
    def complete(self) -> bool:
        return self.start + self.done >= self.end


@dataclass
class RangeState:
    """A parallel download's progress, owned by the fetch that updates it."""

    url: str
    size: int
    etag: str | None
    last_modified: str | None
    pieces: list[Piece] = field(default_factory=list)

    @property
    def done_bytes(self) -> int:
        return sum(piece.done for piece in self.pieces)

    def if_range(self) -> str | None:
        return if_range_value(self.etag, self.last_modified)

    def to_dict(self) -> dict[str, Any]:
        return {"version": _VERSION, "url": self.url, "size": self.size, "etag": self.etag,
                "last_modified": self.last_modified,
                "pieces": [[p.start, p.end, p.done] for p in self.pieces]}

    @classmethod
    def from_dict(cls, doc: Any) -> RangeState:
        """The state ``doc`` records; ``ValueError`` for anything but a consistent record."""
        if not isinstance(doc, dict) or doc.get("version") != _VERSION:
            raise ValueError("not a version 1 ranges record")
        url, size = doc.get("url"), doc.get("size")
        etag, modified = doc.get("etag"), doc.get("last_modified")
        if not isinstance(url, str) or not _is_int(size) or size <= 0:
            raise ValueError("no url or size")
        if not all(v is None or isinstance(v, str) for v in (etag, modified)):
            raise ValueError("validators are not strings")
        rows = doc.get("pieces")
        if not isinstance(rows, list) or not rows:
            raise ValueError("no pieces")
        pieces, expected_start = [], 0
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(map(_is_int, row))):
                raise ValueError(f"a piece is not [start, end, done]: {row!r}")
            start, end, done = row
            if start != expected_start or not start < end <= size or not 0 <= done <= end - start:
                raise ValueError(f"piece {row!r} does not tile the file")
            pieces.append(Piece(start, end, done))
            expected_start = end
        if expected_start != size:
            raise ValueError("the pieces do not cover the file")
        return cls(url=url, size=size, etag=etag, last_modified=modified, pieces=pieces)


def if_range_value(etag: str | None, last_modified: str | None) -> str | None:
    """The ``If-Range`` value for a file with these validators: a strong ETag, else
    ``Last-Modified`` (a weak ETag may not be used there), else None (the file cannot be
    fetched in parts safely)."""
    if etag and not etag.startswith("W/"):
        return etag
    return last_modified or None


def plan_state(*, url: str, size: int, etag: str | None, last_modified: str | None,
               num_connections: int, min_piece_bytes: int) -> RangeState:
    """A fresh state cutting ``size`` bytes into pieces: four per connection, so that a fast
    connection takes more of them, and at least ``min_piece_bytes`` each, so that requests
    stay few."""
    num_pieces = max(1, min(4 * num_connections, size // max(1, min_piece_bytes)))
    step = -(-size // num_pieces)
    pieces = [Piece(start, min(start + step, size)) for start in range(0, size, step)]
    return RangeState(url=url, size=size, etag=etag, last_modified=last_modified, pieces=pieces)


def state_path(part: Path) -> Path:
    """The sidecar of the staging file ``part``."""
    return part.with_name(part.name + ".ranges.json")


def load_state(part: Path) -> RangeState | None:
    """The record beside ``part``, or None when there is none or it cannot be trusted (see the
    module docstring); the ``.part`` must have the recorded size."""
    try:
        state = RangeState.from_dict(readback.read_json(state_path(part)))
        if part.stat().st_size != state.size:
            return None
    except (OSError, ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return state


def save_state(part: Path, state: RangeState | dict[str, Any]) -> None:
    """Write the record (``state``, or the ``to_dict()`` of one) atomically: a reader sees the
    previous one or this one, never a mix."""
    write_json_atomic(state_path(part), state if isinstance(state, dict) else state.to_dict())


def discard_state(part: Path) -> None:
    state_path(part).unlink(missing_ok=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
