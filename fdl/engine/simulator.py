"""El Che on a virtual clock: the engine's own planner, policies and per-rank bookkeeping driven
by a timing model instead of devices, to see in seconds what a policy does on hardware nobody
here has (``scripts/sim-elche``).

What is the engine's code, unchanged: :func:`fdl.engine.plan.next_round` and
:func:`~fdl.engine.plan.advance` (counts, speeds, anchor), the policy objects (which boundaries
block), :class:`fdl.engine.state.RankState` (what a rank reports and how it books an average's
cost) and :func:`fdl.engine.state.round_stats` (what the planner learns). What is modelled
(:class:`Profile`): each rank's time per batch (a fixed part plus a part proportional to the
samples, so a partial batch is cheaper but not proportionally), multiplicative log-normal
jitter per step, host work per step (inside the step timer, as in the engine), the reduce time
(``latency + bytes / bandwidth``), a slow first step on every rank, and how a background
reduce overlaps compute: on a CUDA stream it costs the compute nothing, on a host thread (gloo)
it slows the compute it overlaps by ``contention``. A blocking boundary ends when the last rank
arrives plus the reduce; a background one lets each rank go on at once and makes it wait at the
next boundary for the average it launched. In an elastic round the fastest rank steps until the
slowest one's share is done (its last step may end after it); in the calibration round every
rank done with its share takes batches from the pool until every rank is done, and in an
epoch's last round until the pool (the epoch's tail) is empty. Epoch ends wait for every rank
(the loss all-reduce and evaluation, whose time is not counted, as in the engine's ``wall_s``);
under async, which runs through them, at the next boundary, once the epoch's average has
landed. ``sync`` is modelled as lock-step steps plus the exposed part of DDP's gradient
all-reduce.

Deterministic (a seeded ``random.Random``), no sleeping, no torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from fdl.engine import wire
from fdl.engine.plan import (
    PlanConfig,
    PlanState,
    RoundPlan,
    RoundStats,
    advance,
    auto_choice,
    ends_run,
    initial_state,
    next_round,
    pool_chunk,
    pool_share,
    pool_take,
    with_policy,
)
from fdl.engine.policies import DDP_EXPOSED, Policy
from fdl.engine.state import RankState, RoundReport, round_stats

FIXED_SHARE = 0.15  # of a batch's time that does not shrink with a partial batch (optimizer step)


@dataclass(frozen=True)
class Profile:
    name: str
    batch_ms: tuple[float, ...]  # compute per full batch, per rank
    params: int  # averaged values (4 bytes each)
    bandwidth_gbs: float  # reduce bandwidth, GB/s
    latency_ms: float = 0.05
    host_ms: float = 0.5  # data, collate, host-to-device copy: per step, inside the timer
    jitter: float = 0.02  # sigma of the per-step log-normal factor
    overlap: str = "stream"  # "stream" (CUDA) or "thread" (gloo on a shared host)
    contention: float = 0.5  # thread overlap: compute slowdown while a reduce runs
    first_step: float = 4.0  # x a step: the run's first one (allocations, lazy init)
    batch_size: int = 128
    dataset_size: int = 50_000
    epochs: int = 3
    max_samples: int | None = None  # the run's sample budget (PlanConfig.max_samples)
    value_bytes: float = 4  # what an average sends per value: fdl.engine.wire.value_bytes
    outer_ms: float = 0.0  # the outer optimizer's step, on every rank as each average lands

    @property
    def reduce_ms(self) -> float:
        return self.latency_ms + self.value_bytes * self.params / (self.bandwidth_gbs * 1e6)

    @property
    def gradient_reduce_ms(self) -> float:
        """sync's all-reduce of float32 gradients (the average's dtype does not touch it)."""
        return self.latency_ms + 4 * self.params / (self.bandwidth_gbs * 1e6)

    def step_ms(self, rank: int, samples: int, rng: random.Random) -> float:
        """One step's time on ``rank`` (host work included), drawn with jitter."""
        share = FIXED_SHARE + (1 - FIXED_SHARE) * samples / self.batch_size
        noise = math.exp(rng.gauss(0.0, self.jitter) - self.jitter ** 2 / 2)
        return (self.batch_ms[rank] * share + self.host_ms) * noise

    @property
    def ideal_samples_per_s(self) -> float:
        """Every rank training alone at its own speed, summed."""
        return sum(self.batch_size * 1000 / (ms + self.host_ms) for ms in self.batch_ms)


