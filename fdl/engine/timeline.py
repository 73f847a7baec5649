"""Per-rank timing events, one JSON object a line, in ``<run_dir>/timeline/rank<r>.jsonl``.

Events (``t`` is seconds since the epoch, ``rank`` the global rank):

* ``start``  — ``attempt`` (0, or the elastic restart count), ``world_size``, ``resumed_from``
  (checkpoint name or null), ``epoch``, ``round``, ``skipped`` (invalid newer checkpoints)
* ``round``  — ``round``, ``epoch``, ``steps``, ``samples`` (used: an elastic rank's may be
  fewer than reserved), ``compute_s`` (the step loop's wall time), ``busy_s`` (the timed
  steps, whole: data, compute, emulated sleep), ``data_s`` (fetching batches, inside both),
  ``step_ms``, ``sleep_s`` (emulated slowdown), ``anchor``, ``lr_scale``; written when the
  round's compute ends
* ``sync``   — ``round``, ``start``, ``end``, ``wait_s`` (time blocked), ``blocking``,
  ``bytes``, ``checksum`` (when FDL_VERIFY_REPLICAS=1)
* ``anchor`` — ``round``, ``anchor``, ``previous``, ``reason`` (tuning and divergence-guard
  halvings)
* ``guard``  — ``round``, ``distance`` (max over ranks), ``level`` (drift over its usual level),
  ``streak``, ``halve``, ``released`` (the anchor's ceiling lifted)
* ``epoch``  — ``epoch``, ``samples``, ``train_loss``, ``eval``
* ``checkpoint`` — ``round``, ``epoch``, ``position`` (in the epoch's stream), ``name``,
  ``bytes``, ``write_s``
* ``final``  — ``checksum``, ``anchor``

Without a run directory (``python train.py`` solo) events are dropped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fdl.files import JsonlAppender, read_jsonl


class Timeline:
    def __init__(self, run_dir: Path | None, *, rank: int):
        self.rank = rank
        self._file: JsonlAppender | None = None
        if run_dir is not None:
            directory = run_dir / "timeline"
            directory.mkdir(parents=True, exist_ok=True)
            # Appended a line at a time: a crashed worker's events survive, a restarted worker
            # adds to its earlier attempt's events (on a fresh line, after the torn one a kill
            # may leave) instead of replacing them.
            self._file = JsonlAppender(directory / f"rank{rank}.jsonl", default=float)

    def event(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": round(time.time(), 6), "rank": self.rank, "kind": kind, **fields}
        self._file.append(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of one rank's timeline file (a torn last line, from a killed worker, is
    skipped)."""
    return read_jsonl(path)
