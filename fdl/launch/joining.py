"""How many nodes have reached a multi-node run's rendezvous, said live while a node waits:
``fdl run: waiting for nodes: 1/2 joined at 192.168.1.10:29400 (30 s)``.

torch's rendezvous keeps its state under its own keys of the rendezvous store, in a form it
does not publish; fdl counts the nodes itself, through the store's public API. Each node's
launcher, once it reaches the store (node 0's agent serves it; a client connection waits until
it does), claims a slot (``add`` on a counter) and ticks its slot's key every second; a slot
whose value moved within the last ``ALIVE_S`` on this node's clock is a node that is there, so
a node that gave up (Ctrl-C, a crash) stops counting without any clock shared between
machines. A line is written when the count changes, and every ``REMIND_S`` while it does not;
once every node is there the watch says so (one last line) and goes on ticking, silently, for
``LINGER_S``: a node that counts later (its own ticks delayed by a busy host) must still see
this one's slot move, or it would count it gone and wait on at "1/2 joined" for the whole run.
It ends then, or when the launch returns. The keys live under ``fdl/joined/<run id>/``, apart
from torch's.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

TICK_S = 1.0  # how often a node ticks its slot and counts the others
ALIVE_S = 3.5  # a slot that has not moved for this long is a node that left
REMIND_S = 30.0  # the line again while the count stands still
CONNECT_S = 2.0  # one try to reach the store (node 0's may not serve yet)
LINGER_S = 60.0  # the ticks go on this long after every node is there, for the others' counts


class JoinWatch:
    """The live count of one node's wait at the rendezvous ``host:port`` for ``nodes`` nodes
    (``say`` writes a line). :meth:`start` it before the launch blocks, :meth:`stop` after."""

    def __init__(self, host: str, port: int, *, run_id: str, nodes: int,
                 say: Callable[[str], None], endpoint: str | None = None):
        self.host, self.port, self.nodes, self.say = host, port, nodes, say
        self.endpoint = endpoint or f"{host}:{port}"
        self.prefix = f"fdl/joined/{run_id}/"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fdl-join-watch", daemon=True)
        self.seen: dict[int, tuple[int, float]] = {}  # slot -> (its value, when it last moved)
        self.errors: list[str] = []  # the last few failures, for whoever debugs a count

    def start(self) -> JoinWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CONNECT_S + TICK_S)

    def _run(self) -> None:
        started = time.monotonic()
        store = slot = None
        shown, said = -1, 0.0
        full: float | None = None  # when every node was there (this node said so)
        while not self._stop.is_set():
            if full is not None and time.monotonic() - full >= LINGER_S:
                return
            try:
                if store is None:
                    store = self._connect()
                    self.seen.clear()
                    if (store is not None and slot is not None
                            and int(store.add(self.prefix + "slots", 0)) < slot):
                        slot = None  # a store begun anew (node 0 restarted): claim again
                if store is not None and slot is None:  # claimed once: a reconnect keeps it
                    slot = int(store.add(self.prefix + "slots", 1))
                if store is not None and slot is not None:
                    store.add(f"{self.prefix}{slot}", 1)
                if store is not None and slot is not None and full is None:  # said: ticks only
                    count = self._count(store, slot)
                    now = time.monotonic()
                    if count >= self.nodes:
                        self.say(f"fdl run: {count}/{self.nodes} nodes joined at "
                                 f"{self.endpoint}")
                        full = now
                    elif count != shown or now - said >= REMIND_S:
                        self.say(f"fdl run: waiting for nodes: {count}/{self.nodes} joined at "
                                 f"{self.endpoint} ({now - started:.0f} s)")
                        shown, said = count, now
            except Exception as error:  # the store went (the run ended, a node left):
                store = None  # the launch says what happened; this only counts
                self.errors = [*self.errors[-4:], f"{type(error).__name__}: {error}"]
            self._stop.wait(TICK_S)

    def _connect(self) -> Any:
        """A client of the rendezvous store, or None when it does not answer yet. A plain TCP
        connection tries first: a TCPStore client that fails writes screens of C++ frames to
        stderr at every try, the socket nothing."""
        from torch.distributed import TCPStore

        try:
            socket.create_connection((self.host, self.port), timeout=CONNECT_S).close()
            return TCPStore(self.host, self.port, is_master=False,
                            timeout=timedelta(seconds=CONNECT_S), wait_for_workers=False)
        except Exception:  # not serving yet, or unreachable: try again
            return None

    def _count(self, store: Any, mine: int) -> int:
        """The nodes whose slot moved within ``ALIVE_S`` (this node's own always counts). Each
        slot is read with ``add(key, 0)``, which never waits: a slot claimed but not yet ticked
        reads 0 (a ``get`` would block on it until the store's timeout)."""
        slots = int(store.add(self.prefix + "slots", 0))
        now = time.monotonic()
        for number in range(1, slots + 1):
            value = int(store.add(f"{self.prefix}{number}", 0))
            last = self.seen.get(number)
            if last is None:  # first seen: there only once it moves (a node that left stays)
                self.seen[number] = (value, -math.inf)
            elif last[0] != value:
                self.seen[number] = (value, now)
        return 1 + sum(1 for number, (_, moved) in self.seen.items()
                       if number != mine and now - moved < ALIVE_S)
