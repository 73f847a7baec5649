"""The elastic signal over a real TCPStore on loopback: the fast rank learns that the slowest
one is done from a watch thread, without a store round trip between its steps, and a watch
that fails raises in the training thread instead of hanging it."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import PrefixStore, TCPStore

import fdl.engine.round_messages as messages
from fdl.engine.round_messages import ElasticSignal


class CountingStore:
    """A store that counts the calls the training thread makes on it (the watch thread has its
    own clone)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return getattr(self.store, name)(*args)
        return call

    def clone(self):
        return self.store.clone()


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                     wait_for_workers=False)
    yield store


def open_pair(monkeypatch, server, round_index=3):
    """The fast rank's signal (rank 0, on a counting client) and the slowest's (rank 1)."""
    fast_store = CountingStore(PrefixStore("run/", TCPStore(
        "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=60))))
    slow_store = PrefixStore("run/", TCPStore("127.0.0.1", server.port, None, False,
                                              timeout=timedelta(seconds=60)))
    plan = SimpleNamespace(elastic=0, round_index=round_index, signal_from=1)
    monkeypatch.setattr(messages, "_required_store", lambda: fast_store)
    fast = ElasticSignal.open(plan, rank=0)
    monkeypatch.setattr(messages, "_required_store", lambda: slow_store)
    slow = ElasticSignal.open(plan, rank=1)
    return fast, slow, plan, fast_store


def test_the_fast_rank_learns_done_without_asking_the_store(monkeypatch, server):
    fast, slow, plan, fast_store = open_pair(monkeypatch, server)
    for _ in range(1000):  # a thousand steps before the slowest rank is done
        assert not fast.arrived(plan)
    assert fast_store.calls == []  # not one round trip from the training thread
    used: list[int | None] = []
    reader = threading.Thread(target=lambda: used.append(slow.close(plan, rank=1, used=0)))
    reader.start()  # posts done, then waits for what the fast rank used
    assert fast.watch is not None and fast.watch.done.wait(timeout=60)
    assert fast.arrived(plan)
    assert fast.close(plan, rank=0, used=130) == 130
    reader.join(timeout=60)
    assert used == [130]
    assert not server.check(["run/fdl/elastic/0/done/3"])  # cleaned up for the next round


def test_a_failed_watch_raises_in_the_training_thread(monkeypatch, server):
    short = PrefixStore("run/", TCPStore("127.0.0.1", server.port, None, False,
                                         timeout=timedelta(seconds=60)))
    short.set_timeout(timedelta(milliseconds=200))  # the slowest rank never posts
    monkeypatch.setattr(messages, "_required_store", lambda: short)
    plan = SimpleNamespace(elastic=0, round_index=4, signal_from=1)
    fast = ElasticSignal.open(plan, rank=0)
    assert fast.watch is not None and fast.watch.done.wait(timeout=60)
    assert fast.arrived(plan)  # the round stops at once instead of training on
    with pytest.raises(Exception, match=r"(?i)timeout|wait"):
        fast.close(plan, rank=0, used=10)


def test_a_round_without_an_elastic_rank_sends_nothing(monkeypatch):
    monkeypatch.setattr(messages, "_required_store", lambda: pytest.fail("no store needed"))
    plan = SimpleNamespace(elastic=None, round_index=1, signal_from=None)
    signal = ElasticSignal.open(plan, rank=0)
    assert not signal.arrived(plan) and signal.close(plan, rank=0, used=5) is None


def test_a_group_destroyed_mid_run_is_named_not_a_runtime_error():
    """The script called destroy_process_group() in a step: "RuntimeError: an elastic round or
    a pool needs the process group's store" said nothing of what happened."""
    import torch.distributed as dist

    from fdl.errors import UsageError

    assert not dist.is_initialized()  # as after the script destroyed it
    with pytest.raises(UsageError, match=r"destroy_process_group\(\) before run.finish") as gone:
        messages._required_store()
    assert "run.finish() destroys it" in gone.value.hint
