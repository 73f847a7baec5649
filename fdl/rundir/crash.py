"""``logs/rank<r>.crash.json``: what ended a worker whose script raised, for ``fdl run``'s
root-cause block.

The worker (fdl.launch.worker) writes it as the exception leaves the script, before Python
prints the traceback (the log keeps that whole): the exception's own lines (``ValueError:
...``) and the last frame of the user's own code, both as Python formats them. The user's own
code is a file under the script's directory (the working directory for ``-m``) that is not
installed code (under a ``site-packages`` or ``dist-packages`` directory) and not fdl's: the
frame a person opens first, which the last lines of a log cut off whenever torch's frames lie
below it. An exception raised outside any such file (a SyntaxError, whose lines say where it
is) has no frame.

``fdl run`` reads it back for the failed rank (:func:`read_crash`), checked: it must be the
failed process's (its pid) and hold what is written here; anything else counts as no record,
and the block shows the log's last lines instead. Its time tells a rank that raised first from
one that raised because a peer had died (gloo's "Connection closed by peer").
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.files import write_json_atomic
from fdl.rundir.fields import is_finite, is_int

SUFFIX = ".crash.json"
MAX_ERROR_LINES = 12  # an exception's message can run to pages; the log has all of it
TAIL_LINES = 3  # of those, the last lines of a long message: a DataLoader worker's error ends
# with the original exception ("ValueError: ..."), after its traceback
_INSTALLED = frozenset({"site-packages", "dist-packages"})
_FDL = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Crash:
    pid: int
    t: float  # seconds since the epoch, when the exception left the script
    frame: tuple[str, ...]  # 'File "...", line N, in NAME', the source line, its carets
    error: tuple[str, ...]  # the exception's lines, as Python prints them last

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def crash_path(logs: Path, rank: int | str) -> Path:
    return logs / f"rank{rank}{SUFFIX}"


def describe_crash(exc: BaseException, *, home: Path, pid: int, t: float) -> Crash:
    """``exc`` as the root-cause block shows it; ``home``: the directory of the user's code."""
    frame = own_frame(traceback.extract_tb(exc.__traceback__), home=home)
    lines = traceback.StackSummary.from_list([frame]).format() if frame is not None else []
    # Python indents a frame by two spaces and its source by four: keep the source's indent
    shown = [line.removeprefix("  ") for line in "".join(lines).rstrip("\n").splitlines()]
    error = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n").splitlines()
    if len(error) > MAX_ERROR_LINES:
        head = MAX_ERROR_LINES - TAIL_LINES
        error = [*error[:head], f"... ({len(error) - MAX_ERROR_LINES} more lines)",
                 *error[-TAIL_LINES:]]
    return Crash(pid, t, tuple(shown), tuple(error))


def own_frame(frames: traceback.StackSummary, *, home: Path) -> traceback.FrameSummary | None:
    """The last of ``frames`` in the user's own code (see the module docstring), or None."""
    home = home.resolve()
    for frame in reversed(frames):
        path = Path(frame.filename)
        if not path.is_absolute():  # "<frozen runpy>", "<string>"
            continue
        path = path.resolve()
        if path.is_relative_to(home) and not path.is_relative_to(_FDL) \
                and not _INSTALLED.intersection(path.parts):
            return frame
    return None


def write_crash(logs: Path, rank: int | str, crash: Crash) -> Path:
    return write_json_atomic(crash_path(logs, rank), crash.to_dict())


def read_crash(logs: Path, rank: int | str, *, pid: int) -> Crash | None:
    """Rank ``rank``'s record when process ``pid`` wrote it and it holds what
    :func:`write_crash` writes; None otherwise (absent, an earlier attempt's, damaged)."""
    try:
        document = readback.read_json(crash_path(logs, rank))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("pid") != pid or \
            not is_int(document["pid"]) or not is_finite(document.get("t")):
        return None
    frame, error = document.get("frame"), document.get("error")
    if not (_strings(frame) and _strings(error)):
        return None
    return Crash(pid, float(document["t"]), tuple(frame), tuple(error))


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)
