"""Small checks shared by the readers of run-directory files: what a field may hold, and a
short rendering of a bad value for the one-line error that names it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fdl.errors import UsageError


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A finite number >= 0 (durations, rates, clock readings)."""
    return is_number(value) and math.isfinite(value) and value >= 0


def show(value: Any) -> str:
    """``value`` as a few characters of JSON (a container by its type's name)."""
    text = json.dumps(value) if isinstance(value, (str, int, float, type(None))) else \
        type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def read_json(path: Path, *, hint: str) -> Any:
    """The JSON document in ``path``; a UsageError naming the file when it cannot be read, is
    not UTF-8 or not JSON (``hint`` says what the caller needs it for)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text (a JSON document was expected)",
                         hint=hint) from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc})", hint=hint) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", hint=hint) from None
