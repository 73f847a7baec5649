"""El Che round planning: who runs how many steps on which samples, as pure functions.

Training is a sequence of rounds. Between two averaging events rank ``r`` runs ``c_r``
optimizer steps of ``batch_size`` samples. The slowest rank runs ``anchor`` steps and every
other rank ``c_r = max(1, round(anchor * ms_slow / ms_r))``, so a fast device does more work
instead of waiting. Each averaging event also exchanges every rank's timing stats, so all ranks
hold the same ``PlanState`` and compute the same ``RoundPlan`` from it: no coordinator, no extra
messages. Nothing here does I/O, reads a clock or draws a random number::

    state = initial_state(PlanConfig(world_size=2, batch_size=64, dataset_size=50_000, epochs=5))
    while not state.finished:
        plan = next_round(state)           # identical on every rank
        ...                                # run plan.slices[rank], average with plan.weights()
        state = advance(state, plan, stats)

Epoch ``e`` is one stream of ``dataset_size`` sample positions (the engine maps positions to a
permutation seeded by ``(seed, e)``). A round takes the next ``sum(c_r) * batch_size`` positions,
rank 0 first; the round that reaches the end of the epoch is cut to what remains, so rounds never
cross an epoch and all ranks finish an epoch together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fdl.errors import UsageError
from fdl.settings import ENGINE_DEFAULTS, POLICIES

EMA_MIN_ALPHA, EMA_MAX_ALPHA = 0.3, 0.8
# Float noise must not add a step: 3 * 0.1 / 0.05 is 6.000000000000001, not 6.
_CEIL_TOLERANCE = 1e-9


class PlanConfigError(UsageError, ValueError):
    """A ``PlanConfig`` field that cannot be used (a ``ValueError``, and exit 2 from the CLI)."""


@dataclass(frozen=True)
class PlanConfig:
    """What the plan needs to know about the run; validated on construction.

    ``overhead_target`` is the wanted sync time / compute time per round; ``dead_zone`` the
    relative change in a rank's ideal step count below which its count is left as it was.
    """

    world_size: int
    batch_size: int
    dataset_size: int
    epochs: int
    policy: str = ENGINE_DEFAULTS["policy"]
    initial_anchor: int = 4
    min_anchor: int = 1
    max_anchor: int = 200
    overhead_target: float = ENGINE_DEFAULTS["overhead_target"]
    # Small on purpose: a dead zone as wide as 10% lets a 10% imbalance stand, and the fast
    # rank idles for exactly that long every round (measured with scripts/bench-elche).
    dead_zone: float = 0.02

    def __post_init__(self) -> None:
        for name in ("world_size", "batch_size", "epochs", "min_anchor"):
            _check_int(name, getattr(self, name), 1)
        _check_int("dataset_size", self.dataset_size, self.world_size * self.batch_size,
                   why="world_size * batch_size: one batch per worker")
        _check_int("max_anchor", self.max_anchor, self.min_anchor, why="min_anchor")
        _check_int("initial_anchor", self.initial_anchor, self.min_anchor, self.max_anchor,
                   why="[min_anchor, max_anchor]")
        target, zone = self.overhead_target, self.dead_zone
        _check("overhead_target", target, _is_real(target) and 0 < target < math.inf,
               "a finite number > 0")
        _check("dead_zone", zone, _is_real(zone) and 0 <= zone < 1, "a number in [0, 1)")
        _check("policy", self.policy, self.policy in POLICIES, " | ".join(POLICIES))


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None, why: str = "") -> None:
    ok = _is_real(value) and isinstance(value, int) and value >= low
    ok = ok and (high is None or value <= high)
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    _check(name, value, ok, allowed + (f" ({why})" if why else ""))


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise PlanConfigError(f"{name} = {value!r} is not allowed; expected {allowed}")


@dataclass(frozen=True)
class RankSlice:
    """Rank ``rank`` runs ``steps`` steps on the epoch's sample positions ``[start, stop)``.

    ``stop - start == steps * batch_size`` except in a round cut at the end of an epoch, where a
    rank's last batch may be partial (``steps == ceil((stop - start) / batch_size)``).
    """

    rank: int
    steps: int
    start: int
    stop: int

    @property
    def num_samples(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RoundPlan:
    """One round: per-rank step counts and contiguous, disjoint sample slices in rank order."""

    round_index: int
    epoch: int
    anchor: int
    counts: tuple[int, ...]
    slices: tuple[RankSlice, ...]
    last_in_epoch: bool

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.slices)

    def weights(self) -> tuple[float, ...]:
        """Averaging weights: ``w_r = samples_r / samples_total`` (0.0 for a rank with none)."""
        total = self.num_samples
        return tuple(s.num_samples / total for s in self.slices)


@dataclass(frozen=True)
class RoundStats:
    """What every rank learns at an averaging event.

    ``step_ms[r]``: rank r's mean ms per optimizer step in the round (NaN for a rank that ran no
    step: it keeps its estimate). ``sync_ms``: the averaging's duration (max over ranks).
    ``compute_ms``: max over ranks of compute time in the round.
    """

    step_ms: tuple[float, ...]
    sync_ms: float
    compute_ms: float


@dataclass(frozen=True, kw_only=True)
class PlanState:
    """Everything the plan depends on; the same on every rank after every averaging.

    ``speed_ms[r]`` is rank r's EMA of ms per step (``None`` until measured). ``anchor_history``
    holds ``(round_index, new_anchor, reason)`` for every change, ``round_index`` being the
    first round planned with the new anchor. ``prev_counts`` are the last round's counts before
    any cut at the epoch end (the dead zone compares against them).
    """

    config: PlanConfig
    round_index: int = 0
    epoch: int = 0
    position: int = 0
    anchor: int
    speed_ms: tuple[float | None, ...]
    anchor_history: tuple[tuple[int, int, str], ...] = ()
    prev_counts: tuple[int, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.epoch == self.config.epochs

    @property
    def samples_seen(self) -> int:
        """``epoch * dataset_size + position``; LR schedules use ``progress = samples_seen /
        (epochs * dataset_size)``, never per-rank step counts."""
        return self.epoch * self.config.dataset_size + self.position


def initial_state(config: PlanConfig) -> PlanState:
    """The state before the first round (anchor 1 under ``sync``: one DDP step per round)."""
    anchor = 1 if config.policy == "sync" else config.initial_anchor
    return PlanState(config=config, anchor=anchor, speed_ms=(None,) * config.world_size)


def ema(old: float | None, new: float) -> float:
    """Error-adaptive EMA: the first sample raw, then ``old + alpha * (new - old)``.

    ``alpha = clamp(|new - old| / old, 0.3, 0.8)``: a large change (a device throttling, another
    job starting) is followed quickly, measurement noise is smoothed. Each sample is already
    the mean of a whole round's steps, so the floor is 0.3 (flodl's 0.1 followed a drifting
    device so slowly that the counts lagged it for many rounds).
    """
    if not (math.isfinite(new) and new > 0):
        raise ValueError(f"ema: new = {new!r} must be a finite number > 0")
    if old is None:
        return new
    if not old > 0:
        raise ValueError(f"ema: old = {old!r} must be > 0 or None")
    alpha = min(max(abs(new - old) / old, EMA_MIN_ALPHA), EMA_MAX_ALPHA)
    return old + alpha * (new - old)


def step_counts(
    *, anchor: int, speed_ms: Sequence[float | None], prev: Sequence[int] | None, dead_zone: float
) -> tuple[int, ...]:
    """Steps per rank: the slowest rank runs ``anchor``, rank r ``max(1, round(anchor * ms_slow
    / ms_r))`` (half rounds up). An unmeasured rank (``None``) counts as the slowest known one;
    with none measured every rank runs ``anchor``.

    Dead zone: ``prev`` was planned with anchor ``min(prev)`` (the slowest rank ran exactly the
    anchor). If that equals ``anchor`` and every rank's ideal count ``max(1, anchor * ms_slow /
    ms_r)`` is within ``dead_zone`` (relative, strictly) of its previous count, ``prev`` is
    kept, so speed jitter does not change counts from round to round.
    """
    if anchor < 1:
        raise ValueError(f"step_counts: anchor = {anchor} must be >= 1")
    known = [ms for ms in speed_ms if ms is not None]
    if any(not (math.isfinite(ms) and ms > 0) for ms in known):
        raise ValueError(f"step_counts: speed_ms = {tuple(speed_ms)!r} must be finite and > 0")
    slow = max(known, default=1.0)
    ideal = [max(1.0, anchor * slow / (slow if ms is None else ms)) for ms in speed_ms]
    if (prev is not None and len(prev) == len(ideal) and min(prev, default=0) == anchor
            and all(abs(x - p) < dead_zone * p for x, p in zip(ideal, prev, strict=True))):
        return tuple(prev)
    return tuple(math.floor(x + 0.5) for x in ideal)


def next_round(state: PlanState) -> RoundPlan:
    """The plan every rank computes from ``state``; ``ValueError`` once the run is finished."""
    if state.finished:
        raise ValueError(f"next_round: the run is finished ({state.config.epochs} epochs)")
    config = state.config
    planned = _planned_counts(state)
    remaining = config.dataset_size - state.position
    if sum(planned) * config.batch_size <= remaining:
        samples = [c * config.batch_size for c in planned]
    else:
        samples = _cut_samples(planned, remaining=remaining, batch_size=config.batch_size)
    slices, start = [], state.position
    for rank, n in enumerate(samples):
        slices.append(RankSlice(rank, -(-n // config.batch_size), start, start + n))
        start += n
    return RoundPlan(round_index=state.round_index, epoch=state.epoch, anchor=state.anchor,
                     counts=tuple(s.steps for s in slices), slices=tuple(slices),
                     last_in_epoch=start == config.dataset_size)


def _planned_counts(state: PlanState) -> tuple[int, ...]:
    """The round's counts before any cut at the epoch end."""
    if state.config.policy == "sync":
        return (1,) * state.config.world_size
    return step_counts(anchor=state.anchor, speed_ms=state.speed_ms, prev=state.prev_counts,
                       dead_zone=state.config.dead_zone)


