"""Small checks shared by the readers of run-directory files: what a field may hold, and a
short rendering of a bad value for the one-line error that names it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A finite number >= 0 (durations, rates, clock readings)."""
    return is_number(value) and math.isfinite(value) and value >= 0


# The largest figure of each kind a run can produce, with room to spare: a hostile file's
# 1e308 is refused by name instead of overflowing the report's arithmetic.
MOST_SECONDS = 1e9  # 31 years of wall time
MOST_CLOCK = 1e11  # a time.time() reading, 1,000 years from now
MOST_COUNT = 1 << 53  # samples, steps, bytes: what a double still counts exactly
MOST_RATE = 1e12  # samples/s, ms per average
MOST_METRIC = 1e15  # an evaluation metric or a loss (NaN and infinity pass: a diverged run)


def is_figure(value: Any, *, most: float) -> bool:
    """A finite number in [0, most]."""
    return is_finite(value) and value <= most


def is_metric(value: Any) -> bool:
    """A number at most :data:`MOST_METRIC` in size, or NaN / infinity (a diverged loss)."""
    return is_number(value) and (not math.isfinite(value) or abs(value) <= MOST_METRIC)


def show(value: Any) -> str:
    """``value`` as a few characters of JSON (a container by its type's name)."""
    text = json.dumps(value) if isinstance(value, (str, int, float, type(None))) else \
        type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def read_json(path: Path, *, hint: str, limit: int = readback.SMALL_BYTES) -> Any:
    """The JSON document in ``path`` read with :mod:`fdl.readback` (a regular file, not a link,
    at most ``limit`` bytes, bounded nesting and numbers); a UsageError naming the file and
    what was wrong otherwise (``hint`` says what the caller needs it for)."""
    try:
        return readback.read_json(path, limit=limit)
    except readback.ReadBackError as exc:
        raise UsageError(str(exc), hint=hint) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", hint=hint) from None
