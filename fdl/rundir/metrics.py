"""``metrics.jsonl``: one record per finished epoch, appended by rank 0 (fdl.engine.recorder);
docs/run.md "Run directory" lists its fields. A resumed run rewrites it with the epochs its
checkpoint kept (the epochs it redoes are dropped). A torn last line (a killed writer) is skipped
when read."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.files import JsonLines, append_jsonl, scan_jsonl, write_atomic
from fdl.rundir.fields import is_int

FILE = "metrics.jsonl"


@dataclass(frozen=True)
class EpochRecord:
    """One line of metrics.jsonl. ``samples_per_s`` is over the run so far (this attempt),
    ``elapsed_s`` the training time since the run began (evaluation left out, earlier attempts
    included); the rest cover this epoch alone."""

    epoch: int  # 1-based
    samples: int  # the run's samples so far
    train_loss: float | None
    eval: dict[str, float]
    samples_per_s: float | None
    elapsed_s: float
    epoch_s: float
    epoch_samples_per_s: float | None
    per_rank_samples_per_s: list[float | None]
    idle_fraction: list[float | None]
    sync_overhead: float | None  # time in averages / the busiest rank's compute
    anchor: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scalars(self) -> dict[str, float]:
        """The record's plottable figures by TensorBoard tag (values that are not finite
        numbers, e.g. an overhead with no average yet, are left out)."""
        values: dict[str, Any] = {"train/loss": self.train_loss,
                                  "throughput/samples_per_s": self.epoch_samples_per_s,
                                  "sync/overhead": self.sync_overhead,
                                  "elche/anchor": self.anchor}
        values |= {f"eval/{name}": value for name, value in self.eval.items()}
        values |= {f"throughput/rank{r}": v for r, v in enumerate(self.per_rank_samples_per_s)}
        values |= {f"idle/rank{r}": v for r, v in enumerate(self.idle_fraction)}
        return {tag: float(value) for tag, value in values.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value)}


def append_epoch(run_dir: Path, record: EpochRecord) -> None:
    append_jsonl(run_dir / FILE, record.to_dict())


def rewrite_epochs(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Replace the file with ``records``, atomically."""
    write_atomic(run_dir / FILE, "".join(json.dumps(r, default=str) + "\n" for r in records))


def scan_epochs(run_dir: Path) -> JsonLines:
    """The records, with the lines that are not records and why the file could not be read."""
    return scan_jsonl(run_dir / FILE)


def read_epochs(run_dir: Path) -> list[dict[str, Any]]:
    """The records that parse (none when the file is absent)."""
    return scan_epochs(run_dir).records


@dataclass(frozen=True)
class CurvePoint:
    """One epoch of the curves: training seconds (evaluation excluded) and samples so far."""

    epoch: int
    samples: int
    elapsed_s: float
    train_loss: float
    eval: Mapping[str, float] = field(default_factory=dict)


def read_curve(run_dir: Path) -> tuple[CurvePoint, ...]:
    """The run's epochs as loss and eval curves, checked: a UsageError naming the file, the line
    and the field for a missing file, a line that is not a record, a figure that is not a finite
    number (a diverged run's NaN loss included) or epochs out of order."""
    path = run_dir / FILE
    found = scan_epochs(run_dir)
    if found.error is not None:
        raise UsageError(f"{path}: {found.error} (the run finished no epoch)")
    if found.bad_lines:
        raise UsageError(f"{path}:{found.bad_lines[0]}: not a JSON record")
    points: list[CurvePoint] = []
    for number, record in zip(found.line_numbers, found.records, strict=True):
        point = _point(record, where=f"{path}:{number}")
        if points and point.epoch <= points[-1].epoch:
            raise UsageError(f"{path}:{number}: epoch {point.epoch} does not follow epoch "
                             f"{points[-1].epoch}")
        points.append(point)
    if not points:
        raise UsageError(f"{path}: no epoch recorded")
    return tuple(points)


def _point(record: dict[str, Any], *, where: str) -> CurvePoint:
    epoch, samples = record.get("epoch"), record.get("samples")
    if not is_int(epoch) or epoch < 1 or not is_int(samples) or samples < 1:
        raise UsageError(f"{where}: 'epoch' and 'samples' must be integers >= 1, got "
                         f"{epoch!r:.20} and {samples!r:.20}")
    loss = finite(record.get("train_loss"), f"{where}: train_loss")
    if record.get("elapsed_s") is not None:
        elapsed = finite(record["elapsed_s"], f"{where}: elapsed_s")
    else:  # written before elapsed_s existed: samples_per_s is the run's average so far
        rate = finite(record.get("samples_per_s"), f"{where}: samples_per_s")
        if rate <= 0:
            raise UsageError(f"{where}: samples_per_s is {rate}, expected a number > 0")
        elapsed = samples / rate
    return CurvePoint(epoch, samples, elapsed, loss, finite_metrics(record.get("eval"), where))


def finite_metrics(values: Any, where: str) -> dict[str, float]:
    """An ``eval`` object of finite numbers ({} for none); a UsageError otherwise."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UsageError(f"{where}: eval must be an object of numbers, got {values!r:.40}")
    return {str(name): finite(value, f"{where}: eval.{name}") for name, value in values.items()}


def finite(value: Any, what: str) -> float:
    """``value`` as a float when it is a finite number; a UsageError naming ``what`` else."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise UsageError(f"{what} is {value!r:.40}, expected a finite number")
    return float(value)
