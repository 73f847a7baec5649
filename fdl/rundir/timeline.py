"""Per-rank timing events, one JSON object a line, in ``<run_dir>/timeline/rank<r>.jsonl``, and
the node's utilisation samples beside them (``samples-node<n>.jsonl``, fdl.engine.utilisation).

Events (``t`` is seconds since the epoch, ``rank`` the global rank):

* ``start``  — ``attempt`` (0, or the elastic restart count), ``world_size``, ``resumed_from``
  (checkpoint name or null), ``epoch``, ``round``, ``skipped`` (invalid newer checkpoints)
* ``round``  — ``round``, ``epoch``, ``steps``, ``samples`` (used: an elastic rank's may be
  fewer than reserved), ``planned`` (the samples the round's plan gave the rank: the elastic
  rank's reservation; the calibration pool's batches not included), ``compute_s`` (the step
  loop's wall time), ``busy_s`` (the timed steps, whole — data, compute, emulated sleep —
  less DDP's communication), ``data_s``
  (fetching batches, inside both), ``step_ms`` (``busy_s`` per step), ``sleep_s`` (emulated
  slowdown, inside both), ``comm_s`` (sync: DDP's gradient all-reduce and the wait for the
  peers in it, inside ``compute_s``, not ``busy_s``), ``anchor``, ``lr_scale``,
  ``fetched_ahead`` (the slice's batches came from the loader's workers' pass started while
  the last boundary ran: fdl.engine.batch_loader); written when the round's compute ends
* ``sync``   — ``round``, ``start``, ``end``, ``wait_s`` (time blocked), ``blocking``,
  ``bytes``, ``checksum`` (when FDL_VERIFY_REPLICAS=1)
* ``anchor`` — ``round``, ``anchor``, ``previous``, ``reason`` (tuning and divergence-guard
  halvings)
* ``guard``  — ``round``, ``distance`` (max over ranks), ``level`` (drift over its usual level),
  ``streak``, ``halve``, ``released`` (the anchor's ceiling lifted)
* ``budget`` — ``round``, ``elapsed_s``, ``reason``: the time budget was passed at this
  round's boundary, and the next round is the run's last
* ``scalars`` — ``round``, ``values`` (the means over the round of what the script logged with
  ``run.log``: ``{"loss": 0.41, ...}``)
* ``eval``   — ``samples``, ``eval``: an evaluation within an epoch (``run.evaluate(...,
  every=N)``)
* ``epoch``  — ``epoch``, ``samples``, ``train_loss``, ``eval``
* ``checkpoint`` — ``round``, ``epoch``, ``position`` (in the epoch's stream), ``name``,
  ``bytes``, ``write_s``
* ``final``  — ``checksum``, ``anchor``

Without a run directory (``python train.py`` solo) events are dropped. :data:`EVENTS` is the
one list of kinds and their fields: the writer checks what it is given against it, and the
readers (``fdl report``, the merged timeline) check what they read back.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fdl.files import JsonlAppender, scan_jsonl
from fdl.rundir.fields import (
    MOST_CLOCK,
    MOST_COUNT,
    MOST_SECONDS,
    is_figure,
    is_int,
    show,
)

DIRNAME = "timeline"
RANK_FILE = re.compile(r"rank(\d+)\.jsonl")
SAMPLES_FILE = re.compile(r"samples-node(\d+)\.jsonl")

# Every kind of event and the fields the engine writes with it (besides t, rank and kind).
EVENTS: dict[str, tuple[str, ...]] = {
    "start": ("attempt", "world_size", "resumed_from", "epoch", "round", "skipped"),
    "round": ("round", "epoch", "steps", "samples", "planned", "compute_s", "data_s", "busy_s",
              "step_ms", "sleep_s", "comm_s", "anchor", "lr_scale", "fetched_ahead"),
    "sync": ("round", "start", "end", "wait_s", "blocking", "bytes"),
    "anchor": ("round", "anchor", "previous", "reason"),
    "policy": ("round", "chosen", "reason", "speed_spread", "average_ms",
               "overhead_at_max_anchor", "sync_step_overhead"),
    "guard": ("round", "distance", "level", "streak", "halve", "released"),
    "scalars": ("round", "values"),
    "budget": ("round", "elapsed_s", "reason"),
    "eval": ("samples", "eval"),
    "epoch": ("epoch", "train_loss", "eval"),
    "checkpoint": ("round", "epoch", "position", "name", "bytes", "write_s"),
    "final": ("checksum", "anchor"),
}
# The fields a reader relies on, per kind, and what each must hold.
_CLOCK = (lambda v: is_figure(v, most=MOST_CLOCK), f"a clock reading in [0, {MOST_CLOCK:g}]")
_SECONDS = (lambda v: is_figure(v, most=MOST_SECONDS), f"a number in [0, {MOST_SECONDS:g}]")
_COUNT = (lambda v: is_int(v) and 0 <= v <= MOST_COUNT, f"an integer in [0, {MOST_COUNT:g}]")
_CHECKED: dict[str, dict[str, tuple[Any, str]]] = {
    "round": {"t": _CLOCK, "steps": _COUNT, "samples": _COUNT, "compute_s": _SECONDS,
              "data_s": _SECONDS, "sleep_s": _SECONDS, "comm_s": _SECONDS},
    "sync": {"t": _CLOCK, "wait_s": _SECONDS},
    "epoch": {"t": _CLOCK},
}
_OPTIONAL = {"data_s", "sleep_s", "comm_s"}  # rounds written before the field existed
NO_FINAL_EVENT = "no final event (cut off before the run ended)"


@dataclass(frozen=True)
class GpuReading:
    """One GPU in a utilisation sample (null values: NVML could not read them)."""

    cuda_index: int
    util_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None


@dataclass(frozen=True)
class UtilisationSample:
    """One line of ``samples-node<n>.jsonl`` (fdl.engine.utilisation takes them)."""

    t: float
    node: int
    host: str
    cpu_percent: float  # system-wide
    ram_used_bytes: int
    ram_total_bytes: int
    gpus: list[GpuReading]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def directory(run_dir: Path) -> Path:
    return run_dir / DIRNAME


def rank_path(run_dir: Path, rank: int) -> Path:
    return directory(run_dir) / f"rank{rank}.jsonl"


def samples_path(run_dir: Path, node: int) -> Path:
    return directory(run_dir) / f"samples-node{node}.jsonl"


def numbered_files(run_dir: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    """The files of the timeline directory whose name ``pattern`` matches (:data:`RANK_FILE`,
    :data:`SAMPLES_FILE`), with their number, in ascending order."""
    folder = directory(run_dir)
    if not folder.is_dir():
        return []
    found = [(pattern.fullmatch(path.name), path) for path in folder.iterdir()]
    return sorted((int(m.group(1)), path) for m, path in found if m)


class Timeline:
    """One rank's event writer (nothing is written without a run directory)."""

    def __init__(self, run_dir: Path | None, *, rank: int):
        self.rank = rank
        self._file: JsonlAppender | None = None
        if run_dir is not None:
            directory(run_dir).mkdir(parents=True, exist_ok=True)
            # Appended a line at a time: a crashed worker's events survive, a restarted worker
            # adds to its earlier attempt's events (on a fresh line, after the torn one a kill
            # may leave) instead of replacing them.
            self._file = JsonlAppender(rank_path(run_dir, rank), default=float)

    def event(self, kind: str, **fields: Any) -> None:
        missing = set(EVENTS[kind]) - set(fields)
        assert not missing, f"a {kind} event without {sorted(missing)}"
        if self._file is None:
            return
        record = {"t": round(time.time(), 6), "rank": self.rank, "kind": kind, **fields}
        self._file.append(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """All events of rank ``rank``'s timeline (a torn last line, from a killed worker, is
    skipped; none when the file is absent)."""
    return scan_jsonl(rank_path(run_dir, rank)).records


@dataclass
class RankTimeline:
    """One rank's timeline as the report reads it: the usable events of its last attempt, and
    what is wrong with the file (empty when nothing is)."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_rank_timeline(run_dir: Path, *, rank: int) -> RankTimeline:
    """Rank ``rank``'s events from its last ``start`` on, with what is wrong with the file:
    only the last attempt counts (summary.json covers the attempt that finished), and records
    with missing or mistyped fields are left out."""
    path = rank_path(run_dir, rank)
    found = scan_jsonl(path)
    timeline = RankTimeline(rank)
    if found.error is not None or not (found.records or found.bad_lines):
        timeline.problems.append(f"{path.name} is {found.error or 'empty'}")
        return timeline
    starts = [i for i, record in enumerate(found.records) if record.get("kind") == "start"]
    first = starts[-1] if starts else 0
    first_line = found.line_numbers[first] if starts else 0
    bad = [n for n in found.bad_lines if n > first_line]
    if bad:
        timeline.problems.append(f"{len(bad)} line(s) that are not JSON records "
                                 f"(first: line {bad[0]})")
    malformed = []
    for record, line in zip(found.records[first:], found.line_numbers[first:], strict=True):
        problem = record_problem(record)
        if problem is None:
            timeline.events.append(record)
        else:
            malformed.append(f"line {line}: {problem}")
    if malformed:
        timeline.problems.append(f"{len(malformed)} malformed record(s) left out "
                                 f"(first: {malformed[0]})")
    if timeline.events and not any(e["kind"] == "final" for e in timeline.events):
        timeline.problems.append(NO_FINAL_EVENT)
    return timeline


def record_problem(record: dict[str, Any]) -> str | None:
    """What makes ``record`` unusable for a reader (None: nothing)."""
    kind = record.get("kind")
    if not isinstance(kind, str):
        return f"'kind' is {show(kind)}, expected a string"
    for key, (valid, allowed) in _CHECKED.get(kind, {}).items():
        if key not in record:
            if key in _OPTIONAL:
                continue
            return f"a {kind} record has no {key!r}"
        if not valid(record[key]):
            return f"a {kind} record's {key!r} is {show(record[key])}, expected {allowed}"
    return None