@dataclass
class SimResult:
    profile: str
    policy: str
    samples: int
    wall_s: float
    ideal_samples_per_s: float
    averages: int
    final_anchor: int
    idle: tuple[float, ...]
    anchors: list[int] = field(default_factory=list)
    chosen: str = ""  # auto's pick (the policy itself otherwise)

    @property
    def efficiency(self) -> float:
        return self.samples / self.wall_s / self.ideal_samples_per_s


@dataclass
class _Pending:
    done_ms: float
    reports: list[RoundReport]


def simulate(profile: Profile, policy: str | Policy, *, seed: int = 0,
             overhead_target: float | None = None) -> SimResult:
    """Run ``profile`` under ``policy`` (a name, or a policy object as the engine's config holds
    one) on the virtual clock; the same seed gives the same result."""
    rng = random.Random(seed)
    world = len(profile.batch_ms)
    config = PlanConfig(world_size=world, batch_size=profile.batch_size,
                        dataset_size=profile.dataset_size, epochs=profile.epochs,
                        max_samples=profile.max_samples, policy=policy)
    if overhead_target is not None:
        config = replace(config, overhead_target=overhead_target)
    rule = config.policy
    if not rule.local_steps:
        return _simulate_sync(profile, config, rng)
    state, ranks = initial_state(config), [RankState() for _ in range(world)]
    chosen = rule  # auto: cadence's rounds until choose_policy picks
    clock, busy_total = [0.0] * world, [0.0] * world
    pending: _Pending | None = None
    epoch_in_flight = False
    averages, anchors, trained = 0, [], 0
    while not state.finished:
        plan = next_round(state)
        used = [s.num_samples for s in plan.slices]
        if plan.round_index == 0:  # the run's first step: timed apart, as the engine does
            clock = [c + (profile.first_step - 1) * profile.step_ms(r, profile.batch_size, rng)
                     for r, c in enumerate(clock)]
        busy = [_compute(profile, plan, r, clock[r], pending, rng)[0] for r in range(world)]
        if plan.elastic is not None:  # the fastest rank runs until the slowest is done
            deadline = clock[plan.signal_from] + busy[plan.signal_from]
            busy[plan.elastic], used[plan.elastic] = _compute(
                profile, plan, plan.elastic, clock[plan.elastic], pending, rng,
                until_ms=deadline)
        pool_used = _take_from_pool(profile, plan, clock, busy, used, rng,
                                    chunks=[pool_chunk(state, r) for r in range(world)],
                                    shares=[pool_share(state, r) for r in range(world)]) \
            if plan.pool else None
        trained += sum(used)
        arrive = [clock[r] + busy[r] for r in range(world)]
        reports = [ranks[r].report(busy_ms=busy[r], samples=used[r], since_checkpoint_s=0.0)
                   for r in range(world)]
        blocking = rule.blocking(plan, checkpoint_due=False, ends_run=ends_run(state, plan))
        ready = [max(a, pending.done_ms) + profile.outer_ms for a in arrive] if pending \
            else list(arrive)
        if epoch_in_flight:  # async: the epoch's loss all-reduce and evaluation, on its average
            ready, epoch_in_flight = [max(ready) + profile.latency_ms] * world, False
        rows = pending.reports if pending else None
        if blocking:
            done = max(ready) + profile.reduce_ms + profile.outer_ms
            leave, rows, pending = [done] * world, reports, None
        else:
            pending = _Pending(max(ready) + profile.reduce_ms, reports)
            leave = ready
        for r in range(world):
            ranks[r].after_sync(leave[r] - arrive[r], blocking=blocking)
            busy_total[r] += busy[r]
        averages += 1
        stats = round_stats(rows) if rows is not None else RoundStats.unknown(world)
        state = advance(state, plan, stats,
                        elastic_used=None if plan.elastic is None else used[plan.elastic],
                        pool_used=pool_used)
        picked = auto_choice(state) \
            if chosen.decides and rows is not None and not plan.calibration else None
        if picked is not None:  # the engine's rule and switch (fdl.engine.rounds)
            chosen = picked.policy
            state = with_policy(state, chosen, reason=f"policy auto: {chosen.name}")
            rule = chosen
            if not chosen.local_steps:  # lock-step from here, as the engine's DDP steps
                leave = [max(leave)] * world
                if plan.last_in_epoch:
                    leave = [max(leave) + profile.latency_ms] * world
                return _simulate_sync(profile, state.config, rng, start=state, wall=max(leave),
                                      trained=trained, busy_total=busy_total, name=config.policy.name,
                                      averages=averages)
        anchors.append(state.anchor)
        if plan.last_in_epoch and blocking:  # the epoch's loss all-reduce and evaluation
            leave = [max(leave) + profile.latency_ms] * world
        elif plan.last_in_epoch:  # async runs on: they wait for the epoch's average to land
            epoch_in_flight = True
        clock = leave
    wall_ms = max(clock)
    return SimResult(profile.name, config.policy.name, trained, wall_ms / 1000,
                     profile.ideal_samples_per_s, averages, state.anchor,
                     tuple(1 - b / wall_ms for b in busy_total), anchors, chosen.name)


