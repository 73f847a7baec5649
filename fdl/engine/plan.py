"""El Che round planning: who runs how many samples on which part of the epoch, as pure functions.

Training is a sequence of rounds. Between two averaging events the slowest rank runs ``anchor``
batches and every other rank as many *samples* as it can process in the same time::

    n_r = round(anchor * batch_size * ms_slow / ms_r)      (ms per sample, not per step)

so a fast device does more work instead of waiting (in whole batches: only the round that
ends an epoch, or a sample budget, may hold a partial one: the samples left). Each averaging
event also exchanges every rank's timing, so all ranks hold the same ``PlanState`` and
compute the same ``RoundPlan`` from it: no coordinator, no extra messages. Nothing here does
I/O, reads a clock or draws a random number::

    state = initial_state(PlanConfig(world_size=2, batch_size=64, dataset_size=50_000, epochs=5))
    while not state.finished:
        plan = next_round(state)           # identical on every rank
        ...                                # run plan.slices[rank], average with plan.weights()
        state = advance(state, plan, stats)

* **Calibration.** Until every rank's speed is known, a round gives every rank
  ``calibration_steps`` batches, and under cadence and async a shared pool of batches after
  them that a rank done with its own takes from, one batch at a time, until every rank is done:
  the fast ranks do not idle while the slowest calibrates (its first step is the slowest of
  the run), and they measure their speed over more steps.
* **Speed estimate.** ``ms_r`` is an EMA of each round's busy time per sample (the whole step:
  data, host work, compute), its ``alpha`` scaled by how much of the rank's own full round the
  measurement covers and each measurement clipped to ``[old / SPEED_CLIP, old * SPEED_CLIP]``:
  a short tail round barely moves it, a full round's mean is followed closely.
* **Anchor.** ``wanted = sync_ms / (overhead_target * batch_size * ms_slow)`` is the anchor
  whose averaging costs ``overhead_target`` of the compute; above the current anchor it is
  taken (rounded up), at most doubling at the first average that asks for it and whole when the
  next one asks again; below half of it the anchor shrinks by one.
  Clamped to ``[min_anchor, min(max_anchor, ceiling)]``; the divergence guard lowers
  the ``ceiling`` (see :func:`with_ceiling`) so the tuner cannot undo a halving.

Epoch ``e`` is one stream of ``dataset_size`` sample positions (the engine maps positions to a
permutation seeded by ``(seed, e)``). A round takes the next ``sum(n_r)`` positions, rank 0
first (an elastic rank's reservation last), so every sample is used exactly once per epoch.
Once at most ``TAIL_MERGE`` (1.5) full rounds are left, the next round takes all of them: no
sliver of a round at the epoch's end that pays an average of its own and idles a rank on its
rounding. Under cadence and async ``TAIL_POOL`` of its batches (and the partial one) are a pool
the ranks drain after their own slices, so a speed that changed since the last round does not
idle the others; the rest is split so that the last rank to finish finishes soonest.

**Budgets.** A run is ``num_samples = min(epochs * dataset_size, max_samples)`` sample
positions, epoch after epoch, in ``num_epochs = ceil(num_samples / dataset_size)`` epochs; the
epoch that reaches the budget is cut there (:func:`epoch_size`: its rounds take positions
``[0, num_samples - e * dataset_size)``) and ends exactly as a whole one does, tail merge and
balanced split included: the round that reaches the cut is ``last_in_epoch`` and the run is
finished after it (``epoch == num_epochs``, ``samples_seen == num_samples``). A step budget is a
sample budget (:func:`samples_budget`): one *step* is one global step of plain DDP,
``world_size * batch_size * accumulate`` samples, so ``max_steps=100`` trains the data 100 DDP
iterations would, however El Che spreads it over the ranks (a fast rank runs more than 100 of
its own steps, a slow one fewer). Data without ``len()`` is planned as one epoch of
``max_samples`` positions: ``PlanConfig(dataset_size=max_samples, epochs=1)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fdl.engine.policies import CADENCE, Policy, PolicyChoice, choose_policy, policy_named
from fdl.errors import UsageError
from fdl.settings import ENGINE_DEFAULTS, POLICY_CHOICES

ELASTIC_CAP = 1.5  # the elastic rank may take up to this times its planned share
# --policy auto calls a link slow (async) only when this many averages after calibration all
# cost too much: one that a busy host or a burst of traffic slowed is no slow link. Noise only
# adds to a cost, so the cheapest average measured is the link's, and one cheap enough decides.
AUTO_AVERAGES = 3
# With at most this many full rounds left, the next round takes the rest of the epoch.
TAIL_MERGE = 1.5
# The calibration round's shared pool: this many batches per calibration step per rank beyond
# the first, enough for a rank some 8x faster than the slowest to keep busy meanwhile.
CALIBRATION_POOL = 8
# The share of an epoch's last round left in a shared pool that the ranks drain after their
# own slices: a speed estimate off by up to ~20% (one rank's steps slower this round than
# the last, two workers on shared cores) is then absorbed by the others instead of idling them
# at the epoch's end, where a fixed split idled a fast rank for a good part of a short round
# (docs/elche.md "Measurements behind the engine's choices").
TAIL_POOL = 0.15
# A take from the tail pool is this fraction of the rank's speed share of what is left (at
# least pool_chunk): a few large takes first, then smaller ones, so a fast rank pays a handful
# of store round trips per epoch instead of one per chunk (milliseconds each over WiFi;
# docs/elche.md "Measurements behind the engine's choices"), and the last take is still about
# one step.
POOL_GUIDED = 0.5
SPEED_ALPHA = 0.7
SPEED_CLIP = 2.0
# Float noise must not add a batch: 3 * 0.1 / 0.05 is 6.000000000000001, not 6.
_CEIL_TOLERANCE = 1e-9
DEFAULT_POLICY = policy_named(ENGINE_DEFAULTS["policy"])


class PlanConfigError(UsageError, ValueError):
    """A ``PlanConfig`` field that cannot be used (a ``ValueError``, and exit 2 from the CLI)."""


@dataclass(frozen=True)
class PlanConfig:
    """What the plan needs to know about the run; validated on construction.

    ``overhead_target`` is the wanted sync time / compute time per round; ``dead_zone`` the
    relative change in a rank's ideal share below which its share is left as it was;
    ``calibration_steps`` the batches every rank runs while a speed is still unknown.
    ``policy`` may be given by name; it is looked up here, once, and held as the object.
    ``max_samples`` is the run's sample budget: the run ends mid-epoch once it has used that
    many (:attr:`num_samples`, :func:`epoch_size`); None: ``epochs`` whole epochs.
    """

    world_size: int
    batch_size: int
    dataset_size: int
    epochs: int
    max_samples: int | None = None
    policy: Policy = DEFAULT_POLICY
    initial_anchor: int = 4
    calibration_steps: int = 2
    # Below 4 batches of the slowest rank a round loses more to step jitter and to the fast
    # rank's partial batch than averaging less often would cost (scripts/sim-elche).
    min_anchor: int = 4
    max_anchor: int = 200
    overhead_target: float = ENGINE_DEFAULTS["overhead_target"]
    # Small on purpose: a dead zone as wide as 10% lets a 10% imbalance stand, and the fast
    # rank idles for exactly that long every round (measured with scripts/bench-elche).
    dead_zone: float = 0.01
    # A single worker averages nothing, so its rounds are ``max_anchor`` steps (the timeline,
    # live figures, checkpoints and a time budget see them; a short round also restarts the
    # loader workers' pass), or as many as fit in ``round_cap`` samples (an evaluation interval).
    round_cap: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "batch_size", "epochs", "min_anchor", "calibration_steps"):
            _check_int(name, getattr(self, name), 1)
        one_batch_each = self.world_size * self.batch_size
        _check_int("dataset_size", self.dataset_size, one_batch_each,
                   why="world_size * batch_size: one batch per worker")
        if self.max_samples is not None:
            _check_int("max_samples", self.max_samples, one_batch_each,
                       why="world_size * batch_size: one batch per worker; or None")
        _check_int("max_anchor", self.max_anchor, self.min_anchor, why="min_anchor")
        if self.round_cap is not None:
            _check_int("round_cap", self.round_cap, 1, why="1; or None")
        _check_int("initial_anchor", self.initial_anchor, self.min_anchor, self.max_anchor,
                   why="[min_anchor, max_anchor]")
        target, zone = self.overhead_target, self.dead_zone
        _check("overhead_target", target, _is_real(target) and 0 < target < math.inf,
               "a finite number > 0")
        _check("dead_zone", zone, _is_real(zone) and 0 <= zone < 1, "a number in [0, 1)")
        try:
            object.__setattr__(self, "policy", policy_named(self.policy))
        except ValueError as exc:
            raise PlanConfigError(f"policy = {self.policy!r} is not allowed; {exc}") from None

    @property
    def num_samples(self) -> int:
        """The run's sample positions: ``min(epochs * dataset_size, max_samples)``."""
        full = self.epochs * self.dataset_size
        return full if self.max_samples is None else min(full, self.max_samples)

    @property
    def num_epochs(self) -> int:
        """The epochs the run starts: ``ceil(num_samples / dataset_size)``, the last one cut
        short when the budget ends it (:func:`epoch_size`)."""
        return -(-self.num_samples // self.dataset_size)


def epoch_size(config: PlanConfig, epoch: int) -> int:
    """The sample positions epoch ``epoch`` runs: ``dataset_size``, except in the run's last
    epoch when ``max_samples`` cuts it: ``num_samples - epoch * dataset_size``, its positions
    ``[0, that)``. ``ValueError`` for an epoch the run does not have."""
    if not (isinstance(epoch, int) and 0 <= epoch < config.num_epochs):
        raise ValueError(f"epoch_size: epoch {epoch!r} is not one of the run's "
                         f"{config.num_epochs} epochs")
    return min(config.dataset_size, config.num_samples - epoch * config.dataset_size)


def global_step_samples(*, world_size: int, batch_size: int, accumulate: int = 1) -> int:
    """The samples of one global step, one step of plain DDP: what ``max_steps``,
    ``run.evaluate(every=)`` and a scheduler handed to ``run.batches`` count in."""
    return world_size * batch_size * accumulate


def samples_budget(*, max_steps: int | None, max_samples: int | None, world_size: int,
                   batch_size: int, accumulate: int = 1) -> int | None:
    """``PlanConfig.max_samples`` for a run given a step budget, a sample budget or both: one
    step is a global step of plain DDP, ``world_size * batch_size * accumulate`` samples; with
    both the smaller, with neither None. ``PlanConfigError`` naming an argument that is not a
    positive integer (the budgets may also be None)."""
    for name, value in (("world_size", world_size), ("batch_size", batch_size),
                        ("accumulate", accumulate)):
        _check_int(name, value, 1)
    for name, value in (("max_steps", max_steps), ("max_samples", max_samples)):
        if value is not None:
            _check_int(name, value, 1, why="or None")
    budgets = [] if max_samples is None else [max_samples]
    if max_steps is not None:
        budgets.append(max_steps * global_step_samples(world_size=world_size,
                                                       batch_size=batch_size,
                                                       accumulate=accumulate))
    return min(budgets, default=None)


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
    """Rank ``rank`` runs ``steps`` steps on the epoch's sample positions ``[start, stop)``:
    ``steps = ceil((stop - start) / batch_size)``, the last batch possibly partial."""

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
    calibration: bool = False  # planned before every rank's speed was known
    # An elastic round: rank ``elastic`` (the fastest) runs until rank ``signal_from`` (the
    # slowest) has finished its share, at most up to its slice's ``stop`` (a reservation).
    elastic: int | None = None
    signal_from: int | None = None
    # A shared pool of ``pool`` batches, positions ``[pool_start, pool_stop)`` right after the
    # slices, which a rank takes from once its own share is run. The calibration round's is
    # whole batches, taken until every rank has run its share (so the fast ones do not idle
    # while the slowest calibrates); advance learns how many were taken. The epoch's last
    # round's (``drains``) is the epoch's tail, its last batch maybe partial, taken until empty.
    pool: int = 0
    pool_stop: int = 0

    @property
    def pool_start(self) -> int:
        """The pool's first sample position: the end of the round's slices."""
        return max(s.stop for s in self.slices)

    @property
    def drains(self) -> bool:
        """Whether the pool is the epoch's tail: every batch of it is taken."""
        return bool(self.pool) and self.last_in_epoch

    @property
    def num_samples(self) -> int:
        """Samples the round uses: its slices and a draining pool (an elastic round or the
        calibration round's pool: reserves; advance learns what was used)."""
        tail = self.pool_stop - self.pool_start if self.drains else 0
        return sum(s.num_samples for s in self.slices) + tail

    def weights(self) -> tuple[float, ...]:
        """Averaging weights: uniform, ``1 / world_size``. In the linear regime a replica's
        displacement already grows with the steps it ran, so the uniform mean moves the model
        by ``lr x samples / (world_size x batch_size)`` gradients, as sync does over the same
        samples; weighting by samples would count the fast rank twice (``sum c_r^2 / sum c_r``
        gradients against ``sum c_r / world_size``: 1.18x for counts 2.5 : 1)."""
        return (1 / len(self.slices),) * len(self.slices)


@dataclass(frozen=True)
class RoundStats:
    """What every rank learns at an averaging event about one round.

    ``busy_ms[r]``: rank r's busy time in the round (whole steps: data, compute, emulated
    slowdown), ``samples[r]`` the samples that time covers (0: no measurement, the rank keeps
    its estimate); in an elastic round the elastic rank's ``samples`` is what it used.
    ``sync_ms``: what the averaging cost, the communication proper (NaN: unknown).
    """

    busy_ms: tuple[float, ...]
    samples: tuple[int, ...]
    sync_ms: float

    @classmethod
    def unknown(cls, world_size: int) -> RoundStats:
        return cls((math.nan,) * world_size, (0,) * world_size, math.nan)


@dataclass(frozen=True, kw_only=True)
class PlanState:
    """Everything the plan depends on; the same on every rank after every averaging.

    ``ms_per_sample[r]`` is rank r's speed estimate (``None`` until measured).
    ``anchor_history`` holds ``(round_index, new_anchor, reason)`` for every change,
    ``round_index`` being the first round planned with the new anchor. ``prev_shares`` are the
    last round's samples per rank before any cut (the dead zone compares against them).
    ``ceiling`` caps the anchor while the divergence guard holds it down (None: no cap).
    ``auto_costs`` are the costs (ms) of the averages ``--policy auto`` measured after
    calibration while it had not chosen (not checkpointed: a resumed auto run measures again).
    """

    config: PlanConfig
    round_index: int = 0
    epoch: int = 0
    position: int = 0
    anchor: int
    ms_per_sample: tuple[float | None, ...]
    anchor_history: tuple[tuple[int, int, str], ...] = ()
    prev_shares: tuple[int, ...] | None = None
    ceiling: int | None = None
    auto_costs: tuple[float, ...] = ()

    @property
    def finished(self) -> bool:
        """Whether the run's ``num_samples`` are used (a state restored under a smaller budget
        than it was saved with may be past it: finished too)."""
        return self.samples_seen >= self.config.num_samples

    @property
    def calibrated(self) -> bool:
        return all(ms is not None for ms in self.ms_per_sample)

    @property
    def samples_seen(self) -> int:
        """``epoch * dataset_size + position``, at most ``num_samples`` once the run is over (its
        last epoch may be cut short); LR schedules use ``progress = samples_seen /
        config.num_samples``, never per-rank step counts."""
        config = self.config
        return min(self.epoch * config.dataset_size, config.num_samples) + self.position

    def to_dict(self) -> dict[str, Any]:
        """The state as a checkpoint keeps it (``engine.json``): every field, and the facts of
        the config that a resume compares with its own (:meth:`from_dict` reads it back)."""
        config = self.config
        return {"round_index": self.round_index, "epoch": self.epoch, "position": self.position,
                "anchor": self.anchor, "ms_per_sample": list(self.ms_per_sample),
                "anchor_history": [list(item) for item in self.anchor_history],
                "prev_shares": list(self.prev_shares) if self.prev_shares else None,
                "ceiling": self.ceiling, "policy": config.policy.name,
                "world_size": config.world_size, "dataset_size": config.dataset_size,
                "batch_size": config.batch_size, "epochs": config.epochs,
                "max_samples": config.max_samples}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any], config: PlanConfig) -> PlanState:
        """The state a run resumes from: where ``saved`` (:meth:`to_dict`'s) left the epoch's
        stream, under ``config``. Under another policy the anchor starts afresh; with another
        world size or policy the speeds are re-measured (the shares and the guard's ceiling
        with them). ``ValueError`` when ``saved`` is not what :meth:`to_dict` writes (it is
        read back from disk: :func:`saved_state_problem`)."""
        problem = saved_state_problem(saved)
        if problem is not None:
            raise ValueError(problem)
        state = replace(initial_state(config), round_index=saved["round_index"],
                        epoch=saved["epoch"], position=saved["position"],
                        anchor_history=tuple(tuple(item) for item in saved["anchor_history"]))
        same_policy = saved["policy"] == config.policy.name
        if same_policy and config.world_size > 1:  # as it was: a guard's halving below
            # min_anchor stays, sync's 1 too (a single worker's is always solo_anchor's)
            state = replace(state, anchor=min(saved["anchor"], config.max_anchor))
        if same_policy and saved["world_size"] == config.world_size:
            state = replace(state, ms_per_sample=tuple(saved["ms_per_sample"]),
                            prev_shares=tuple(saved["prev_shares"]) if saved["prev_shares"]
                            else None, ceiling=saved["ceiling"])
        return state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_speed(value: Any) -> bool:
    return value is None or (_is_real(value) and 0 < value < math.inf)


