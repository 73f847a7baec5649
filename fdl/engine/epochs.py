"""What happens at the end of every epoch: the global train loss, the evaluation (its time kept out
of throughput), the history record, ``metrics.jsonl`` and TensorBoard (rank 0), and the epoch's
line on rank 0's terminal.

One collective per epoch carries the loss and each rank's share of the epoch (samples, busy and
averaging time), so rank 0 can write per-rank figures without a second message. A record
(``metrics.jsonl``, docs/run.md "Run directory")::

    {"epoch": 2, "samples": 120000, "train_loss": 0.2987, "eval": {"accuracy": 0.8979},
     "samples_per_s": 48464.6, "elapsed_s": 2.476, "epoch_s": 1.176,
     "epoch_samples_per_s": 50999.7, "per_rank_samples_per_s": [33537.4, 17462.3],
     "idle_fraction": [0.136, 0.019], "sync_overhead": 0.0047, "anchor": 103}

``samples_per_s`` is over the run so far (this attempt), ``elapsed_s`` the training time since the
run began (evaluation left out, earlier attempts included), the rest cover this epoch alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fdl.engine import summary as artifacts
from fdl.engine.config import EngineConfig
from fdl.engine.evaluation import all_reduce_sum, evaluate_model
from fdl.engine.plan import PlanState
from fdl.engine.tensorboard import ScalarWriter

if TYPE_CHECKING:
    from fdl.engine.rounds import Worker

NUM_RANK_FIELDS = 3  # samples, busy_s, wait_s this epoch


class Script(Protocol):
    """What an epoch's end needs of fdl.Trainer (a protocol: the trainer imports this module)."""

    train_data: Any
    eval_data: Any
    evaluate: Any
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
    _epoch_started: float = field(default_factory=time.perf_counter)
    _mark: tuple[int, float, float, int] = (0, 0.0, 0.0, 0)  # totals at the last epoch's end

    def restore(self, history: list[dict[str, Any]], *, start_samples: int) -> None:
        self.start_samples = start_samples
        if history:
            self.last_eval, self.last_loss = history[-1]["eval"], history[-1]["train_loss"]
            elapsed = history[-1].get("elapsed_s")
            self.start_elapsed_s = float(elapsed) if isinstance(elapsed, (int, float)) else 0.0

    def begin(self, worker: Worker) -> None:
        """Training starts now: the clocks start, and rank 0 opens TensorBoard if asked."""
        self.started = self._epoch_started = time.perf_counter()
        self._mark = _totals(worker)
        if self.rank == 0 and self.config.tensorboard is not None:
            self.tensorboard = ScalarWriter.open(self.config.tensorboard, run_dir=self.run_dir,
                                                 purge_step=self.start_samples or None)

    def epoch_end(self, epoch: int, worker: Worker, state: PlanState) -> None:
        now = time.perf_counter()
        elapsed, epoch_s = now - self.started - self.eval_s, now - self._epoch_started
        comm_ms = worker.totals.comm_ms[self._mark[3]:]
        loss_sum, count, per_rank = self._gather(worker)
        self.last_loss = loss_sum / count if count else None
        begin = time.perf_counter()
        if self.trainer.eval_data is not None and self.trainer.evaluate is not None:
            self.last_eval = evaluate_model(
                worker.model, self.trainer.eval_data, self.trainer.evaluate,
                batch_size=self.config.batch_size, device=worker.device, rank=self.rank,
                world_size=self.world_size)
        self.eval_s += time.perf_counter() - begin
        record = self._record(epoch, state, epoch_s=epoch_s, per_rank=per_rank,
                              comm_ms=comm_ms, elapsed=elapsed)
        self.trainer.history.append(record)
        worker.timeline.event("epoch", epoch=epoch + 1, train_loss=self.last_loss,
                              eval=self.last_eval)
        if self.rank == 0:
            if self.run_dir is not None:
                artifacts.append_jsonl(self.run_dir / "metrics.jsonl", record)
            if self.tensorboard is not None:
                self.tensorboard.epoch(record)
            _progress_line(record, self.config.epochs)
        self._epoch_started = time.perf_counter()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _gather(self, worker: Worker) -> tuple[float, float, list[list[float]]]:
        """The epoch's loss (sum, count) over ranks, and each rank's [samples, busy_s, wait_s]
        this epoch, in one collective."""
        totals = _totals(worker)
        mine = [totals[i] - self._mark[i] for i in range(NUM_RANK_FIELDS)]
        self._mark = totals
        row = [*worker.rank_state.epoch_loss] + [0.0] * (NUM_RANK_FIELDS * self.world_size)
        start = 2 + NUM_RANK_FIELDS * worker.rank
        row[start:start + NUM_RANK_FIELDS] = mine
        worker.rank_state.epoch_loss = [0.0, 0]
        flat = all_reduce_sum(row, device=worker.device)
        per_rank = [flat[2 + NUM_RANK_FIELDS * r: 2 + NUM_RANK_FIELDS * (r + 1)]
                    for r in range(self.world_size)]
        return flat[0], flat[1], per_rank

    def _record(self, epoch: int, state: PlanState, *, epoch_s: float,
                per_rank: list[list[float]], comm_ms: list[float],
                elapsed: float) -> dict[str, Any]:
        samples = (epoch + 1) * len(self.trainer.train_data)
        done_here = samples - self.start_samples
        busiest = max((row[1] for row in per_rank), default=0.0)
        return {
            "epoch": epoch + 1, "samples": samples, "train_loss": self.last_loss,
            "eval": self.last_eval,
            "samples_per_s": done_here / elapsed if elapsed > 0 else None,
            "elapsed_s": round(self.start_elapsed_s + elapsed, 6),
            "epoch_s": round(epoch_s, 6),
            "epoch_samples_per_s": _rate(sum(row[0] for row in per_rank), epoch_s),
            "per_rank_samples_per_s": [_rate(row[0], epoch_s) for row in per_rank],
            "idle_fraction": [max(0.0, 1 - row[1] / epoch_s) if epoch_s > 0 else None
                              for row in per_rank],
            "sync_overhead": sum(comm_ms) / 1000 / busiest if comm_ms and busiest > 0 else None,
            "anchor": state.anchor,
        }


def _totals(worker: Worker) -> tuple[int, float, float, int]:
    totals = worker.totals
    return totals.samples, totals.busy_s, totals.wait_s, len(totals.comm_ms)


def _rate(samples: float, seconds: float) -> float | None:
    return samples / seconds if seconds > 0 else None


def _progress_line(record: dict[str, Any], epochs: int) -> None:
    from fdl import console

    metrics = "  ".join(f"{k} {v:.4f}" for k, v in record["eval"].items())
    loss = record["train_loss"]
    console.info(f"epoch {record['epoch']}/{epochs}  loss {loss:.4f}  "
                 f"{record['samples_per_s']:.0f} samples/s" + (f"  {metrics}" if metrics else ""))
