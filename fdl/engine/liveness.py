"""Signs of life between ranks, so that a rank waiting on the store for a peer's message learns
within seconds that the peer is gone, instead of waiting out the store's timeout.

A collective notices a peer that died (gloo sees its connection close). A wait on the store does
not: the round's messages (the elastic rank's report, the pool's count, what the slowest rank
posts when done) are keys that a dead peer never sets, and the store itself, hosted by node 0's
launcher, is fine. So every rank keeps a counter in the store ticking from a thread of its own
(:data:`BEAT_S`), on a clone of the store (torch's way to use a store from a second thread), and
a rank that waits for a key waits in slices, reading the others' counters between them
(:func:`wait_for`): a counter that has not moved for :data:`SILENT_S` names its rank, and the
wait ends with :class:`PeerGone`. A live rank, however slow its steps, ticks. Only policies
whose rounds have such messages tick (cadence, async, auto); sync's ranks meet in collectives
alone, and a ticking thread is not free: beside short steps it can disturb the step times the
slowdown emulation sleeps on. Between the same slices the wait reads whether a rank posted why
it failed (fdl.engine.peers): a peer that fails with an error stops the others within a slice,
named with its error.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fdl.engine.peers import (
    STOPPED_WITH_IT,
    PeerGone,
    failed_line,
    group_attempt,
    peer_name,
    posted_cause,
)

__all__ = ["PeerGone", "liveness", "stop_ticking", "store_clone", "wait_alive", "wait_for"]

BEAT_S = 2.0  # between a rank's ticks (each a store round trip, from a thread)
SILENT_S = 15.0  # a rank whose counter has not moved for this long is gone (7 beats)
SLICE_S = 1.0  # a wait's slice, between looks at the counters
STOP_WAIT_S = 5.0  # a run's end waits this long for a tick in flight (a store round trip)


@dataclass
class Liveness:
    """This rank's ticking thread and what it last saw of the others' counters."""

    store: Any
    rank: int
    world_size: int
    key: str
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank: (count, since)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Liveness:
        beats = self.store.clone()

        def tick() -> None:
            while not self.stop.wait(BEAT_S):
                try:
                    beats.add(f"{self.key}{self.rank}", 1)
                except Exception:  # the store is gone: the run is ending, nobody listens
                    return

        beats.add(f"{self.key}{self.rank}", 1)  # on the clone: the caller's store is left alone
        self.thread = threading.Thread(target=tick, name="fdl-liveness", daemon=True)
        self.thread.start()
        return self

    def close(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop ticking and wait (at most ``wait_s``) for a tick in flight; whether the thread
        is gone. A daemon thread still inside a store call when the interpreter shuts down
        aborts the process as it returns from it (pybind11 cannot unwind the thread: SIGABRT,
        "terminate called without an active exception"), after the run had finished well."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(wait_s)
        return self.thread is None or not self.thread.is_alive()

    def silent(self, reader: Any, *, now: float | None = None) -> int | None:
        """A rank whose counter has not moved for :data:`SILENT_S` (None: all tick), read
        through ``reader`` (the waiting thread's own store object)."""
        now = time.monotonic() if now is None else now
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            count = int(reader.add(f"{self.key}{rank}", 0))
            last = self.seen.get(rank)
            if last is None or count != last[0]:
                self.seen[rank] = (count, now)
            elif now - last[1] >= SILENT_S:
                return rank
        return None


_CURRENT: dict[str, Liveness] = {}


def liveness(store: Any) -> Liveness:
    """This process's :class:`Liveness` on ``store``, started at the first call."""
    attempt = group_attempt()
    key = f"fdl/alive/{attempt}/"
    current = _CURRENT.get(key)
    if not _CURRENT and current is None:  # any exit: finished, failed, without run.finish()
        atexit.unregister(stop_ticking)
        atexit.register(stop_ticking)  # atexit runs before the interpreter starts shutting down
    if current is None:  # one per attempt (a restarted group ticks under its own keys)
        for earlier in _CURRENT.values():
            earlier.stop.set()
        current = _CURRENT[key] = Liveness(store, int(os.environ.get("RANK", "0")),
                                           int(os.environ.get("WORLD_SIZE", "1")), key).start()
    return current


def stop_ticking(wait_s: float = STOP_WAIT_S) -> bool:
    """Stop this process's ticking threads (a run's end, the process's exit); whether all are
    gone within ``wait_s``. A later :func:`liveness` starts a new one."""
    stopped = [current.close(wait_s) for current in _CURRENT.values()]
    _CURRENT.clear()
    return all(stopped)


def wait_for(store: Any, key: str, *, alive: Liveness, waiting_for: str) -> None:
    """Until ``key`` exists in ``store`` (this thread's store object); :class:`PeerGone` when
    a rank goes silent first. ``waiting_for``: what this rank waits for, for the message.

    The key is waited for by a thread of its own, blocked in the store's ``wait`` on a clone of
    the store (it returns the moment the key is set), while this thread looks at the counters
    every :data:`SLICE_S`. (A ``wait`` with a timeout would do both in one thread, but torch
    logs two warning lines at each timeout.)"""
    if store.check([key]):
        return
    done, error = threading.Event(), []
    waiter = store_clone(store, "wait")

    def run() -> None:
        try:
            waiter.wait([key])
        except BaseException as exc:  # a lost store: raised below
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="fdl-store-wait", daemon=True).start()
    wait_alive(done, store, alive=alive, waiting_for=waiting_for)
    if error:
        if _timed_out(error[0]):  # the store's timeout: --collective-timeout
            seconds = _timeout_s(waiter)
            raise PeerGone(f"the run gave up waiting for {waiting_for}: nothing came within the "
                           f"collective timeout"
                           + (f" ({seconds:g} s, --collective-timeout)" if seconds else "")
                           + " (a rank stopped, suspended or far slower than the others)",
                           hint=STOPPED_WITH_IT) from error[0]
        raise error[0]


def _timed_out(exc: BaseException) -> bool:
    """Whether a store's ``wait`` gave up at its timeout (torch raises DistStoreError, "wait
    timeout after 5000ms, keys: ...")."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()


def _timeout_s(store: Any) -> float | None:
    """The store's timeout in seconds (None when it does not say)."""
    timeout = getattr(store, "timeout", None)
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else None


def wait_alive(done: threading.Event, store: Any, *, alive: Liveness, waiting_for: str) -> None:
    """Until ``done`` is set; :class:`PeerGone` when a rank goes silent first (its counters
    read through ``store``, this thread's)."""
    while not done.wait(SLICE_S):
        failed = posted_cause(store, rank=alive.rank, world_size=alive.world_size)
        if failed is not None:
            raise PeerGone(failed_line(*failed), hint=STOPPED_WITH_IT)
        gone = alive.silent(store)
        if gone is not None:
            raise PeerGone(f"the run lost a peer: {peer_name(gone)} stopped answering (no "
                           f"sign of life for {SILENT_S:g} s) while this rank waited for "
                           f"{waiting_for}", hint=STOPPED_WITH_IT)


_CLONES: dict[tuple[int, str], tuple[Any, Any]] = {}


def store_clone(store: Any, role: str) -> Any:
    """This process's clone of ``store`` for the thread doing ``role`` (a store object must
    not be blocked in ``wait`` by one thread while another sends on it); one per store and
    role, reused, since each role waits for one key at a time."""
    held = _CLONES.get((id(store), role))
    if held is None:  # the store is held with its clone: its id is never reused meanwhile
        held = _CLONES[(id(store), role)] = (store, store.clone())
    return held[1]
