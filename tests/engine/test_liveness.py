"""fdl.engine.liveness on a real TCPStore: a rank whose counter stops is named after SILENT_S,
a rank that ticks never is, and a wait for a key ends the moment it is set (the multi-node
test kills a namespace node for real: tests/nodes)."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import clean_env

import fdl.engine.liveness as liveness_module
from fdl.engine.liveness import SILENT_S, Liveness, PeerGone, wait_alive, wait_for


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))


def test_a_rank_whose_counter_stops_is_named_after_the_silence(store):
    key = "fdl/alive/0/"
    alive = Liveness(store, rank=0, world_size=2, key=key)  # not started: ticks by hand
    store.add(f"{key}1", 1)
    assert alive.silent(store, now=0.0) is None  # first look
    assert alive.silent(store, now=SILENT_S - 0.1) is None
    store.add(f"{key}1", 1)  # rank 1 ticked: its silence starts again
    assert alive.silent(store, now=SILENT_S + 1) is None
    assert alive.silent(store, now=2 * SILENT_S + 0.5) is None
    assert alive.silent(store, now=2 * SILENT_S + 1) == 1


def test_a_wait_ends_when_the_key_is_set_or_a_peer_is_gone(store, monkeypatch):
    alive = Liveness(store, rank=0, world_size=2, key="fdl/alive/0/")
    threading.Timer(0.2, lambda: store.set("k", "1")).start()
    wait_for(store, "k", alive=alive, waiting_for="k")  # returns: the key came
    assert store.get("k") == b"1"
    monkeypatch.setattr(Liveness, "silent", lambda self, reader, now=None: 1)  # rank 1 silent
    with pytest.raises(PeerGone, match=r"rank 1 stopped answering .* waited for the report"):
        wait_alive(threading.Event(), store, alive=alive, waiting_for="the report")


def test_a_wait_past_the_collective_timeout_says_so_not_the_store_s_error():
    """A rank suspended (SIGSTOP) under --collective-timeout 5s: the others' wait ended with
    "DistStoreError: wait timeout after 5000ms, keys: /default_pg/0//fdl/elastic/0/done/14".
    The store's timeout is the wait's (here 0.5 s; the silence check needs far longer)."""
    short = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=0.5))
    alive = Liveness(short, rank=0, world_size=2, key="fdl/alive/0/")
    with pytest.raises(PeerGone) as gave_up:
        wait_for(short, "fdl/elastic/0/done/14", alive=alive, waiting_for="round 14's end")
    assert gave_up.value.message == (
        "the run gave up waiting for round 14's end: nothing came within the collective timeout "
        "(0.5 s, --collective-timeout) (a rank stopped, suspended or far slower than the others)")
    assert "DistStoreError" not in gave_up.value.message


def test_stopping_waits_for_the_ticking_thread_and_a_new_run_ticks_again(store, monkeypatch):
    """A run's end stops its ticking thread and waits for it (a thread left inside a store
    call aborts the worker at the interpreter's exit: tests/engine/test_loop.py)."""
    monkeypatch.setattr(liveness_module, "BEAT_S", 0.001)  # a tick nearly always in flight
    first = liveness_module.liveness(store)
    assert first.thread is not None and first.thread.is_alive()
    assert liveness_module.stop_ticking() is True
    assert not first.thread.is_alive()
    second = liveness_module.liveness(store)  # fdl.init again in the same process
    assert second is not first and second.thread.is_alive()
    assert liveness_module.stop_ticking() is True


def test_a_process_that_exits_without_stopping_the_ticks_exits_cleanly(tmp_path):
    """A script under torchrun that leaves without run.finish(): the ticking thread is stopped
    at exit (atexit), not left inside a store call as the interpreter shuts down (SIGABRT)."""
    script = tmp_path / "ticks.py"
    script.write_text(
        "from datetime import timedelta\n"
        "import threading\n"
        "import torch.distributed as dist\n"
        "import fdl.engine.liveness as liveness\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=timedelta(seconds=30))\n"
        "liveness.BEAT_S = 0.0\n"
        "ticking = liveness.liveness(store)\n"
        "seen = threading.Event()\n"
        "while store.add(f'{ticking.key}0', 0) < 50:\n"
        "    seen.wait(0.001)\n")
    for _ in range(3):  # without the stop at exit, every run aborted (20 of 20)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=60, env=clean_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
