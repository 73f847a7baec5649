"""What one rank counts and times while it trains: its totals over the run, its round-to-round
bookkeeping (what a checkpoint keeps of it), the scalars the script logs and the clocks.

The round loop (fdl.engine.rounds) and its boundary (fdl.engine.boundary) are the only writers;
the epoch's end, the live progress, ``run.progress`` and the summary read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from fdl.engine.plan import RoundPlan
from fdl.engine.speed import RunningMean
from fdl.engine.state import RankFigures, RankState
from fdl.engine.steps import Logged


@dataclass
class Totals:
    """This rank's totals over the run: its figures (what the ranks exchange for an epoch and
    for the run), its optimizer steps, its averages and what each cost (the least over the
    ranks, the communication proper)."""

    figures: RankFigures = field(default_factory=RankFigures)
    steps: int = 0
    syncs: int = 0
    comm_ms: list[float] = field(default_factory=list)

    def add(self, **amounts: float) -> None:
        """Add to the figures named (``busy_s=0.5``)."""
        self.figures = replace(self.figures, **{name: getattr(self.figures, name) + amount
                                                for name, amount in amounts.items()})


@dataclass(eq=False)
class Tallies:
    """One rank's counts and clocks (see the module docstring)."""

    slowdown: float = 1.0  # this rank's emulated slowdown factor (fdl.engine.speed)
    totals: Totals = field(default_factory=Totals)
    rank_state: RankState = field(default_factory=RankState)  # what recovery saves
    logged: Logged = field(default_factory=Logged)  # run.log's scalars, summed on the device
    position: float = 0.0  # samples of the run done, as this rank's share of the round stands
    started: float = field(default_factory=time.perf_counter)  # the training clock's zero
    time_up: bool = False  # max_time passed: the next round is the last
    # The optimizer's LR now over its LR when the run began: the divergence guard divides the
    # replicas' drift by it.
    lr_scale: float = 1.0
    # The slowdown emulation's memory across rounds: the recent steps' compute (rank_state
    # keeps its value for checkpoints) and the oversleep the next sleeps pay back.
    compute_mean: RunningMean | None = None
    sleep_owed_s: float = 0.0
    round_plan: RoundPlan | None = None  # the round running now

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started
