"""The round loop's messages between ranks within a round, through the process group's store
(the launcher's TCPStore): the elastic round's signal and the calibration round's shared pool
(fdl.engine.rounds runs them; fdl.engine.plan decides when a round has either)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from fdl.engine.plan import RoundPlan

# The share of the slowest rank's estimated round time the elastic rank runs without checking.
QUIET_SHARE = 0.8


@dataclass
class ElasticSignal:
    """An elastic round's messages, through the process group's store (the launcher's
    TCPStore): the slowest rank posts ``done`` when its share is finished; the fastest checks
    for it between steps (a round trip of some 15 microseconds), so it stops within one of its
    own steps of the slowest one, then posts how many samples it ``used``, which every other
    rank reads before planning the next round (under async too, where the reports arrive a
    round late). gloo's point-to-point receive could not carry ``done``: it reports completion
    only once waited on."""

    role: str = ""  # "receive" (the elastic rank) or "send" (every other rank); "": no elastic
    store: Any = None
    key: str = ""
    # The elastic rank's clock (time.perf_counter) before which the slowest rank cannot be
    # done by its own speed estimate: no check before it. A check is a round trip to the store
    # (0.3-0.6 ms on a 2-core host with two workers training: 18% of lenet5's 2.5 ms steps in
    # fdl bench --quick, by cProfile); the estimate lets the fast rank skip most of them and
    # still stop within one of its steps of the slowest one.
    quiet_until: float = 0.0

    @classmethod
    def open(cls, plan: RoundPlan, *, rank: int, slowest_s: float = 0.0) -> ElasticSignal:
        """``slowest_s``: how long the slowest rank's share of the round should take by its
        speed estimate (0: unknown, check from the first step on)."""
        if plan.elastic is None:
            return cls()
        return cls("receive" if rank == plan.elastic else "send", _required_store(),
                   f"fdl/elastic/{restart_attempt()}/",
                   time.perf_counter() + QUIET_SHARE * max(0.0, slowest_s))

    def arrived(self, plan: RoundPlan) -> bool:
        if self.role != "receive" or time.perf_counter() < self.quiet_until:
            return False
        return self.store.check([self._key("done", plan)])

    def close(self, plan: RoundPlan, *, rank: int, used: int) -> int | None:
        """Post or collect the round's messages; returns the samples the elastic rank used
        (None in a round that is not elastic)."""
        if not self.role:
            return None
        if self.role == "receive":
            done = self._key("done", plan)
            self.store.wait([done])  # it may have run its whole reservation first
            self.store.delete_key(done)
            self.store.set(self._key("used", plan), str(used))
            if plan.round_index >= 2:  # every rank has read it: ranks are at most a round apart
                self.store.delete_key(f"{self.key}used/{plan.round_index - 2}")
            return used
        if rank == plan.signal_from:
            self.store.set(self._key("done", plan), "1")
        return int(self.store.get(self._key("used", plan)))

    def _key(self, name: str, plan: RoundPlan) -> str:
        return f"{self.key}{name}/{plan.round_index}"


@dataclass
class CalibrationPool:
    """The calibration round's shared pool, through the store's atomic counters: a rank done
    with its own slice counts itself ``done``, then takes the next batch index (``taken``) while
    some rank is still on its slice and the pool lasts: so no rank idles while the slowest
    calibrates, and none runs more than one step past it. The last rank to stop publishes how
    many batches were taken; every rank reads it before planning the next round."""

    size: int = 0
    world_size: int = 1
    store: Any = None
    key: str = ""

    @classmethod
    def open(cls, plan: RoundPlan, *, world_size: int) -> CalibrationPool:
        if not plan.pool:
            return cls()
        pool = cls(plan.pool, world_size, _required_store(),
                   f"fdl/pool/{restart_attempt()}/{plan.round_index}/")
        pool.store.add(pool.key + "done", 1)
        return pool

    def take(self) -> int | None:
        """The next pool batch's index for this rank, or None: everyone is done or the pool is
        empty (an index past the pool is drawn and dropped; close() counts those out)."""
        if not self.size or int(self.store.add(self.key + "done", 0)) >= self.world_size:
            return None
        index = int(self.store.add(self.key + "taken", 1)) - 1
        return index if index < self.size else None

    def close(self) -> int | None:
        """The batches taken from the pool by every rank (None: no pool)."""
        if not self.size:
            return None
        if int(self.store.add(self.key + "stopped", 1)) == self.world_size:
            taken = int(self.store.add(self.key + "taken", 0))
            self.store.set(self.key + "used", str(min(taken, self.size)))
        return int(self.store.get(self.key + "used"))  # waits for the last rank to stop


def restart_attempt() -> str:
    """torchelastic's restart count: a key holds it, so an attempt never reads the counters an
    earlier attempt left in a store that outlived it."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _required_store() -> Any:
    store = group_store()
    if store is None:
        raise RuntimeError("an elastic round or a pool needs the process group's store")
    return store


def group_store() -> Any:
    """The default process group's store (the launcher's TCPStore under ``fdl run``), or None
    without a group. torch has no public accessor for it: this is the one place that asks."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
