"""TensorBoard scalars for ``fdl run --tensorboard [DIR]`` (``tensorboard = "on"`` or a directory in
fdl.toml, ``fdl.Trainer(tensorboard=...)``), written by rank 0 through torch's own SummaryWriter,
one point per epoch, flushed at once so a running TensorBoard shows the epoch that just ended.

The step of every point is the number of samples trained so far, so runs with different
policies, batch sizes or worker counts line up on one axis. Tags (each value is the epoch's record
in ``metrics.jsonl``, fdl.rundir.metrics.EpochRecord, under the field named)::

    train/loss                  train_loss
    eval/<metric>               eval[<metric>] (and run.evaluate(..., every=N)'s within epochs)
    throughput/samples_per_s    epoch_samples_per_s
    throughput/rank<r>          per_rank_samples_per_s[r]
    idle/rank<r>                idle_fraction[r]
    sync/overhead               sync_overhead
    elche/anchor                anchor
    step/<name>                 run.log(name=...): the round's mean (per round, not per epoch;
                                not flushed until the epoch's end)

The ``tensorboard`` package comes with ``pip install 'fdl[tensorboard]'``; fdl run checks for it
before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.rundir.layout import tensorboard_dir
from fdl.rundir.metrics import EpochRecord

INSTALL_HINT = "pip install 'fdl[tensorboard]'"


def log_dir(setting: str, *, run_dir: Path | None) -> Path:
    """Where ``tensorboard = setting`` writes: ``on`` is the run directory's ``tensorboard/``
    (``runs/tensorboard`` for a script run without fdl run), anything else a directory."""
    return tensorboard_dir(run_dir) if setting == "on" else Path(setting)


@dataclass
class ScalarWriter:
    writer: Any  # torch.utils.tensorboard.SummaryWriter

    @classmethod
    def open(cls, setting: str, *, run_dir: Path | None,
             purge_step: int | None = None) -> ScalarWriter:
        """A writer into :func:`log_dir`; ``purge_step`` (a resumed run's first sample) hides
        the points an earlier attempt wrote past it, which this one writes again."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UsageError("tensorboard is not installed: --tensorboard needs it",
                             hint=INSTALL_HINT) from exc
        directory = log_dir(setting, run_dir=run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        return cls(SummaryWriter(log_dir=str(directory), purge_step=purge_step))

    def epoch(self, record: EpochRecord) -> None:
        step = record.samples
        for tag, value in record.scalars().items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def scalars(self, values: dict[str, float], *, samples: int,
                tag_prefix: str = "step/") -> None:
        """One round's means of the scalars the script logged (``run.log``), or an evaluation
        within an epoch (``tag_prefix=""``, names ``eval/<metric>``)."""
        for name, value in values.items():
            self.writer.add_scalar(f"{tag_prefix}{name}", value, global_step=samples)

    def close(self) -> None:
        self.writer.close()