def _is_change(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 3 and _count(item[0]) and _count(item[1]) \
        and isinstance(item[2], str)


# What each field of PlanState.to_dict must hold, checked when a checkpoint is read back.
_SAVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "round_index": (_count, "an integer >= 0"),
    "epoch": (_count, "an integer >= 0"),
    "position": (_count, "an integer >= 0"),
    "anchor": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "ms_per_sample": (lambda v: isinstance(v, list) and all(_is_speed(x) for x in v),
                      "a list of numbers > 0 or nulls"),
    "anchor_history": (lambda v: isinstance(v, list) and all(_is_change(x) for x in v),
                       "a list of [round, anchor, reason]"),
    "prev_shares": (lambda v: v is None or (isinstance(v, list) and all(_count(x) for x in v)),
                    "a list of integers >= 0 or null"),
    "ceiling": (lambda v: v is None or (_count(v) and v >= 1), "an integer >= 1 or null"),
    "policy": (lambda v: v in POLICY_CHOICES, " | ".join(POLICY_CHOICES)),
    "world_size": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "dataset_size": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "batch_size": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "epochs": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
}
# Fields a state saved before them lacks: absent reads as the default (None: no budget).
_SAVED_SINCE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_samples": (lambda v: v is None or (_count(v) and v >= 1), "an integer >= 1 or null"),
}


