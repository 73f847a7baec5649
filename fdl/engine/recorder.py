"""What happens at the end of every epoch: the global train loss, the evaluation (its time kept out
of throughput), the history record, ``metrics.jsonl`` and TensorBoard (rank 0), and the epoch's
line on rank 0's terminal.

One collective per epoch carries the loss and each rank's share of the epoch (samples, busy and
averaging time), so rank 0 can write per-rank figures without a second message. The epoch's
clock and this rank's figures are taken at its last boundary; the rest waits for the model to
be the consensus: at once after a blocking average, a round later under async
(fdl.engine.rounds). A record (``metrics.jsonl``, docs/run.md "Run directory")::

    {"epoch": 2, "samples": 120000, "train_loss": 0.2987, "eval": {"accuracy": 0.8979},
     "samples_per_s": 48464.6, "elapsed_s": 2.476, "epoch_s": 1.176,
     "epoch_samples_per_s": 50999.7, "per_rank_samples_per_s": [33537.4, 17462.3],
     "idle_fraction": [0.136, 0.019], "sync_overhead": 0.0047, "anchor": 103}

``samples_per_s`` is over the run so far (this attempt), ``elapsed_s`` the training time since the
run began (evaluation left out, earlier attempts included), the rest cover this epoch alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fdl.engine.averaging import checksum
from fdl.engine.collectives import exchange_rows
from fdl.engine.config import EngineConfig
from fdl.engine.evaluation import evaluate_model
from fdl.engine.plan import PlanState
from fdl.engine.state import RankFigures
from fdl.engine.tensorboard import ScalarWriter
from fdl.rundir import metrics
from fdl.rundir.metrics import EpochRecord

if TYPE_CHECKING:
    from fdl.engine.rounds import Replica


class Script(Protocol):
    """What an epoch's end needs of the run (fdl.engine.loop.Run: a protocol, the loop imports
    this module)."""

    evaluations: list[Any]  # each with data, fn, derive and name (fdl.engine.loop._Evaluation)
    history: list[dict[str, Any]]


@dataclass
class EpochLog:
    trainer: Script
    config: EngineConfig
    run_dir: Path | None  # rank 0's; None on the others (they write nothing)
    rank: int
    world_size: int
    eval_s: float = 0.0
    last_eval: dict[str, float] = field(default_factory=dict)
    last_loss: float | None = None
    start_samples: int = 0  # > 0 when resumed: this attempt's throughput counts its own samples
    start_elapsed_s: float = 0.0  # training time of the attempts before this one
    started: float = field(default_factory=time.perf_counter)
    tensorboard: ScalarWriter | None = None
    _replica: Replica | None = None
    epochs_total: int | None = None  # the epochs a budget leaves (the last may be cut)
    at_epoch_end: list[Any] = field(default_factory=list)  # run.at_epoch_end's functions
    _epoch_started: float = field(default_factory=time.perf_counter)
    _mark: RankFigures = field(default_factory=RankFigures)  # totals at the last epoch's end
    _mark_syncs: int = 0  # averages done by the last epoch's end

    def restore(self, history: list[dict[str, Any]], *, start_samples: int) -> None:
        self.start_samples = start_samples
        if history:
            self.last_eval, self.last_loss = history[-1]["eval"], history[-1]["train_loss"]
            elapsed = history[-1].get("elapsed_s")
            self.start_elapsed_s = float(elapsed) if isinstance(elapsed, (int, float)) else 0.0

    def begin(self, replica: Replica) -> None:
        """Training starts now: the clocks start, and rank 0 opens TensorBoard if asked."""
        self.started = self._epoch_started = time.perf_counter()
        self._replica = replica
        self._mark, self._mark_syncs = replica.totals.figures(), len(replica.totals.comm_ms)
        if self.rank == 0 and self.config.tensorboard is not None:
            self.tensorboard = ScalarWriter.open(self.config.tensorboard, run_dir=self.run_dir,
                                                 purge_step=self.start_samples or None)

    def epoch_end(self, epoch: int, replica: Replica, state: PlanState) -> Callable[[], None]:
        """Epoch ``epoch`` ended: its clock and this rank's figures are taken now; the rest —
        the figures' exchange, the evaluation of the consensus model, the record, the hooks,
        the line — is the function returned, which every rank calls at the same point: at once
        after a blocking average, or under async when the epoch's average lands, its consensus
        loaded for the evaluation (fdl.engine.rounds)."""
        now = time.perf_counter()
        elapsed, epoch_s = now - self.started - self.eval_s, now - self._epoch_started
        comm_ms = replica.totals.comm_ms[self._mark_syncs:]
        self._mark_syncs = len(replica.totals.comm_ms)
        # with an averager, the epoch's last average carried every rank's figures (every
        # policy averages at an epoch's end: fdl.engine.rounds.average); a rank alone sums its own
        mine = None if replica.averager is not None else self.figures(replica)
        self._epoch_started = now

        def finish() -> None:
            eval_before = self.eval_s
            per_rank = self._carried(replica) if mine is None else self._exchange(mine, replica)
            steps = sum(r.loss_steps for r in per_rank)
            self.last_loss = sum(r.loss_sum for r in per_rank) / steps if steps else None
            self._evaluate(replica, state)
            record = self._record(epoch, state, epoch_s=epoch_s, per_rank=per_rank,
                                  comm_ms=comm_ms, elapsed=elapsed)
            self.trainer.history.append(record.to_dict())
            for hook in self.at_epoch_end:
                hook(dict(self.trainer.history[-1]))
            verified = {"checksum": checksum(replica.model)} if replica.verify else {}
            replica.timeline.event("epoch", epoch=epoch + 1, train_loss=self.last_loss,
                                  eval=self.last_eval, **verified)
            if self.rank == 0:
                if self.run_dir is not None:
                    metrics.append_epoch(self.run_dir, record)
                if self.tensorboard is not None:
                    self.tensorboard.epoch(record)
                _progress_line(record, self.epochs_total or self.config.epochs)
            self._epoch_started += self.eval_s - eval_before  # not the next epoch's time

        return finish

    def _evaluate(self, replica: Replica, state: PlanState) -> None:
        """The evaluation of the consensus model on each set the script gave (a named set's
        metrics as ``<name>/<metric>``), its time kept out of throughput."""
        begin = time.perf_counter()
        evaluated: dict[str, float] = {}
        for evaluation in self.trainer.evaluations:
            means = evaluate_model(
                replica.model, evaluation.data, evaluation.fn,
                batch_size=self.config.batch_size, device=replica.device, rank=self.rank,
                world_size=self.world_size, derive=evaluation.derive,
                # sharded by measured speed (the same on every rank): the fast rank takes more
                weights=[1 / ms for ms in state.ms_per_sample] if state.calibrated else None)
            evaluated.update(means if evaluation.name is None
                             else {f"{evaluation.name}/{key}": v for key, v in means.items()})
        if self.trainer.evaluations:
            self.last_eval = evaluated
        self.eval_s += time.perf_counter() - begin

    def evaluate_now(self, replica: Replica, state: PlanState) -> None:
        """An evaluation within an epoch (``run.evaluate(..., every=N)``): the timeline's
        ``eval`` event, TensorBoard's ``eval/<metric>`` at the samples so far, a line on rank
        0's terminal."""
        self._evaluate(replica, state)
        samples = state.samples_seen
        replica.timeline.event("eval", samples=samples, eval=self.last_eval)
        if self.rank == 0:
            if self.tensorboard is not None:
                self.tensorboard.scalars({f"eval/{k}": v for k, v in self.last_eval.items()},
                                         samples=samples, tag_prefix="")
            shown = "  ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items())
            from fdl import console

            console.info(f"step {samples} samples  {shown}")

    def scalars(self, means: dict[str, float]) -> None:
        """A round's means of what the script logged, to TensorBoard (rank 0)."""
        if self.tensorboard is not None and self._replica is not None:
            self.tensorboard.scalars(means, samples=int(self._replica.position))

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def figures(self, replica: Replica) -> RankFigures:
        """This rank's figures for the epoch that is ending (samples, busy and averaging
        time, the loss sums); the marks move to now. The round loop takes them as it packs the
        epoch's last average, which carries every rank's (``Replica.epoch_figures``): its own
        wait is then counted in the next epoch's, which no epoch record reads."""
        totals = replica.totals.figures()
        loss_sum, loss_steps = replica.rank_state.epoch_loss
        mine = replace(totals.minus(self._mark), loss_sum=loss_sum, loss_steps=loss_steps)
        self._mark = totals
        replica.rank_state.epoch_loss = [0.0, 0]
        return mine

    @staticmethod
    def _carried(replica: Replica) -> list[RankFigures]:
        """Every rank's figures for the epoch, as the epoch's last average brought them."""
        rows, replica.epoch_rows = replica.epoch_rows, None
        if rows is None:
            raise AssertionError("the epoch's figures rode in an average that has not landed")
        return rows

    def _exchange(self, mine: RankFigures, replica: Replica) -> list[RankFigures]:
        """Every rank's figures for the epoch, in one collective (no average carried them:
        one rank alone)."""
        rows = exchange_rows(mine.to_row(), rank=replica.rank, world_size=self.world_size,
                             device=replica.device)
        return [RankFigures.from_row(row) for row in rows]

    def _record(self, epoch: int, state: PlanState, *, epoch_s: float,
                per_rank: list[RankFigures], comm_ms: list[float],
                elapsed: float) -> EpochRecord:
        samples = state.samples_seen
        done_here = samples - self.start_samples
        busiest = max((r.busy_s for r in per_rank), default=0.0)
        # the communication proper of the averages and of DDP's all-reduce: the least over ranks
        sync_s = sum(comm_ms) / 1000 + min((r.comm_s for r in per_rank), default=0.0)
        return EpochRecord(
            epoch=epoch + 1, samples=samples, train_loss=self.last_loss, eval=self.last_eval,
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
