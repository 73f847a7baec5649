"""The elastic signal: the fast rank does not ask the store whether the slowest rank is done
before the slowest rank's estimated time is mostly over (a fake store and a fake clock: the
quiet period is arithmetic on the clock's readings, no time passes)."""

from __future__ import annotations

from types import SimpleNamespace

import fdl.engine.round_messages as messages
from fdl.engine.round_messages import QUIET_SHARE, ElasticSignal


class Store:
    def __init__(self):
        self.checks = 0
        self.done = True

    def check(self, keys):
        self.checks += 1
        return self.done


def open_signal(monkeypatch, readings, *, slowest_s, rank=0):
    clock = iter(readings)
    monkeypatch.setattr(messages.time, "perf_counter", lambda: next(clock))
    store = Store()
    monkeypatch.setattr(messages, "_required_store", lambda: store)
    plan = SimpleNamespace(elastic=0, round_index=3, signal_from=1)
    return ElasticSignal.open(plan, rank=rank, slowest_s=slowest_s), store, plan


def test_no_check_before_the_slowest_rank_can_be_done(monkeypatch):
    quiet = QUIET_SHARE * 2.0
    signal, store, plan = open_signal(monkeypatch, [10.0, 10.5, 10.0 + quiet - 0.01,
                                                    10.0 + quiet + 0.01], slowest_s=2.0)
    assert not signal.arrived(plan) and not signal.arrived(plan)
    assert store.checks == 0  # no round trip while the slowest rank cannot be done
    assert signal.arrived(plan) and store.checks == 1


def test_without_an_estimate_the_fast_rank_checks_from_its_first_step(monkeypatch):
    signal, store, plan = open_signal(monkeypatch, [10.0, 10.0], slowest_s=0.0)
    assert signal.arrived(plan) and store.checks == 1


def test_a_rank_that_sends_never_checks(monkeypatch):
    signal, store, plan = open_signal(monkeypatch, [10.0, 20.0], slowest_s=0.0, rank=1)
    assert not signal.arrived(plan) and store.checks == 0