def _take_from_pool(profile: Profile, plan: RoundPlan, clock: list[float], busy: list[float],
                    used: list[int], rng: random.Random, *, chunks: list[int],
                    shares: list[float]) -> int:
    """The round's shared pool (the engine's ``SharedPool``): a rank done with its slice takes
    the next batch, earliest rank first, while the pool lasts and, in the calibration round,
    while some rank is still on its own; the epoch's last round's pool is drained, each take
    ``pool_take`` of what the rank saw left at its last one (``chunks[r]`` at least). A take
    costs a round trip (``latency_ms``). Adds to ``busy`` and ``used`` in place; returns the
    batches taken."""
    world = len(busy)
    all_done = math.inf if plan.drains else max(clock[r] + busy[r] for r in range(world))
    taken, left = 0, plan.pool_stop - plan.pool_start
    seen = [plan.pool] * world  # what each rank saw left at its last take
    while taken < plan.pool:
        now, rank = min((clock[r] + busy[r], r) for r in range(world))
        if now >= all_done:
            break
        count = pool_take(left=seen[rank], chunk=chunks[rank], share=shares[rank]) \
            if plan.drains else 1
        busy[rank] += profile.latency_ms
        seen[rank] = max(0, plan.pool - taken - count)
        for _ in range(min(count, plan.pool - taken)):
            n = min(left, profile.batch_size)
            busy[rank] += profile.step_ms(rank, n, rng)
            used[rank] += n
            left -= n
            taken += 1
    return taken


def _compute(profile: Profile, plan: RoundPlan, rank: int, start_ms: float,
             pending: _Pending | None, rng: random.Random,
             until_ms: float | None = None) -> tuple[float, int]:
    """Rank ``rank``'s busy time in ``plan`` and the samples it used: its steps (with
    ``until_ms``, an elastic rank's: steps until the first one that ends after it), plus, on a
    host thread, the share of a background reduce still running that it gives up."""
    mine = plan.slices[rank]
    busy, left = 0.0, mine.num_samples
    for index in range(mine.steps):
        if until_ms is not None and index and start_ms + busy >= until_ms:
            break
        n = min(left, profile.batch_size)
        busy += profile.step_ms(rank, n, rng)
        left -= n
    if pending is not None and profile.overlap == "thread" and pending.done_ms > start_ms:
        overlap = min(pending.done_ms - start_ms, busy)
        busy += overlap * profile.contention
    return busy, mine.num_samples - left


def _simulate_sync(profile: Profile, config: PlanConfig, rng: random.Random, *,
                   start: PlanState | None = None, wall: float = 0.0, trained: int = 0,
                   busy_total: list[float] | None = None, name: str | None = None,
                   averages: int = 0) -> SimResult:
    """Sync in lock-step from ``start`` (default: the run's beginning; auto's switch passes
    where it chose, with the clock, samples and busy times so far)."""
    state = initial_state(config) if start is None else start
    world = config.world_size
    busy_total = [0.0] * world if busy_total is None else busy_total
    while not state.finished:
        plan = next_round(state)
        trained += plan.num_samples
        steps = [profile.step_ms(r, s.num_samples, rng) if s.steps else 0.0
                 for r, s in enumerate(plan.slices)]
        for r in range(world):
            busy_total[r] += steps[r]
        wall += max(steps) + DDP_EXPOSED * profile.gradient_reduce_ms
        state = advance(state, plan, RoundStats.unknown(world))
    return SimResult(profile.name, name or config.policy.name, trained,
                     wall / 1000, profile.ideal_samples_per_s, averages, 1,
                     tuple(1 - b / wall for b in busy_total), chosen=config.policy.name)


