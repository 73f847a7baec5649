"""The round loop's messages between ranks within a round, through the process group's store
(the launcher's TCPStore): the elastic round's signal and a round's shared pool, the
calibration round's or the epoch's last round's (fdl.engine.rounds runs them;
fdl.engine.plan decides when a round has either)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from fdl.engine.liveness import Liveness, liveness, store_clone, wait_alive, wait_for
from fdl.engine.peers import group_attempt
from fdl.engine.plan import RoundPlan, pool_take
from fdl.errors import UsageError


@dataclass
class ElasticSignal:
    """An elastic round's messages, through the process group's store (the launcher's
    TCPStore): the slowest rank posts ``done`` when its share is finished; the fastest learns it
    between steps, so it stops within one of its own steps of the slowest one, then posts how
    many samples it ``used``, which every other rank reads before planning the next round
    (under async too, where the reports arrive a round late).

    The fastest rank never asks the store between steps: a thread of its own blocks in the
    store's ``wait`` on a clone of the store (torch's way to use a store from a second thread)
    and sets an event, so a step pays an event check where a store round trip per step costs a
    visible share of a short step on a busy host, and milliseconds over WiFi (docs/elche.md,
    "Measurements behind the engine's choices"). gloo's point-to-point receive cannot carry
    ``done``: it reports completion only once waited on."""

    role: str = ""  # "receive" (the elastic rank) or "send" (every other rank); "": no elastic
    store: Any = None
    key: str = ""
    watch: DoneWatch | None = None
    alive: Liveness | None = None

    @classmethod
    def open(cls, plan: RoundPlan, *, rank: int) -> ElasticSignal:
        if plan.elastic is None:
            return cls()
        store = _required_store()
        signal = cls("receive" if rank == plan.elastic else "send", store,
                     f"fdl/elastic/{restart_attempt()}/")
        signal.alive = liveness(store)
        if signal.role == "receive":
            signal.watch = DoneWatch.start(store_clone(store, "watch"), signal._key("done", plan))
        return signal

    def arrived(self, plan: RoundPlan) -> bool:
        return self.watch is not None and self.watch.done.is_set()

    def close(self, plan: RoundPlan, *, rank: int, used: int) -> int | None:
        """Post or collect the round's messages; returns the samples the elastic rank used
        (None in a round that is not elastic)."""
        if not self.role:
            return None
        if self.role == "receive":
            assert self.watch is not None and self.alive is not None
            self.watch.join(self.store, alive=self.alive)  # it may have run its reservation
            self.store.delete_key(self._key("done", plan))
            self.store.set(self._key("used", plan), str(used))
            if plan.round_index >= 2:  # every rank has read it: ranks are at most a round apart
                self.store.delete_key(f"{self.key}used/{plan.round_index - 2}")
            return used
        if rank == plan.signal_from:
            self.store.set(self._key("done", plan), "1")
        assert self.alive is not None
        wait_for(self.store, self._key("used", plan), alive=self.alive,
                 waiting_for=f"the elastic rank {plan.elastic}'s report")
        return int(self.store.get(self._key("used", plan)))

    def _key(self, name: str, plan: RoundPlan) -> str:
        return f"{self.key}{name}/{plan.round_index}"


@dataclass
class DoneWatch:
    """A daemon thread blocked in ``store.wait([key])`` (the GIL released) that sets ``done``
    when the key exists, or when the wait failed (a lost store): then :meth:`join` raises what
    it raised. :meth:`join` gives up on a silent peer (fdl.engine.liveness)."""

    done: threading.Event
    error: list[BaseException]

    @classmethod
    def start(cls, store: Any, key: str) -> DoneWatch:
        watch = cls(threading.Event(), [])

        def run() -> None:
            try:
                store.wait([key])
            except BaseException as error:
                watch.error.append(error)
            finally:
                watch.done.set()

        threading.Thread(target=run, name="fdl-elastic-watch", daemon=True).start()
        return watch

    def join(self, store: Any, *, alive: Liveness) -> None:
        """Until the key exists; raises the wait's error, or PeerGone when a rank goes silent
        first (read through ``store``, the caller's)."""
        wait_alive(self.done, store, alive=alive, waiting_for="the slowest rank to finish")
        if self.error:
            raise self.error[0]


@dataclass
class SharedPool:
    """A round's shared pool of batches, through the store's atomic counters. The calibration
    round's: a rank done with its own slice counts itself ``done``, then takes the next batch
    index (``taken``) while some rank is still on its slice and the pool lasts, so no rank idles
    while the slowest calibrates and none runs more than one step past it; the last rank to
    stop publishes how many batches were taken, which every rank reads before planning the next
    round. The epoch's last round's (``plan.drains``): every rank takes batches until the pool is
    empty, each take :func:`fdl.engine.plan.pool_take` of what was left at its last look (half
    its speed ``share`` of it, at least ``chunk``, about one step of the slowest rank): a few
    round trips per epoch, and the last rank to finish ends within about a step of the
    others."""

    size: int = 0
    world_size: int = 1
    store: Any = None
    key: str = ""
    drains: bool = False
    chunk: int = 1
    share: float = 0.0  # this rank's share of the ranks' speed (0: takes of ``chunk``)
    left: int = -1  # the batches left at this rank's last look (-1: not looked yet)

    @classmethod
    def open(cls, plan: RoundPlan, *, world_size: int, chunk: int = 1,
             share: float = 0.0) -> SharedPool:
        if not plan.pool:
            return cls()
        pool = cls(plan.pool, world_size, _required_store(),
                   f"fdl/pool/{restart_attempt()}/{plan.round_index}/", plan.drains,
                   max(1, chunk) if plan.drains else 1, share if plan.drains else 0.0)
        if not pool.drains:
            pool.store.add(pool.key + "done", 1)
        return pool

    def take(self) -> range:
        """The next pool batches' indices for this rank; empty when the pool is (or, in the
        calibration round, when every rank is done). Indices drawn past the pool are dropped."""
        if not self.size:
            return range(0)
        if not self.drains and int(self.store.add(self.key + "done", 0)) >= self.world_size:
            return range(0)
        if self.left == 0:  # this rank's last take emptied the pool
            return range(0)
        count = pool_take(left=self.size if self.left < 0 else self.left, chunk=self.chunk,
                          share=self.share) if self.drains else 1
        end = int(self.store.add(self.key + "taken", count))
        self.left = max(0, self.size - end)
        return range(end - count, min(end, self.size))

    def close(self) -> int | None:
        """The batches taken from the pool by every rank (None: no pool; a draining pool: all)."""
        if not self.size:
            return None
        if self.drains:
            return self.size
        if int(self.store.add(self.key + "stopped", 1)) == self.world_size:
            taken = int(self.store.add(self.key + "taken", 0))
            self.store.set(self.key + "used", str(min(taken, self.size)))
        wait_for(self.store, self.key + "used", alive=liveness(self.store),
                 waiting_for="the calibration pool's last rank")
        return int(self.store.get(self.key + "used"))


def restart_attempt() -> str:
    """The group's restart attempt (fdl.engine.peers.group_attempt: the same on every node):
    a key holds it, so an attempt never reads the counters an earlier attempt left in a store
    that outlived it."""
    return str(group_attempt())


def _required_store() -> Any:
    store = group_store()
    if store is None:
        raise UsageError("the process group is gone mid-run (the script called "
                         "torch.distributed.destroy_process_group() before run.finish()?): "
                         "fdl's rounds go on over it until run.finish()",
                         hint="leave the group to fdl: run.finish() destroys it at the end")
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
