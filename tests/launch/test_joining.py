"""fdl.launch.joining: the live count of the nodes at a rendezvous, on a real TCPStore served
on 127.0.0.1 as node 0's agent serves it, with each watch standing for one node's launcher."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from helpers import free_port

from fdl.launch.joining import JoinWatch

GUARD_S = 60  # a guard against a hang, not a measurement


class Lines:
    """What a watch said, and an event per awaited line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Condition()
        self.watch: JoinWatch | None = None

    def say(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)
            self.lock.notify_all()

    def wait_for(self, needle: str) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: any(needle in line for line in self.lines),
                                      timeout=GUARD_S):
                errors = self.watch.errors if self.watch else []
                raise AssertionError(f"never said {needle!r}: {self.lines}, errors {errors}")


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    yield server, port


def watch(port: int, lines: Lines, run_id: str = "run") -> JoinWatch:
    lines.watch = JoinWatch("127.0.0.1", port, run_id=run_id, nodes=2, say=lines.say)
    return lines.watch.start()


def meet(port: int) -> tuple[Lines, Lines]:
    """Node 0 waits alone, node 1 arrives, both count 2/2; both watches stopped after."""
    first, second = Lines(), Lines()
    node0 = watch(port, first)
    try:
        first.wait_for(f"waiting for nodes: 1/2 joined at 127.0.0.1:{port}")
        node1 = watch(port, second)
        try:
            for lines in (first, second):
                lines.wait_for(f"2/2 nodes joined at 127.0.0.1:{port}")
        finally:
            node1.stop()
    finally:
        node0.stop()
    return first, second


def test_a_waiting_node_counts_itself_then_the_node_that_arrives(store):
    _, port = store
    first, _ = meet(port)
    assert not any("2/2" in line for line in first.lines[:1])


def test_a_node_that_left_is_not_counted(store):
    """A slot claimed by a launcher that then went (its key never moves again) is no node; a
    watch of another run does not count either."""
    server, port = store
    server.add("fdl/joined/run/slots", 1)
    server.add("fdl/joined/run/1", 5)  # claimed, ticked, gone
    other = watch(port, Lines(), run_id="another")  # a node of another run
    try:
        first, _ = meet(port)
    finally:
        other.stop()
    waiting = [line for line in first.lines if "waiting" in line]
    assert waiting and all("1/2 joined" in line for line in waiting)


def test_a_slot_claimed_but_never_ticked_does_not_stall_the_count(store):
    """A launcher killed between claiming its slot and its first tick leaves a slot with no
    key: reading it must not wait on the key (that waited out the store's timeout at every
    tick, and the count never moved)."""
    server, port = store
    server.add("fdl/joined/run/slots", 1)  # claimed, then killed before it ticked
    first, second = meet(port)
    assert first.watch.errors == [] and second.watch.errors == []


def test_a_node_that_counted_everyone_ticks_on_for_a_node_that_counts_later(store):
    """Node 1 sees node 0 and says 2/2 while node 0 has not counted node 1 yet (its ticks
    delayed by a busy host: here it stops, and a node that begins counting only now stands in
    for it). That node must still see node 1's slot move: a watch that has said 2/2 goes on
    ticking, or the other would count it gone and say 1/2 for the whole run."""
    _, port = store
    first, second, late = Lines(), Lines(), Lines()
    node0 = watch(port, first)
    try:
        first.wait_for(f"waiting for nodes: 1/2 joined at 127.0.0.1:{port}")
        node1 = watch(port, second)
        try:
            second.wait_for(f"2/2 nodes joined at 127.0.0.1:{port}")
            node0.stop()
            node2 = watch(port, late)
            try:
                late.wait_for(f"2/2 nodes joined at 127.0.0.1:{port}")
            finally:
                node2.stop()
        finally:
            node1.stop()
    finally:
        node0.stop()


def test_a_store_that_never_answers_only_stops_the_watch_when_asked():
    lines = Lines()
    quiet = JoinWatch("127.0.0.1", free_port(), run_id="run", nodes=2, say=lines.say).start()
    quiet.stop()
    assert lines.lines == []