def _cut_samples(counts: Sequence[int], *, remaining: int, batch_size: int) -> list[int]:
    """Share ``remaining < sum(counts) * batch_size`` samples in proportion to ``counts``.

    Whole batches first: each rank gets ``floor(num_batches * c_r / sum(c))``, the few left go
    one at a time to the rank with the largest ``c_r / (b_r + 1)`` (D'Hondt; ties to the lower
    rank), and the partial batch, if any, to the next rank that rule picks. No rank gets more
    than ``c_r`` batches, and every sample goes to exactly one rank.
    """
    num_batches, partial = divmod(remaining, batch_size)
    total = sum(counts)
    assert num_batches < total
    batches = [num_batches * c // total for c in counts]
    for _ in range(num_batches - sum(batches)):
        batches[_dhondt_pick(counts, batches)] += 1
    samples = [b * batch_size for b in batches]
    if partial:
        samples[_dhondt_pick(counts, batches)] += partial
    return samples


def _dhondt_pick(counts: Sequence[int], batches: Sequence[int]) -> int:
    """The rank with the largest ``c_r / (b_r + 1)``, compared exactly in integers."""
    best = 0
    for r in range(1, len(counts)):
        if counts[r] * (batches[best] + 1) > counts[best] * (batches[r] + 1):
            best = r
    assert batches[best] < counts[best]
    return best


def advance(state: PlanState, plan: RoundPlan, stats: RoundStats) -> PlanState:
    """The state after ``plan`` ran and was averaged with ``stats``.

    Consumes the plan's samples (moving to the next epoch after ``last_in_epoch``), folds each
    rank's finite, positive ``step_ms`` into its speed EMA (ranks that ran no step keep theirs),
    and tunes the anchor (see ``_tuned_anchor``) except under ``sync`` and after a round cut at
    the epoch end, whose short compute time would overstate the overhead.
    """
    config = state.config
    if (plan.round_index, plan.epoch) != (state.round_index, state.epoch):
        raise ValueError(f"advance: plan {plan.round_index} (epoch {plan.epoch}) was not made "
                         f"from state at round {state.round_index} (epoch {state.epoch})")
    if len(stats.step_ms) != config.world_size:
        raise ValueError(f"advance: {len(stats.step_ms)} step_ms, world_size {config.world_size}")
    planned = _planned_counts(state)
    epoch, position = state.epoch, state.position + plan.num_samples
    if plan.last_in_epoch:
        assert position == config.dataset_size
        epoch, position = epoch + 1, 0
    speeds = tuple(
        ema(old, ms) if steps > 0 and math.isfinite(ms) and ms > 0 else old
        for old, ms, steps in zip(state.speed_ms, stats.step_ms, plan.counts, strict=True)
    )
    new = replace(state, round_index=state.round_index + 1, epoch=epoch, position=position,
                  speed_ms=speeds, prev_counts=planned)
    if config.policy == "sync" or plan.num_samples < sum(planned) * config.batch_size:
        return new
    anchor, reason = _tuned_anchor(state.anchor, stats, config)
    return _with_anchor(new, anchor, reason)


def _tuned_anchor(anchor: int, stats: RoundStats, config: PlanConfig) -> tuple[int, str]:
    """``overhead = sync_ms / compute_ms``; above the target the anchor grows proportionally
    (``ceil(anchor * overhead / target)``), below half the target it shrinks by one; clamped to
    ``[min_anchor, max_anchor]``. Unusable stats (compute_ms <= 0, NaN) leave it alone."""
    if not (0 < stats.compute_ms < math.inf and 0 <= stats.sync_ms < math.inf):
        return anchor, ""
    overhead, target = stats.sync_ms / stats.compute_ms, config.overhead_target
    if overhead > target:
        grown = anchor * overhead / target  # infinite for a vanishing compute time
        wanted = math.ceil(grown - _CEIL_TOLERANCE) if math.isfinite(grown) else config.max_anchor
        sign = ">"
    elif overhead < target / 2:
        wanted, sign, target = anchor - 1, "<", target / 2
    else:
        return anchor, ""
    wanted = min(max(wanted, config.min_anchor), config.max_anchor)
    return wanted, f"overhead {overhead:.3g} {sign} {target:.3g}"


def _with_anchor(state: PlanState, anchor: int, reason: str) -> PlanState:
    if anchor == state.anchor:
        return state
    history = (*state.anchor_history, (state.round_index, anchor, reason))
    return replace(state, anchor=anchor, anchor_history=history)


def halve_anchor(state: PlanState, *, reason: str) -> PlanState:
    """The divergence guard's lever: ``anchor = max(min_anchor, anchor // 2)``, recorded in
    ``anchor_history``. A no-op under ``sync`` (its anchor is always 1)."""
    if state.config.policy == "sync":
        return state
    return _with_anchor(state, max(state.config.min_anchor, state.anchor // 2), reason)
