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


def test_a_change_to_the_engines_policy_changes_the_simulation():
    """The simulator asks the policy object (as the engine's planner does), so cadence with its
    elastic rounds switched off loses what they win under jitter."""
    noisy = replace(PAIR, jitter=0.10)
    elastic = simulate(noisy, policies.CADENCE)
    assert simulate(noisy, "cadence") == elastic  # a name is looked up to the same object
    fixed = simulate(noisy, replace(policies.CADENCE, elastic=False))
    assert fixed.efficiency < elastic.efficiency - 0.005


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first, again, other = (simulate(PAIR, "async", seed=s) for s in (1, 1, 2))
    assert first == again
    assert other.wall_s != first.wall_s


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_every_sample_of_every_epoch_is_trained_once(policy):
    profile = replace(PAIR, dataset_size=10_007, epochs=2)
    assert simulate(profile, policy).samples == 2 * 10_007


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_a_sample_budget_ends_the_simulated_run_mid_epoch(policy):
    whole = replace(PAIR, dataset_size=10_007, epochs=2)
    cut = simulate(replace(whole, max_samples=15_000), policy)
    assert cut.samples == 15_000
    assert cut.wall_s < simulate(whole, policy).wall_s


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_the_outer_optimizers_step_costs_every_rank_its_time_at_each_average(policy):
    """A step of 0 ms changes nothing; a dear one is paid at every average (blocking: after
    the reduce; async: as its average lands), and the anchor tuner sees it."""
    plain = simulate(PAIR, policy)
    assert simulate(replace(PAIR, outer_ms=0.0), policy) == plain
    dear = simulate(replace(PAIR, outer_ms=20.0), policy)
    assert dear.efficiency < plain.efficiency
    assert dear.averages < plain.averages  # booked as the average's cost: longer rounds


def test_el_che_beats_sync_on_the_pair_it_was_made_for():
    sync, cadence, run_async = (simulate(PAIR, p) for p in ("sync", "cadence", "async"))
    assert sync.efficiency < 0.6 < 0.9 < cadence.efficiency <= run_async.efficiency <= 1.0


def test_the_table_has_a_row_per_profile_with_the_simulations_figures(capsys):
    simulator.main(["--seeds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| profile | sync | cadence | async | auto (its pick) | "
                        "anchor (cadence / async) | averages |")
    assert len(lines) == len(profiles()) + 2
    for profile, line in zip(profiles(), lines[2:], strict=True):
        name, *efficiencies, auto, anchors, averages = (cell.strip()
                                                        for cell in line.split("|")[1:-1])
        runs = {policy: simulate(profile, policy, seed=0) for policy in ("sync", "cadence", "async")}
        assert name == profile.name
        assert efficiencies == [f"{run.efficiency:.3f}" for run in runs.values()], name
        picked = simulate(profile, "auto", seed=0)
        assert auto == f"{picked.efficiency:.3f} ({picked.chosen})", name
        assert anchors == f"{runs['cadence'].final_anchor} / {runs['async'].final_anchor}", name
        assert averages == f"{runs['cadence'].averages} / {runs['async'].averages}", name
        sync, cadence, run_async = (float(e) for e in efficiencies)
        assert all(0 < e <= 1 for e in (sync, cadence, run_async)), line
        if len(set(profile.batch_ms)) == 1:  # equal devices: sync is at its best
            assert sync > cadence, name
            continue
        # A gap: lock-step sync runs every rank at the slowest one's pace.
        slowest = profile.batch_size * 1000 / (max(profile.batch_ms) + profile.host_ms)
        assert sync <= len(profile.batch_ms) * slowest / profile.ideal_samples_per_s + 0.001, name
        assert sync < cadence, name


@pytest.mark.parametrize(("name", "pick"), [
    ("5060 Ti + 1060, ResNet-20 (2.6x)", "cadence"), ("ResNet-20, two equal GPUs", "sync"),
    ("GPT-nano 2.8x, WiFi (80 Mbit/s)", "async")])
def test_auto_picks_by_the_engines_rule_and_then_runs_as_its_pick(name, pick):
    """auto: cadence's rounds until the first average after calibration, then its pick; where
    it picks cadence it is cadence's run exactly."""
    profile = next(p for p in profiles() if p.name == name)
    auto = simulate(profile, "auto")
    assert auto.chosen == pick and auto.policy == "auto"
    assert auto.samples == simulate(profile, pick).samples
    if pick == "cadence":
        assert auto.wall_s == simulate(profile, "cadence").wall_s
    else:  # the pick's run, but for the rounds before it chose
        assert abs(auto.efficiency - simulate(profile, pick).efficiency) < 0.03, name
