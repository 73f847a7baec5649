"""Rank 0's live progress: ``RUN_DIR/progress.json``, one small JSON document rewritten
(atomically) at most every ``FDL_PROGRESS`` seconds while training, which ``fdl run`` shows on its
terminal (fdl.launch.live reads it with :func:`read_snapshot`). Written only when ``fdl run``
asks for it (a terminal, no ``--quiet``).

The step loop asks :meth:`ProgressFile.due` after each step — a clock read — and builds and
writes a snapshot only when it is due, a few times a second: nothing here touches the device.
The loss it shows is the last finished round's mean on rank 0, which the round loop reads once
per round anyway, so a CUDA step queue is never drained for the display.

The document (``schema`` 1): ``t`` (seconds since the epoch), ``epoch`` (1-based) and ``epochs``,
``epoch_fraction`` (0..1), ``samples`` and ``total_samples`` (the run's stream, estimated within
the round from rank 0's own steps: the plan makes every rank finish a round together),
``elapsed_s`` (this attempt), ``samples_per_s`` (over the last :data:`WINDOW_S` seconds),
``eta_s``, ``shares`` (each rank's share of the round's samples), ``loss``, ``sync_overhead``
(time in averages / compute, rank 0), ``anchor`` and ``world_size``; ``precisions`` (what each
rank trains in: ``fp32``, ``bf16``, ``fp16``) once the engine has given them — a snapshot
without it is still schema 1, shown without precisions. ``first_step`` (true, else absent): the
snapshot written before the process's first step, which can take long (allocations,
torch.compile's compilation); it has no rate, and the rate after it does not count from it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.files import write_json_atomic
from fdl.settings import PROGRESS_ENV

FILE = "progress.json"
SCHEMA = 1
MAX_BYTES = 64 * 1024  # a snapshot is some 400 bytes; anything much larger is not one
WINDOW_S = 10.0  # the rate is measured over this much of the recent past
MIN_INTERVAL_S = 0.05


@dataclass
class ProgressFile:
    path: Path
    interval_s: float
    epochs: int
    epoch_size: int
    world_size: int
    loss: float | None = None
    precisions: list[str] | None = None  # each rank's; set once, or given to write()
    total: int | None = None  # the run's samples when a budget cuts it short of the epochs
    _started: float = field(default_factory=time.monotonic)
    _next: float = 0.0
    written: bool = field(default=False, init=False)  # a snapshot by this process yet
    _points: deque[tuple[float, float]] = field(default_factory=deque)

    @classmethod
    def from_env(cls, run_dir: Path | None, *, rank: int, epochs: int, epoch_size: int,
                 world_size: int, env: dict[str, str] | None = None) -> ProgressFile | None:
        """Rank 0's writer when fdl run asked for one (``FDL_PROGRESS`` > 0), else None."""
        raw = (os.environ if env is None else env).get(PROGRESS_ENV, "")
        try:
            interval = float(raw)
        except ValueError:
            return None
        if rank != 0 or run_dir is None or not interval > 0 or math.isinf(interval):
            return None
        return cls(run_dir / FILE, max(MIN_INTERVAL_S, interval), epochs,
                   epoch_size, world_size)

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def write(self, *, samples: float, epoch: int, shares: list[float], anchor: int,
              sync_s: float, busy_s: float, data_s: float = 0.0,
              precisions: list[str] | None = None, first_step: bool = False) -> None:
        """A snapshot at stream position ``samples`` (the run's, counted from its first epoch);
        ``precisions``, when given, are each rank's from now on (:attr:`precisions`);
        ``first_step``: written before the process's first step (the module docstring). An
        unwritable run directory only costs the display."""
        if precisions is not None:
            self.precisions = list(precisions)
        now = time.monotonic()
        self.written = True
        if not first_step:  # the first step's end is due a snapshot at once
            self._next = now + self.interval_s
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, self.snapshot(
                now=now, samples=samples, epoch=epoch, shares=shares, anchor=anchor,
                sync_s=sync_s, busy_s=busy_s, data_s=data_s, first_step=first_step))

    def snapshot(self, *, now: float, samples: float, epoch: int, shares: list[float],
                 anchor: int, sync_s: float, busy_s: float,
                 data_s: float = 0.0, first_step: bool = False) -> dict[str, Any]:
        total = self.total or self.epochs * self.epoch_size
        rate = None
        if not first_step:  # the first step's length is not the training's rate
            self._points.append((now, samples))
            while len(self._points) > 2 and now - self._points[0][0] > WINDOW_S:
                self._points.popleft()
            (t0, s0) = self._points[0]
            rate = (samples - s0) / (now - t0) if now > t0 and samples > s0 else None
        position = samples - epoch * self.epoch_size
        document = {
            "schema": SCHEMA, "t": round(time.time(), 3), "epoch": epoch + 1,
            "epochs": self.epochs,
            "epoch_fraction": min(1.0, max(0.0, position / self.epoch_size)),
            "samples": int(samples), "total_samples": total,
            "elapsed_s": round(now - self._started, 3),
            "samples_per_s": rate, "eta_s": (total - samples) / rate if rate else None,
            "shares": [round(s, 4) for s in shares], "loss": self.loss,
            "sync_overhead": sync_s / busy_s if busy_s > 0 else None,
            "data_wait": data_s / busy_s if busy_s > 0 else None,
            "anchor": anchor, "world_size": self.world_size,
        }
        if self.precisions is not None:
            document["precisions"] = list(self.precisions)
        if first_step:
            document["first_step"] = True
        return document


def read_snapshot(run_dir: Path) -> dict[str, Any] | None:
    """The snapshot in ``run_dir``, or None when there is none fit to show."""
    try:
        document = readback.read_json(run_dir / FILE, limit=MAX_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        return None
    return document


def clear_snapshot(run_dir: Path) -> None:
    """Remove an earlier run's last snapshot (it is not this run's progress)."""
    with contextlib.suppress(OSError):
        (run_dir / FILE).unlink(missing_ok=True)
