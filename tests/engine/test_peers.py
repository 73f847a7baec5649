"""fdl.engine.peers on a real TCPStore: a lost peer named from gloo's message, and a failing
rank's root cause posted for the others and read back, in a wait or after a collective (the
two-node test fails a namespace node for real: tests/nodes)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import run_fdl

from fdl.engine import peers
from fdl.engine.collectives import SEVERAL_NODES_TIMEOUT_S, Membership, group_timeout
from fdl.engine.liveness import Liveness, wait_alive
from fdl.errors import UsageError
from fdl.settings import BY_NAME

FAIL = Path(__file__).parent / "scripts" / "fail_mid_run.py"


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))


@pytest.fixture
def labels(monkeypatch):
    monkeypatch.setattr(peers, "PEERS", ["node 0, a, 198.18.0.1", "node 1, b, 198.18.0.2"])


def test_a_lost_peer_is_named_from_gloos_message(labels):
    """Both ways gloo reports a peer whose process ended; any other error is left alone."""
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [198.18.0.2]:21167. This is")
    reset = RuntimeError("[pair.cc:537] Read error [198.18.0.2]:43701: Connection reset by peer.")
    for error in (closed, reset):
        assert peers.lost_peer(error) == (
            "the run lost a peer: the connection to rank 1 (node 1, b, 198.18.0.2) closed "
            "during a collective (its worker or node stopped or crashed)")
        assert peers.is_consequence(error)
    unknown = RuntimeError("Connection closed by peer [10.9.9.9]:1")  # before the group agreed
    assert "the connection to 10.9.9.9 closed" in peers.lost_peer(unknown)
    assert peers.lost_peer(RuntimeError("CUDA out of memory [1]:2")) is None
    assert not peers.is_consequence(ValueError("the script's own"))


def test_a_failing_rank_posts_its_cause_and_a_peer_reads_it(store, labels):
    assert peers.posted_cause(store, rank=0, world_size=2) is None
    cause = peers.cause_of(ValueError("a bad batch\n  second line"))
    assert cause == "ValueError: a bad batch"
    assert peers.tell_peers(store, cause, rank=1)
    assert peers.posted_cause(store, rank=1, world_size=2) is None  # its own is not a peer's
    failed = peers.cause_within(store, rank=0, world_size=2)
    assert failed == (1, "ValueError: a bad batch")
    assert peers.failed_line(*failed) == ("the run lost a peer: rank 1 (node 1, b, 198.18.0.2) "
                                         "failed: ValueError: a bad batch")
    assert len(peers.cause_of(RuntimeError("x" * 5000))) == peers.MAX_CAUSE
    # a cause is printed on the other node's terminal: no escape sequence reaches it
    peers.tell_peers(store, "ValueError: \x1b]0;owned\x07 \u202eevil", rank=2)
    assert peers.posted_cause(store, rank=0, world_size=3) == (1, "ValueError: a bad batch")
    assert peers.posted_cause(store, rank=1, world_size=3) == (
        2, "ValueError: ?]0;owned? ?evil")


def test_a_wait_stops_as_soon_as_a_peer_posts_why_it_failed(store, labels):
    """The wait's next slice reads the post: no silence of SILENT_S to wait out."""
    alive = Liveness(store, rank=0, world_size=2, key="fdl/alive/0/")
    threading.Timer(0.2, lambda: peers.tell_peers(store, "OSError: disk full", rank=1)).start()
    with pytest.raises(peers.PeerGone, match=r"rank 1 \(node 1, b, 198.18.0.2\) failed: "
                                             r"OSError: disk full"):
        wait_alive(threading.Event(), store, alive=alive, waiting_for="the report")


def test_a_store_that_never_answers_costs_a_failing_rank_a_bound(monkeypatch):
    """A store whose host stopped answering blocks a call for its timeout (minutes): the post
    and the read give up after POST_S. (The store is a stand-in here: a real one needs a host
    that stops answering without closing its connections, which tests/nodes' killed node is.)"""
    monkeypatch.setattr(peers, "POST_S", 0.2)
    hung = threading.Event()

    class Unanswered:
        def set(self, *_):
            hung.wait()

        def add(self, *_):
            hung.wait()

    try:
        assert not peers.tell_peers(Unanswered(), "ValueError: x", rank=1)
        assert peers.cause_within(Unanswered(), rank=0, world_size=2) is None
    finally:
        hung.set()


# --- the group's timeout: a peer that lives on and answers nothing ---------------------------

@pytest.mark.parametrize(("raw", "seconds"), [("auto", None), (None, None), ("90s", 90.0),
                                               ("10m", 600.0), ("24h", 86400.0), (45, 45.0)])
def test_the_collective_timeout_is_auto_or_a_time_up_to_a_day(raw, seconds):
    assert BY_NAME["collective_timeout"].parse(raw) == seconds


@pytest.mark.parametrize(("raw", "message"), [
    ("0", "collective_timeout must be a time in (0s, 24h], got '0'"),
    ("soon", "collective_timeout must be a time in (0s, 24h], got 'soon'"),
    ("1e300", "collective_timeout must be a time in (0s, 24h], got '1e300'"),
    ("25h", "collective_timeout must be a time in (0s, 24h], got '25h'"),
])
def test_a_bad_collective_timeout_is_one_line(raw, message):
    with pytest.raises(UsageError) as caught:
        BY_NAME["collective_timeout"].parse(raw)
    assert caught.value.message == message


def test_several_nodes_wait_minutes_for_a_peer_not_gloos_half_hour():
    one_node = Membership(rank=0, world_size=2, local_rank=0, node=0, local_world_size=2)
    two_nodes = Membership(rank=0, world_size=2, local_rank=0, node=0, local_world_size=1)
    assert group_timeout(None, one_node) is None  # torch's own
    assert group_timeout(None, two_nodes) == timedelta(seconds=SEVERAL_NODES_TIMEOUT_S)
    assert group_timeout(42.0, one_node) == group_timeout(42.0, two_nodes) == timedelta(
        seconds=42)


def test_a_stalled_peer_stops_the_run_after_the_collective_timeout(tmp_path):
    """Rank 1 stalls mid-training (alive, connected, silent): under sync rank 0 waits in the
    gradient all-reduce for --collective-timeout, not gloo's 30 minutes, and stops with one
    line saying so; the launcher stops the stalled rank with it."""
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "sync", "--collective-timeout",
                   "3s", "--quiet", "--run-dir", str(tmp_path / "run"), str(FAIL), "30", "stall",
                   cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("PeerLost: a collective waited 3 s for a peer that never answered (fdl run "
            "--collective-timeout)") in proc.stderr, proc.stderr[-3000:]
    assert "root cause: rank 0 " in proc.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["engine"]["collective_timeout"] == {"value": 3.0, "source": "flag"}