def saved_state_problem(saved: Any) -> str | None:
    """Why ``saved`` is not a state :meth:`PlanState.to_dict` wrote (None: it is): a missing
    field, a value of the wrong type or range, or parts that do not fit each other."""
    if not isinstance(saved, Mapping):
        return f"the plan state is a {type(saved).__name__}, not an object"
    for name, (valid, allowed) in (_SAVED | _SAVED_SINCE).items():
        if name not in saved:
            if name in _SAVED_SINCE:
                continue
            return f"the plan state has no {name!r}"
        if not valid(saved[name]):
            return f"the plan state's {name!r} is {saved[name]!r:.40}, expected {allowed}"
    if len(saved["ms_per_sample"]) != saved["world_size"]:
        return (f"the plan state describes {saved['world_size']} ranks with "
                f"{len(saved['ms_per_sample'])} speeds")
    if saved["position"] > saved["dataset_size"]:
        return (f"the plan state's position {saved['position']} is beyond its "
                f"{saved['dataset_size']} samples")
    return None


def initial_state(config: PlanConfig) -> PlanState:
    """The state before the first round (anchor 1 under ``sync``: one DDP step per round; a
    single worker's rounds: :func:`solo_anchor`)."""
    local = config.policy.local_steps
    anchor = solo_anchor(config) if config.world_size == 1 else \
        config.initial_anchor if local else 1
    return PlanState(config=config, anchor=anchor, ms_per_sample=(None,) * config.world_size)


