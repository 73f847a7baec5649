"""What a run records as it trains: the epoch history (its one owner), ``metrics.jsonl`` and
TensorBoard (rank 0), the epoch's line on rank 0's terminal, evaluations within an epoch, and
each round's logged scalars.

An epoch ends in two halves. At its last boundary, :meth:`Recorder.end_epoch` takes its clocks
(and :meth:`Recorder.figures`, this rank's figures, ride in the epoch's last average: the epoch's
end has no collective of its own; a rank alone sums its own). The rest, :meth:`Recorder.close_epoch`
(the loss, the evaluation of the consensus model, the record, the script's hooks, the line),
waits for the model to be the consensus: at once after a blocking average, a round later under
async, when the epoch's average lands (fdl.engine.boundary). A record (``metrics.jsonl``,
docs/run.md "Run directory")::

    {"epoch": 2, "samples": 120000, "train_loss": 0.2987, "eval": {"accuracy": 0.8979},
     "samples_per_s": 48464.6, "elapsed_s": 2.476, "epoch_s": 1.176,
     "epoch_samples_per_s": 50999.7, "per_rank_samples_per_s": [33537.4, 17462.3],
     "idle_fraction": [0.136, 0.019], "sync_overhead": 0.0047, "anchor": 103}

``samples_per_s`` is over the run so far (this attempt), ``elapsed_s`` the training time since the
run began (evaluation left out, earlier attempts included), the rest cover this epoch alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from fdl.engine.averaging import checksum
from fdl.engine.collectives import exchange_rows
from fdl.engine.config import EngineConfig
from fdl.engine.evaluation import Evaluator
from fdl.engine.plan import PlanState
from fdl.engine.state import RankFigures
from fdl.engine.tallies import Tallies, Totals
from fdl.engine.tensorboard import ScalarWriter
from fdl.rundir import metrics
from fdl.rundir.metrics import EpochRecord
from fdl.rundir.timeline import Timeline


class EpochHooks(Protocol):
    """What an epoch's end tells the script (fdl.engine.loop.Run: ``run.at_epoch_end``)."""

    def epoch_ended(self, record: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class EpochEnd:
    """An epoch's end as its last boundary took it: the plan's state after it, its clocks and
    the averages' costs in it; ``mine``, a rank alone's figures (no average carried them)."""

    epoch: int
    state: PlanState
    elapsed_s: float
    epoch_s: float
    comm_ms: list[float]
    mine: RankFigures | None


@dataclass(eq=False)
class Recorder:
    """The run's records (see the module docstring)."""

    config: EngineConfig
    run_dir: Path | None  # rank 0's; None on the others (they write nothing)
    rank: int
    world_size: int
    evaluator: Evaluator
    timeline: Timeline
    verify: bool = False  # FDL_VERIFY_REPLICAS: each epoch event carries the model's checksum
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per epoch
    last_loss: float | None = None
    start_samples: int = 0  # > 0 when resumed: this attempt's throughput counts its own samples
    start_elapsed_s: float = 0.0  # training time of the attempts before this one
    started: float = field(default_factory=time.perf_counter)
    tensorboard: ScalarWriter | None = None
    epochs_total: int | None = None  # the epochs a budget leaves (the last may be cut)
    _epoch_started: float = field(default_factory=time.perf_counter)
    _mark: RankFigures = field(default_factory=RankFigures)  # totals at the last epoch's end
    _mark_syncs: int = 0  # averages done by the last epoch's end

    def restore(self, history: list[dict[str, Any]], *, start_samples: int) -> None:
        """A resumed run: the checkpoint's epochs and where they left the clocks."""
        self.history[:] = history
        self.start_samples = start_samples
        if history:
            self.evaluator.last = history[-1]["eval"]
            self.last_loss = history[-1]["train_loss"]
            elapsed = history[-1].get("elapsed_s")
            self.start_elapsed_s = float(elapsed) if isinstance(elapsed, (int, float)) else 0.0

    def begin(self, totals: Totals) -> None:
        """Training starts now: the clocks start, and rank 0 opens TensorBoard if asked."""
        self.started = self._epoch_started = time.perf_counter()
        self._mark, self._mark_syncs = totals.figures, len(totals.comm_ms)
        if self.rank == 0 and self.config.tensorboard is not None:
            self.tensorboard = ScalarWriter.open(self.config.tensorboard, run_dir=self.run_dir,
                                                 purge_step=self.start_samples or None)

    def end_epoch(self, epoch: int, state: PlanState, tallies: Tallies, *,
                  averaged: bool) -> EpochEnd:
        """Epoch ``epoch`` ended at this boundary: its clocks taken now (``averaged``: its
        last average carries every rank's figures)."""
        now = time.perf_counter()
        totals = tallies.totals
        comm_ms = totals.comm_ms[self._mark_syncs:]
        self._mark_syncs = len(totals.comm_ms)
        ending = EpochEnd(epoch, state, now - self.started - self.evaluator.eval_s,
                          now - self._epoch_started, comm_ms,
                          None if averaged else self.figures(tallies))
        self._epoch_started = now
        return ending

    def close_epoch(self, ending: EpochEnd, rows: list[RankFigures] | None, *,
                    model: nn.Module, device: Any, hooks: EpochHooks) -> None:
        """The epoch's end on its consensus model: every rank's figures (``rows``, as its
        average carried them; a rank alone exchanges its own), the loss, the evaluation, the
        record and the script's hooks, the timeline, ``metrics.jsonl``, TensorBoard and the
        line. Every rank calls it at the same point."""
        eval_before = self.evaluator.eval_s
        per_rank = rows if ending.mine is None else self._exchange(ending.mine, device)
        if per_rank is None:
            raise AssertionError("the epoch's figures rode in an average that has not landed")
        steps = sum(r.loss_steps for r in per_rank)
        self.last_loss = sum(r.loss_sum for r in per_rank) / steps if steps else None
        self.evaluator.evaluate(model, ending.state, batch_size=self.config.batch_size)
        record = self._record(ending, per_rank)
        self.history.append(record.to_dict())
        hooks.epoch_ended(dict(self.history[-1]))
        verified = {"checksum": checksum(model)} if self.verify else {}
        self.timeline.event("epoch", epoch=ending.epoch + 1, train_loss=self.last_loss,
                            eval=self.evaluator.last, **verified)
        if self.rank == 0:
            if self.run_dir is not None:
                metrics.append_epoch(self.run_dir, record)
            if self.tensorboard is not None:
                self.tensorboard.epoch(record)
            _progress_line(record, self.epochs_total or self.config.epochs)
        self._epoch_started += self.evaluator.eval_s - eval_before  # not the next epoch's

    def evaluate_now(self, model: nn.Module, state: PlanState) -> None:
        """An evaluation within an epoch (``run.evaluate(..., every=N)``): the timeline's
        ``eval`` event, TensorBoard's ``eval/<metric>`` at the samples so far, a line on rank
        0's terminal."""
        self.evaluator.evaluate(model, state, batch_size=self.config.batch_size)
        samples, last = state.samples_seen, self.evaluator.last
        self.timeline.event("eval", samples=samples, eval=last)
        if self.rank == 0:
            if self.tensorboard is not None:
                self.tensorboard.scalars({f"eval/{k}": v for k, v in last.items()},
                                         samples=samples, tag_prefix="")
            shown = "  ".join(f"{k} {v:.4f}" for k, v in last.items())
            from fdl import console

            console.info(f"step {samples} samples  {shown}")

    def scalars(self, means: dict[str, float], *, position: float) -> None:
        """A round's means of what the script logged, to TensorBoard (rank 0)."""
        if self.tensorboard is not None:
            self.tensorboard.scalars(means, samples=int(position))

    def figures(self, tallies: Tallies) -> RankFigures:
        """This rank's figures for the epoch that is ending (samples, busy and averaging
        time, the loss sums); the marks move to now. The boundary takes them as it packs the
        epoch's last average, which carries every rank's: its own wait is then counted in the
        next epoch's, which no epoch record reads."""
        totals = tallies.totals.figures
        loss_sum, loss_steps = tallies.rank_state.epoch_loss
        mine = replace(totals.minus(self._mark), loss_sum=loss_sum, loss_steps=loss_steps)
        self._mark = totals
        tallies.rank_state.epoch_loss = [0.0, 0]
        return mine

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _exchange(self, mine: RankFigures, device: Any) -> list[RankFigures]:
        """Every rank's figures for the epoch, in one collective (no average carried them:
        one rank alone)."""
        rows = exchange_rows(mine.to_row(), rank=self.rank, world_size=self.world_size,
                             device=device)
        return [RankFigures.from_row(row) for row in rows]

    def _record(self, ending: EpochEnd, per_rank: list[RankFigures]) -> EpochRecord:
        state, epoch_s, comm_ms = ending.state, ending.epoch_s, ending.comm_ms
        samples = state.samples_seen
        done_here, elapsed = samples - self.start_samples, ending.elapsed_s
        busiest = max((r.busy_s for r in per_rank), default=0.0)
        # the communication proper of the averages and of DDP's all-reduce: the least over ranks
        sync_s = sum(comm_ms) / 1000 + min((r.comm_s for r in per_rank), default=0.0)
        return EpochRecord(
            epoch=ending.epoch + 1, samples=samples, train_loss=self.last_loss,
            eval=self.evaluator.last,
            samples_per_s=done_here / elapsed if elapsed > 0 else None,
            elapsed_s=round(self.start_elapsed_s + elapsed, 6), epoch_s=round(epoch_s, 6),
            epoch_samples_per_s=_rate(sum(r.samples for r in per_rank), epoch_s),
            per_rank_samples_per_s=[_rate(r.samples, epoch_s) for r in per_rank],
            idle_fraction=[max(0.0, 1 - r.busy_s / epoch_s) if epoch_s > 0 else None
                           for r in per_rank],
            sync_overhead=sync_s / busiest if (comm_ms or sync_s) and busiest > 0 else None,
            anchor=state.anchor)


def _rate(samples: float, seconds: float) -> float | None:
    return samples / seconds if seconds > 0 else None


def _progress_line(record: EpochRecord, epochs: int) -> None:
    """``epoch 1/3  loss 0.3845  47587 samples/s  eval: accuracy 0.9058, loss 0.2990``: the
    train loss, then the evaluation's metrics after ``eval:`` (an evaluation's own ``loss``
    read as a second train loss when they stood side by side)."""
    from fdl import console

    shown = ", ".join(f"{k} {v:.4f}" for k, v in record.eval.items())
    loss = f"loss {record.train_loss:.4f}  " if record.train_loss is not None else ""
    rate = f"{record.samples_per_s:.0f} samples/s" if record.samples_per_s is not None else ""
    console.info(f"epoch {record.epoch}/{epochs}  {loss}{rate}"
                 + (f"  eval: {shown}" if shown else ""))
