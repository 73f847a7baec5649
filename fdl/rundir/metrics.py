"""``metrics.jsonl``: one record per finished epoch, appended by rank 0 (fdl.engine.epochs);
docs/run.md "Run directory" lists its fields. A resumed run rewrites it with the epochs its
checkpoint kept (the epochs it redoes are dropped). A torn last line (a killed writer) is skipped
when read."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fdl.files import JsonLines, append_jsonl, scan_jsonl, write_atomic

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


def has_epochs(run_dir: Path) -> bool:
    return (run_dir / FILE).is_file()