def solo_anchor(config: PlanConfig) -> int:
    """A single worker's round, in steps: ``max_anchor``, or fewer within ``round_cap``."""
    if config.round_cap is None:
        return config.max_anchor
    return max(1, min(config.max_anchor, config.round_cap // config.batch_size))


def update_speed(old: float | None, new: float, *, weight: float = 1.0) -> float:
    """One round's measurement ``new`` (ms per sample) folded into the estimate ``old``.

    The first measurement is taken raw; then ``old + SPEED_ALPHA * weight * (clip(new) - old)``
    with ``weight`` in [0, 1] the share of a full round the measurement covers and ``new``
    clipped to ``[old / SPEED_CLIP, old * SPEED_CLIP]``. A round's mean over many steps is a
    good measurement and is followed closely (rounds are few: a whole run may have a dozen);
    a one-step tail round, the outlier an error-adaptive EMA would give the *most* weight,
    moves the estimate by a few percent at most.
    """
    if not (math.isfinite(new) and new > 0):
        raise ValueError(f"update_speed: new = {new!r} must be a finite number > 0")
    if old is None:
        return new
    if not (math.isfinite(old) and old > 0):
        raise ValueError(f"update_speed: old = {old!r} must be > 0 or None")
    clipped = min(max(new, old / SPEED_CLIP), old * SPEED_CLIP)
    return old + SPEED_ALPHA * min(max(weight, 0.0), 1.0) * (clipped - old)


def shares(*, anchor: int, batch_size: int, ms_per_sample: Sequence[float | None],
           prev: Sequence[int] | None, dead_zone: float) -> tuple[int, ...]:
    """Samples per rank in a full round: the slowest rank ``anchor * batch_size``, rank r
    ``round(anchor * batch_size * ms_slow / ms_r)`` (half up). An unmeasured rank counts as the
    slowest known one.

    Dead zone: ``prev`` was planned with the same anchor if its smallest share is
    ``anchor * batch_size``; then, if every rank's ideal share is within ``dead_zone``
    (relative, strictly) of its previous one, ``prev`` is kept: jitter does not reshuffle.
    """
    if anchor < 1:
        raise ValueError(f"shares: anchor = {anchor} must be >= 1")
    known = [ms for ms in ms_per_sample if ms is not None]
    if any(not (math.isfinite(ms) and ms > 0) for ms in known):
        raise ValueError(f"shares: ms_per_sample = {tuple(ms_per_sample)!r} must be finite "
                         "and > 0")
    slow = max(known, default=1.0)
    base = anchor * batch_size
    ideal = [base * slow / (slow if ms is None else ms) for ms in ms_per_sample]
    if (prev is not None and len(prev) == len(ideal) and min(prev, default=0) == base
            and all(abs(x - p) < dead_zone * p for x, p in zip(ideal, prev, strict=True))):
        return tuple(prev)
    # Whole batches: a partial batch in every round could be a single sample, which BatchNorm
    # refuses in training (and it pays a step's fixed cost for little); the elastic rank absorbs
    # the rounding. A speed ratio beyond float range must still give a finite share.
    return tuple(max(base, batch_size * math.floor(min(x, 2.0 ** 53) / batch_size + 0.5))
                 for x in ideal)


def ends_run(state: PlanState, plan: RoundPlan) -> bool:
    """Whether ``plan`` (made from ``state``) is the run's last round: the last of its epoch,
    in the run's last epoch (a budget's cut included)."""
    return plan.last_in_epoch and plan.epoch + 1 >= state.config.num_epochs


def next_round(state: PlanState) -> RoundPlan:
    """The plan every rank computes from ``state``; ``ValueError`` once the run is finished."""
    if state.finished:
        raise ValueError(f"next_round: the run is finished ({state.config.num_samples} "
                         f"samples, {state.config.num_epochs} epochs)")
    config = state.config
    planned = _planned_shares(state)
    size = epoch_size(config, state.epoch)
    remaining = size - state.position
    elastic, tail = None, 0
    if _ends_epoch(state, planned, remaining):
        tail = _tail_pool(state, remaining)
        samples = _balanced_split(remaining - tail, state.ms_per_sample,  # type: ignore[arg-type]
                                  batch_size=config.batch_size)
    elif (elastic := _elastic_ranks(state, planned, remaining)) is not None:
        fast, _ = elastic
        samples = list(planned)
        # Short of the epoch's end by at least (TAIL_MERGE - 1) of a full round: the round after
        # this one is then the epoch's last, and not a sliver that pays a whole average.
        room = remaining - (sum(planned) - planned[fast]) - math.ceil(
            (TAIL_MERGE - 1) * sum(planned))
        samples[fast] = config.batch_size * min(
            math.ceil(planned[fast] * ELASTIC_CAP / config.batch_size), room // config.batch_size)
    elif sum(planned) <= remaining:
        samples = list(planned)
    else:
        steps = [-(-n // config.batch_size) for n in planned]
        samples = _cut_samples(steps, remaining=remaining, batch_size=config.batch_size)
    order = [r for r in range(config.world_size) if elastic is None or r != elastic[0]]
    order += [] if elastic is None else [elastic[0]]  # the elastic slice last: it may end early
    slices: list[RankSlice] = [None] * config.world_size  # type: ignore[list-item]
    start = state.position
    for rank in order:
        n = samples[rank]
        slices[rank] = RankSlice(rank, -(-n // config.batch_size), start, start + n)
        start += n
    if tail:
        pool, pool_stop = -(-tail // config.batch_size), size
    else:
        pool = _calibration_pool(state, remaining - sum(samples))
        pool_stop = start + pool * config.batch_size
    return RoundPlan(round_index=state.round_index, epoch=state.epoch, anchor=state.anchor,
                     counts=tuple(s.steps for s in slices), slices=tuple(slices),
                     last_in_epoch=elastic is None and pool_stop == size,
                     calibration=_calibrating(state),
                     elastic=None if elastic is None else elastic[0],
                     signal_from=None if elastic is None else elastic[1], pool=pool,
                     pool_stop=pool_stop if pool else 0)


def _tail_pool(state: PlanState, remaining: int) -> int:
    """Samples of the epoch's last round left to a pool the ranks drain (``TAIL_POOL`` of its
    whole batches, at least one per rank, and the partial batch), under an elastic policy
    with two ranks or more; 0 otherwise."""
    config = state.config
    if not (config.policy.elastic and config.world_size > 1):
        return 0
    whole, partial = divmod(remaining, config.batch_size)
    batches = min(whole, max(config.world_size, math.ceil(TAIL_POOL * whole)))
    return batches * config.batch_size + partial


def pool_chunk(state: PlanState, rank: int) -> int:
    """The batches rank ``rank`` takes from a draining pool at once: about one step of the
    slowest rank's time (1 while a speed is unknown)."""
    ms = state.ms_per_sample
    mine = ms[rank]
    if mine is None or any(m is None for m in ms):
        return 1
    return max(1, math.floor(max(ms) / mine))  # type: ignore[type-var]


def pool_share(state: PlanState, rank: int) -> float:
    """Rank ``rank``'s share of the ranks' summed speed (0 while a speed is unknown): what it
    would drain of a pool if every rank took in proportion to its speed."""
    ms = state.ms_per_sample
    if any(m is None or not m > 0 for m in ms):
        return 0.0
    rates = [1 / m for m in ms]  # type: ignore[operator]
    return rates[rank] / sum(rates)


def pool_take(*, left: int, chunk: int, share: float) -> int:
    """The batches a rank takes from a draining pool that had ``left`` batches at its last
    look: ``POOL_GUIDED`` of its ``share`` of them, at least ``chunk`` (guided
    self-scheduling: a take lasts about the same time on every rank, and the takes shrink to
    ``chunk`` as the pool empties, so the ranks still end within about one step)."""
    return max(chunk, math.floor(POOL_GUIDED * share * max(0, left)))


def _calibration_pool(state: PlanState, room: int) -> int:
    """Batches in the calibration round's pool: under an elastic policy with two ranks or
    more, ``CALIBRATION_POOL x calibration_steps x (world_size - 1)`` whole batches, fewer if
    the epoch has not that many past the slices (the pool never reaches the epoch's end, so the
    round is known not to end it)."""
    config = state.config
    if not (_calibrating(state) and config.policy.elastic
            and config.world_size > 1):
        return 0
    wanted = CALIBRATION_POOL * config.calibration_steps * (config.world_size - 1)
    return max(0, min(wanted, (room - 1) // config.batch_size))


def _ends_epoch(state: PlanState, planned: Sequence[int], remaining: int) -> bool:
    """Whether this round takes the rest of the epoch, balanced by speed: with local steps and
    known speeds, once at most ``TAIL_MERGE`` full rounds are left (one round a little longer
    instead of a full one and a short tail that idles a rank on its rounding and pays an
    average of its own)."""
    return (state.config.policy.local_steps and state.calibrated
            and remaining <= TAIL_MERGE * sum(planned))


def _balanced_split(remaining: int, ms_per_sample: Sequence[float], *,
                    batch_size: int) -> list[int]:
    """``remaining`` samples shared so that the last rank to finish finishes first: whole
    batches, then the partial one if any, each to the rank that would end it soonest (ties to
    the lower rank) — the shortest round whole batches allow. Starts from the proportional
    floor, so the greedy part is at most ``world_size`` batches."""
    num_batches, partial = divmod(remaining, batch_size)
    slowest = max(ms_per_sample)
    rates = [min(slowest / ms, 2.0 ** 53) for ms in ms_per_sample]  # finite for any ratio
    batches = [math.floor(num_batches * v / sum(rates)) for v in rates]
    for _ in range(num_batches - sum(batches)):
        batches[min(range(len(rates)),
                    key=lambda r: ((batches[r] + 1) * ms_per_sample[r], r))] += 1
    samples = [b * batch_size for b in batches]
    if partial:
        samples[min(range(len(rates)),
                    key=lambda r: ((samples[r] + partial) * ms_per_sample[r], r))] += partial
    return samples


def _elastic_ranks(state: PlanState, planned: Sequence[int],
                   remaining: int) -> tuple[int, int] | None:
    """(fastest, slowest) rank when the round can be elastic: the policy allows it, speeds are
    known and there are two ranks or more (the round that ends an epoch is never elastic: it
    must be known to end it when it is planned, see :func:`_ends_epoch`)."""
    config = state.config
    if not (config.policy.elastic and state.calibrated and config.world_size > 1):
        return None
    speeds = [float(ms) for ms in state.ms_per_sample]  # type: ignore[arg-type]
    slow = max(range(len(speeds)), key=lambda r: (speeds[r], -r))
    fast = min((r for r in range(len(speeds)) if r != slow), key=lambda r: (speeds[r], r))
    return fast, slow


def _calibrating(state: PlanState) -> bool:
    return state.config.policy.local_steps and not state.calibrated


def _planned_shares(state: PlanState) -> tuple[int, ...]:
    """The round's samples per rank before any cut at the epoch end."""
    config = state.config
    if config.world_size == 1 and not _calibrating(state):
        return (state.anchor * config.batch_size,)
    if not config.policy.local_steps:
        return (config.batch_size,) * config.world_size
    if _calibrating(state):
        return (config.calibration_steps * config.batch_size,) * config.world_size
    return shares(anchor=state.anchor, batch_size=config.batch_size,
                  ms_per_sample=state.ms_per_sample, prev=state.prev_shares,
                  dead_zone=config.dead_zone)
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


def advance(state: PlanState, plan: RoundPlan, stats: RoundStats, *,
            elastic_used: int | None = None, pool_used: int | None = None) -> PlanState:
    """The state after ``plan`` ran, given the ``stats`` the ranks exchanged at its boundary.

    Consumes the plan's samples (moving to the next epoch after ``last_in_epoch``), folds each
    rank's measured ms per sample into its estimate (:func:`update_speed`; weighted by the
    share of its own full round it covers; ranks without a measurement keep theirs) and tunes the
    anchor (:func:`_tuned_anchor`), except under ``sync``. ``stats`` may describe an earlier
    round than ``plan`` (async: the average that arrives at a boundary is the previous
    round's); every rank passes the same, so every rank plans alike. An elastic round also
    needs ``elastic_used``, the samples its elastic rank used of its reservation, and a round
    with a pool ``pool_used``, the batches taken from it.
    """
    config = state.config
    if (plan.round_index, plan.epoch) != (state.round_index, state.epoch):
        raise ValueError(f"advance: plan {plan.round_index} (epoch {plan.epoch}) was not made "
                         f"from state at round {state.round_index} (epoch {state.epoch})")
    if len(stats.busy_ms) != config.world_size or len(stats.samples) != config.world_size:
        raise ValueError(f"advance: stats for {len(stats.busy_ms)} ranks, world_size "
                         f"{config.world_size}")
    planned = _planned_shares(state)
    used = plan.num_samples
    if plan.elastic is not None:
        taken = -1 if elastic_used is None else elastic_used
        reserved = plan.slices[plan.elastic].num_samples
        if not 0 < taken <= reserved:
            raise ValueError(f"advance: the elastic rank used {taken} samples of the "
                             f"{reserved} reserved")
        used -= reserved - taken
    if plan.pool:
        if pool_used is None or not 0 <= pool_used <= plan.pool or \
                (plan.drains and pool_used != plan.pool):
            raise ValueError(f"advance: {pool_used!r} batches taken from a pool of {plan.pool}"
                             + (" (the epoch's tail: all of it)" if plan.drains else ""))
        if not plan.drains:  # a draining pool is in num_samples
            used += pool_used * config.batch_size
    elif pool_used:
        raise ValueError(f"advance: {pool_used} batches taken from a round without a pool")
    epoch, position = state.epoch, state.position + used
    if plan.last_in_epoch:
        assert position == epoch_size(config, epoch)
        epoch, position = epoch + 1, 0
    # A measurement's weight is the share of the rank's *own* full round it covers: weighed
    # against the largest share, every round of a slow rank counted as a partial one, and its
    # estimate crept for rounds from a calibration that a cold first step inflated.
    speeds = tuple(
        update_speed(old, busy / n, weight=n / own) if n > 0 and _usable(busy / n) else old
        for old, busy, n, own in zip(state.ms_per_sample, stats.busy_ms, stats.samples,
                                     planned, strict=True)
    )
    new = replace(state, round_index=state.round_index + 1, epoch=epoch, position=position,
                  ms_per_sample=speeds, prev_shares=None if plan.calibration else planned)
    if config.policy.decides and not plan.calibration and 0 <= stats.sync_ms < math.inf:
        new = replace(new, auto_costs=(*state.auto_costs, stats.sync_ms))
    if not config.policy.local_steps or config.world_size == 1:  # nothing averaged
        return new
    anchor, reason = _tuned_anchor(new, stats)
    return _with_anchor(new, anchor, reason)


def _usable(ms: float) -> bool:
    """A measured ms per sample the estimate can take: finite and > 0 (NaN: not measured; a
    busy time so small that it underflows per sample is no measurement either)."""
    return math.isfinite(ms) and ms > 0


def _tuned_anchor(state: PlanState, stats: RoundStats) -> tuple[int, str]:
    """``wanted = sync_ms / (overhead_target * batch_size * ms_slow)``: the anchor at which an
    average costs ``overhead_target`` of a round's compute (``ms_slow`` the slowest rank's
    ms per sample as measured in the same round, so the figure does not depend on how long
    that round was). Above the anchor, the anchor grows to ``ceil(wanted)``: at most doubling
    when the last round did not grow it (one slow average, e.g. the first one while connections
    are made, must not set the anchor for the run), whole when it did and this average asks
    again (on a slow link, doubling alone takes six rounds from 4 to 200, each paying a slow
    average: docs/run.md "Slow links"); below half of it, it shrinks by one. Clamped to
    ``[min_anchor, min(max_anchor, ceiling)]``. Unusable stats leave it alone."""
    config, anchor = state.config, state.anchor
    measured = [busy / n for busy, n in zip(stats.busy_ms, stats.samples, strict=True)
                if n > 0 and _usable(busy / n)]
    if not measured or not (0 <= stats.sync_ms < math.inf):
        return anchor, ""
    batch_ms = config.batch_size * max(measured)
    wanted = stats.sync_ms / (config.overhead_target * batch_ms)
    overhead = stats.sync_ms / (anchor * batch_ms)
    if wanted > anchor:
        target, sign = config.overhead_target, ">"
        limit = math.inf if _grew_last_round(state) else 2 * anchor
        new = min(math.ceil(wanted - _CEIL_TOLERANCE), limit) if math.isfinite(wanted) \
            else 2 * anchor
    elif wanted < anchor / 2:
        target, sign, new = config.overhead_target / 2, "<", anchor - 1
    else:
        return anchor, ""
    high = config.max_anchor if state.ceiling is None else min(config.max_anchor, state.ceiling)
    new = min(max(new, config.min_anchor), high)
    return new, f"overhead {overhead:.3g} {sign} {target:.3g}"


def _grew_last_round(state: PlanState) -> bool:
    """Whether the round just run (``state``: the state after it) was the first planned with an
    anchor the tuner had grown."""
    if not state.anchor_history:
        return False
    round_index, _, reason = state.anchor_history[-1]
    return round_index == state.round_index - 1 and " > " in reason


def _with_anchor(state: PlanState, anchor: int, reason: str) -> PlanState:
    if anchor == state.anchor:
        return state
    history = (*state.anchor_history, (state.round_index, anchor, reason))
    return replace(state, anchor=anchor, anchor_history=history)


def auto_choice(state: PlanState) -> PolicyChoice | None:
    """``--policy auto``'s pick (fdl.engine.policies.choose_policy) from the state's calibrated
    speeds and the cheapest of the averages measured since calibration (``auto_costs``, each a
    ``RoundStats.sync_ms`` that :func:`advance` kept); None while a speed is unknown, no average
    was measured, or fewer than ``AUTO_AVERAGES`` were and all of them were too dear (async
    waits for the next boundary's). The same on every rank, as the state is."""
    speeds = state.ms_per_sample
    if not state.auto_costs or \
            not all(m is not None and math.isfinite(m) and m > 0 for m in speeds):
        return None
    config = state.config
    choice = choose_policy(ms_per_sample=[float(m) for m in speeds if m is not None],
                           average_ms=min(state.auto_costs), batch_size=config.batch_size,
                           overhead_target=config.overhead_target, max_anchor=config.max_anchor)
    if choice.policy.background and len(state.auto_costs) < AUTO_AVERAGES:
        return None
    return choice


def auto_undecided(state: PlanState) -> PolicyChoice:
    """What a ``--policy auto`` run that ended before it chose trained as: cadence, auto's
    rounds until it chooses, and why (the figures it had: the speeds' spread when known, the
    cheapest average measured)."""
    speeds = [m for m in state.ms_per_sample if m is not None]
    spread = max(speeds) / min(speeds) - 1 if speeds else 0.0
    measured = len(state.auto_costs)
    return PolicyChoice(CADENCE, f"the run ended before auto chose ({measured} average(s) "
                                 f"measured after calibration; a slow link takes "
                                 f"{AUTO_AVERAGES}): cadence throughout", spread,
                        min(state.auto_costs, default=0.0), 0.0, 0.0)


def with_policy(state: PlanState, policy: Policy | str, *, reason: str) -> PlanState:
    """``state`` planning under ``policy`` from its next round on (``auto``'s choice, made
    alike on every rank): the epoch's position and the speeds stay; under ``sync`` the anchor
    is 1 (one DDP step per round) and the guard's ceiling goes; under cadence and async the
    anchor stays. The change is in ``anchor_history`` when the anchor moves."""
    policy = policy_named(policy)
    config = replace(state.config, policy=policy)
    new = replace(state, config=config)
    if not policy.local_steps:
        new = replace(_with_anchor(new, 1, reason), ceiling=None)
    return new


def halve_anchor(state: PlanState, *, reason: str) -> PlanState:
    """The divergence guard's lever: ``anchor = max(1, anchor // 2)`` (below ``min_anchor`` if
    need be), recorded in
    ``anchor_history``, and the ceiling set to it so the tuner cannot grow it back (the guard
    lifts the ceiling with :func:`with_ceiling` once the replicas agree again). A no-op under
    ``sync`` (its anchor is always 1) and for a single worker (no replicas to diverge)."""
    if not state.config.policy.local_steps or state.config.world_size == 1:
        return state
    halved = max(1, state.anchor // 2)
    return replace(_with_anchor(state, halved, reason), ceiling=halved)


def with_ceiling(state: PlanState, ceiling: int | None) -> PlanState:
    """``state`` with the anchor's cap set to ``ceiling`` (None lifts it)."""
    return replace(state, ceiling=ceiling)


def cut_after_next_round(state: PlanState) -> PlanState:
    """``state`` with the run's sample budget cut where the round after it ends, so that round
    is the run's last (and its epoch's last: a blocking average, the epoch's end) — how a time
    budget ends a run, decided alike on every rank."""
    if state.finished:
        return state
    config = state.config
    cut = max(state.samples_seen + next_round(state).num_samples,
              config.world_size * config.batch_size)
    if cut >= config.num_samples:
        return state
    return replace(state, config=replace(config, max_samples=cut))
