"""scripts/sim-elche's simulator runs the engine's own planning code on a virtual clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fdl.engine import plan, policies, simulator, state
from fdl.engine.simulator import profiles, simulate

PAIR = profiles()[0]  # the RTX 5060 Ti + GTX 1060 pair


def test_the_simulator_calls_the_engines_planner_and_bookkeeping(monkeypatch):
    assert simulator.next_round is plan.next_round and simulator.advance is plan.advance
    assert simulator.round_stats is state.round_stats and simulator.RankState is state.RankState
    calls = {"shares": 0, "after_sync": 0}
    shares, after_sync = plan.shares, state.RankState.after_sync

    def counting_shares(**kwargs):
        calls["shares"] += 1
        return shares(**kwargs)

    def counting_after_sync(self, *args, **kwargs):
        calls["after_sync"] += 1
        return after_sync(self, *args, **kwargs)

    monkeypatch.setattr(plan, "shares", counting_shares)
    monkeypatch.setattr(state.RankState, "after_sync", counting_after_sync)
    result = simulate(PAIR, "cadence")
    assert calls["shares"] > 0
    assert calls["after_sync"] == result.averages * len(PAIR.batch_ms)


def test_a_change_to_the_engines_policy_changes_the_simulation(monkeypatch):
    noisy = replace(PAIR, jitter=0.10)
    elastic = simulate(noisy, "cadence")
    monkeypatch.setitem(policies._BY_NAME, "cadence", replace(policies.CADENCE, elastic=False))
    fixed = simulate(noisy, "cadence")
    assert fixed.efficiency < elastic.efficiency - 0.005


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first, again, other = (simulate(PAIR, "async", seed=s) for s in (1, 1, 2))
    assert first == again
    assert other.wall_s != first.wall_s


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_every_sample_of_every_epoch_is_trained_once(policy):
    profile = replace(PAIR, dataset_size=10_007, epochs=2)
    assert simulate(profile, policy).samples == 2 * 10_007


def test_el_che_beats_sync_on_the_pair_it_was_made_for():
    sync, cadence, run_async = (simulate(PAIR, p) for p in ("sync", "cadence", "async"))
    assert sync.efficiency < 0.6 < 0.9 < cadence.efficiency <= run_async.efficiency <= 1.0


def test_the_table_has_a_row_per_profile_and_the_script_prints_it(capsys):
    simulator.main(["--seeds", "1"])
    out = capsys.readouterr().out
    assert out.count("\n") == len(profiles()) + 2
    assert all(p.name in out for p in profiles())