RTX_5060_TI_RESNET20_MS = 12.0  # modelled, not measured: ms per batch of 128 on the fast card
GPT_NANO_MS = 45.0
PCIE_GBS, GIGABIT_GBS, WIFI_GBS = 6.0, 0.118, 0.01
RESNET20_PARAMS, GPT_NANO_PARAMS, BENCH_MLP_PARAMS = 272_474, 10_700_000, 2_380_000


def profiles() -> list[Profile]:
    """The table ``scripts/sim-elche`` prints (docs/elche.md explains each row)."""
    resnet = Profile("5060 Ti + 1060, ResNet-20 (2.6x)",
                     (RTX_5060_TI_RESNET20_MS, RTX_5060_TI_RESNET20_MS * 2.6),
                     RESNET20_PARAMS, PCIE_GBS)
    gpt = Profile("5060 Ti + 1060, GPT-nano (2.8x)", (GPT_NANO_MS, GPT_NANO_MS * 2.8),
                  GPT_NANO_PARAMS, PCIE_GBS, batch_size=64, dataset_size=100_000)
    fast = RTX_5060_TI_RESNET20_MS
    return [
        resnet,
        gpt,
        replace(resnet, name="ResNet-20, 1.5x gap", batch_ms=(fast, fast * 1.5)),
        replace(resnet, name="ResNet-20, 4x gap", batch_ms=(fast, fast * 4)),
        replace(resnet, name="ResNet-20, two equal GPUs", batch_ms=(fast, fast)),
        replace(resnet, name="ResNet-20, 3 ranks (1, 1.5, 3)",
                batch_ms=(fast, fast * 1.5, fast * 3)),
        replace(resnet, name="ResNet-20 2.6x, jitter 10%", jitter=0.10),
        replace(resnet, name="ResNet-20 2.6x, 1 Gbit/s network", bandwidth_gbs=GIGABIT_GBS,
                latency_ms=0.3, overlap="thread", contention=0.1),
        replace(gpt, name="GPT-nano 2.8x, 1 Gbit/s network", bandwidth_gbs=GIGABIT_GBS,
                latency_ms=0.3, overlap="thread", contention=0.1),
        replace(gpt, name="GPT-nano 2.8x, WiFi (80 Mbit/s)", bandwidth_gbs=WIFI_GBS,
                latency_ms=3.0, overlap="thread", contention=0.1),
        replace(gpt, name="GPT-nano 2.8x, WiFi, --average-dtype int4", bandwidth_gbs=WIFI_GBS,
                latency_ms=3.0, overlap="thread", contention=0.1,
                value_bytes=wire.value_bytes("int4")),
        Profile("this machine's bench: MLP, 2 CPU workers, 2.5x", (21.9, 21.9 * 2.5),
                BENCH_MLP_PARAMS, 1.0, latency_ms=0.5, host_ms=0.3, jitter=0.10,
                overlap="thread", contention=0.5, dataset_size=16_384),
    ]


def table(*, seeds: int = 3, overhead_target: float | None = None) -> str:
    """The markdown table of every profile under every policy: the median efficiency over
    ``seeds`` seeds (and the range), the final anchor and the averages of the median run."""
    lines = ["| profile | sync | cadence | async | auto (its pick) | anchor (cadence / async) "
             "| averages |", "|---|---:|---:|---:|---:|---:|---:|"]
    for profile in profiles():
        cells, anchors, averages = [], [], []
        for policy in ("sync", "cadence", "async", "auto"):
            runs = sorted((simulate(profile, policy, seed=seed,
                                    overhead_target=overhead_target) for seed in range(seeds)),
                          key=lambda r: r.efficiency)
            median = runs[len(runs) // 2]
            cells.append(f"{median.efficiency:.3f}" + (f" ({median.chosen})"
                                                         if policy == "auto" else ""))
            if policy in ("cadence", "async"):
                anchors.append(str(median.final_anchor))
                averages.append(str(median.averages))
        lines.append(f"| {profile.name} | {' | '.join(cells)} | {' / '.join(anchors)} | "
                     f"{' / '.join(averages)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="scripts/sim-elche", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per cell (the median shows)")
    parser.add_argument("--overhead-target", type=float, default=None,
                        help="the planner's overhead target (default: the engine's)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or (args.overhead_target is not None and not args.overhead_target > 0):
        parser.error("--seeds must be >= 1 and --overhead-target > 0")
    print(table(seeds=args.seeds, overhead_target=args.overhead_target))


if __name__ == "__main__":
    main()
