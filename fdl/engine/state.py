"""What one rank carries from round to round (:class:`RankState`) and what it tells the others
about a round (:class:`RoundReport`), as plain data: the round loop, recovery and the simulator
all use these, so a checkpoint saves exactly what the loop reads and the simulator follows the
engine's own bookkeeping.

A round's report travels in the averaging collective: rank r fills row r of a block of
``len(REPORT_FIELDS)`` numbers per rank, the SUM all-reduce gives every rank every row, and
:func:`round_stats` turns the rows into the planner's :class:`~fdl.engine.plan.RoundStats` —
the same on every rank. ``wait_ms`` and ``distance`` describe the *previous* average (this one
is not over when the row is packed). Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from fdl.engine.plan import RoundStats

NAN = math.nan
NO_DISTANCE = -1.0  # a report before any average measured one


@dataclass(frozen=True)
class RoundReport:
    """One rank's figures for one round."""

    busy_ms: float  # whole steps (data, host work, compute, emulated slowdown) less DDP's comm
    samples: int  # the samples busy_ms covers
    wait_ms: float  # what this rank's previous average cost it (NaN: none yet)
    distance: float  # ||snapshot - average|| / ||average|| at the previous average, or -1
    since_checkpoint_s: float  # this rank's clock since the last checkpoint (or the start)
    elapsed_s: float = 0.0  # this rank's training clock since the run began (max_time)

    def to_row(self) -> list[float]:
        return [float(getattr(self, name)) for name in REPORT_FIELDS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RoundReport:
        values = dict(zip(REPORT_FIELDS, row, strict=True))
        samples = values["samples"]
        values["samples"] = int(samples) if math.isfinite(samples) else 0
        return cls(**values)


REPORT_FIELDS = tuple(f.name for f in fields(RoundReport))


@dataclass(frozen=True)
class RankFigures:
    """What one rank did over a stretch of training (the run for ``summary.json``, an epoch for
    ``metrics.jsonl``), as every rank learns it: each rank's figures cross ranks as one row of
    a single SUM all-reduce (fdl.engine.collectives.exchange_rows), packed and unpacked here."""

    samples: float = 0.0  # samples trained
    busy_s: float = 0.0  # whole steps, emulated sleep included, DDP's all-reduce not
    sleep_s: float = 0.0  # emulated slowdown
    wait_s: float = 0.0  # blocked at averages
    comm_s: float = 0.0  # in DDP's gradient all-reduce inside the steps (sync)
    data_s: float = 0.0  # waiting for batches inside the steps (part of busy_s)
    loss_sum: float = 0.0  # the stretch's summed step losses, and how many steps they are
    loss_steps: float = 0.0

    def to_row(self) -> list[float]:
        return [float(getattr(self, name)) for name in FIGURE_FIELDS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankFigures:
        return cls(**dict(zip(FIGURE_FIELDS, row, strict=True)))

    def minus(self, earlier: RankFigures) -> RankFigures:
        """The figures of the stretch since ``earlier`` (a mark taken from the same totals)."""
        return RankFigures(*(a - b for a, b in zip(self.to_row(), earlier.to_row(), strict=True)))


FIGURE_FIELDS = tuple(f.name for f in fields(RankFigures))
# A rank's stats row in an average: its round's report, then, in the epoch's last average, its
# figures for the epoch (zeros in the others): the epoch's end needs no collective of its own.
NUM_REPORT = len(REPORT_FIELDS)
NUM_STATS = NUM_REPORT + len(FIGURE_FIELDS)
NO_FIGURES = [0.0] * len(FIGURE_FIELDS)
NO_PEAK = -1  # a rank off CUDA has no peak memory figure (a row carries numbers only)


@dataclass(frozen=True)
class RankEnd:
    """What one rank tells the others at the run's end (``summary.json``): its figures over the
    run, the size of its micro-batches, its GPU's peak allocated bytes (None off CUDA), fdl's
    own averaging memory on the device and in host memory, and whether its forward passes ran
    in its precision (a loop that never entered ``run.autocast()`` computed in fp32). Whole
    numbers a float64 row carries exactly."""

    figures: RankFigures
    micro_batch_size: int
    peak_memory_bytes: int | None
    fdl_device_bytes: int
    fdl_host_bytes: int
    in_precision: bool = True

    def to_row(self) -> list[float]:
        peak = NO_PEAK if self.peak_memory_bytes is None else self.peak_memory_bytes
        return [*self.figures.to_row(), float(self.micro_batch_size), float(peak),
                float(self.fdl_device_bytes), float(self.fdl_host_bytes),
                float(self.in_precision)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankEnd:
        count = len(FIGURE_FIELDS)
        micro, peak, device, host, applied = (int(value) for value in row[count:])
        return cls(RankFigures.from_row(row[:count]), micro, None if peak < 0 else peak, device,
                   host, bool(applied))


def round_stats(reports: Sequence[RoundReport]) -> RoundStats:
    """The planner's view of a round. ``sync_ms`` is the smallest wait over ranks — the
    communication proper, since every other rank also waited for the slowest one — and
    unknown (NaN) unless every rank reported one."""
    waits = [r.wait_ms for r in reports]
    sync_ms = min(waits) if all(math.isfinite(w) for w in waits) else NAN
    return RoundStats(tuple(r.busy_ms for r in reports), tuple(r.samples for r in reports),
                      sync_ms)


def largest_distance(reports: Sequence[RoundReport]) -> float:
    """The divergence guard's input: the largest distance any rank reported; ``NO_DISTANCE``
    when none did. A NaN or infinite distance (a replica that blew up) counts as infinite."""
    values = [r.distance for r in reports if not r.distance < 0]
    if not values:
        return NO_DISTANCE
    return max(v if math.isfinite(v) else math.inf for v in values)


@dataclass
class GuardState:
    """The divergence guard's memory (see :mod:`fdl.engine.guard`)."""

    baseline_sum: float = 0.0
    baseline_rounds: int = 0
    streak: int = 0
    calm: int = 0


@dataclass
class RankState:
    """Everything one rank keeps between rounds besides the model, the optimizer and the plan.
    Recovery saves it with :meth:`to_dict` and restores it with :meth:`from_dict`."""

    step_count: int = 0  # slowdown emulation: the running mean of compute per step,
    step_total_s: float = 0.0  # as (count, count x mean) (fdl.engine.speed.RunningMean)
    epoch_loss: list[float] = field(default_factory=lambda: [0.0, 0])
    last_wait_ms: float = NAN
    last_distance: float = NO_DISTANCE
    last_blocking_ms: float = 0.0
    guard: GuardState = field(default_factory=GuardState)

    def report(self, *, busy_ms: float, samples: int, since_checkpoint_s: float,
               elapsed_s: float = 0.0) -> RoundReport:
        return RoundReport(busy_ms=busy_ms, samples=samples, wait_ms=self.last_wait_ms,
                           distance=self.last_distance, since_checkpoint_s=since_checkpoint_s,
                           elapsed_s=elapsed_s)

    def after_sync(self, elapsed_ms: float, *, blocking: bool) -> None:
        """Book what an average cost this rank. A background average still costs its full
        time in CPU, memory and link bandwidth that the compute shares (on a host whose cores
        the workers fill, all of it): it counts at least at what the last blocking average
        cost, or the anchor shrinks and averages multiply, each slowing the compute."""
        if blocking:
            self.last_blocking_ms = elapsed_ms
            self.last_wait_ms = elapsed_ms
        else:
            self.last_wait_ms = max(elapsed_ms, self.last_blocking_ms)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RankState:
        """The inverse of :meth:`to_dict`; ``ValueError`` for anything else (a checkpoint is
        read back as untrusted data)."""
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError(f"rank state has fields {sorted(data) if isinstance(data, dict) else data!r}")
        guard = data["guard"]
        if not isinstance(guard, dict) or set(guard) != {f.name for f in fields(GuardState)}:
            raise ValueError(f"rank state's guard is {guard!r:.80}")
        state = cls(**{**data, "guard": GuardState(**guard)})  # type: ignore[arg-type]
        _check_types(state)
        return state


def _check_types(state: RankState) -> None:
    numbers = (state.step_total_s, state.last_wait_ms, state.last_distance,
               state.last_blocking_ms, state.guard.baseline_sum)
    counts = (state.step_count, state.guard.baseline_rounds, state.guard.streak,
              state.guard.calm)
    ok = (all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers)
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in counts)
          and isinstance(state.epoch_loss, list) and len(state.epoch_loss) == 2
          and all(isinstance(x, (int, float)) for x in state.epoch_loss))
    if not ok:
        raise ValueError(f"rank state holds values of the wrong type: {state!r:.200}")
