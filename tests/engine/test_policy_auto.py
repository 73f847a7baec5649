"""``--policy auto``: the rule (pure), the plan's switch, and real 2-worker gloo runs in which
it chooses after calibration, alike on both ranks, and trains on under its choice: cadence for
unequal speeds, async when an average costs too much even at the largest anchor, and sync
(DDP for fdl.Trainer, the gradient all-reduce for a loop) forced through the script's seam,
since equal speeds on 2 shared cores are not reliably within 5%."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_fdl
from test_plan import calibrated, measured, run_round

from fdl.engine.plan import AUTO_AVERAGES, auto_choice, next_round, with_policy
from fdl.engine.policies import (
    ASYNC,
    AUTO,
    CADENCE,
    DDP_EXPOSED,
    SAME_SPEED,
    SYNC,
    choose_policy,
    policy_named,
)
from fdl.rundir.timeline import read_events

# auto chooses from the workers' measured speed and averaging cost:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

SCRIPT = Path(__file__).parent / "scripts" / "auto_policy.py"


def choice(ms, average_ms, *, target=0.02, batch=64, max_anchor=200):
    return choose_policy(ms_per_sample=ms, average_ms=average_ms, batch_size=batch,
                         overhead_target=target, max_anchor=max_anchor)


def test_unequal_speeds_choose_cadence():
    picked = choice([0.01, 0.025], 1.0)
    assert picked.policy is CADENCE and picked.spread == pytest.approx(1.5)
    assert "2.50x" in picked.reason


def test_equal_speeds_and_a_cheap_all_reduce_choose_sync_and_a_dear_one_cadence():
    # a step of the slowest: 64 x 1.05 = 67.2 ms; sync's exposed all-reduce 0.3 x average
    cheap = 0.02 * 64 * (1 + SAME_SPEED) / DDP_EXPOSED  # exactly the target
    assert choice([1.0, 1 + SAME_SPEED], cheap).policy is SYNC
    assert choice([1.0, 1 + SAME_SPEED], cheap * 1.01).policy is CADENCE
    assert choice([1.0, 1 + 2 * SAME_SPEED], cheap / 10).policy is CADENCE


def test_an_average_dearer_than_the_target_at_the_largest_anchor_chooses_async():
    # 200 steps of 6.4 ms: an average above 2% of 1280 ms (25.6 ms) is a slow link
    assert choice([0.05, 0.1], 25.6).policy is CADENCE
    slow = choice([0.05, 0.1], 26.0)
    assert slow.policy is ASYNC and slow.overhead_at_max_anchor > 0.02
    assert choice([0.1, 0.1], 26.0).policy is ASYNC  # equal speeds too


@pytest.mark.parametrize(("ms", "average"), [([], 1.0), ([0.1, math.nan], 1.0),
                                             ([0.1, 0.0], 1.0), ([0.1], math.inf),
                                             ([0.1], -1.0)])
def test_unusable_figures_are_refused(ms, average):
    with pytest.raises(ValueError):
        choice(ms, average)


def test_auto_is_cadence_until_it_chooses_and_the_plan_follows_the_choice():
    assert policy_named("auto") is AUTO and AUTO.decides and AUTO.local_steps
    state = calibrated(0.4, 1.0, policy="auto")
    state = state.__class__(**{**state.__dict__, "anchor": 12})
    plan = next_round(state)
    assert plan.elastic is not None  # cadence's elastic rounds while it is auto
    to_sync = with_policy(state, "sync", reason="policy auto: sync")
    assert to_sync.config.policy is SYNC and to_sync.anchor == 1
    assert to_sync.anchor_history[-1][1:] == (1, "policy auto: sync")
    assert next_round(to_sync).slices[0].steps == next_round(to_sync).slices[1].steps == 1
    to_async = with_policy(state, ASYNC, reason="policy auto: async")
    assert to_async.anchor == 12 and to_async.anchor_history == state.anchor_history


@pytest.mark.parametrize(("costs", "chosen"), [((1.0,), CADENCE), ((5000.0, 1.0), CADENCE),
                                                ((6000.0, 5000.0, 7000.0), ASYNC)])
def test_a_slow_link_takes_every_one_of_the_first_averages_being_dear(costs, chosen):
    """One average that a busy host slowed is no slow link: the cheapest average measured is the
    link's cost, and async waits until AUTO_AVERAGES of them were all too dear; one cheap
    enough decides at once."""
    state = calibrated(0.4, 1.0, policy="auto")
    for cost in costs:
        assert auto_choice(state) is None
        state = run_round(state, measured(0.4, 1.0, sync_ms=cost))
    picked = auto_choice(state)
    assert picked.policy is chosen and picked.average_ms == min(costs)
    assert len(costs) == AUTO_AVERAGES or chosen is not ASYNC


def auto_run(tmp_path: Path, name: str, *flags: str, script_args: tuple[str, ...] = (),
             env: dict[str, str] | None = None) -> tuple[Path, list[dict]]:
    out, run_dir = tmp_path / f"out-{name}", tmp_path / name
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "auto", "--run-dir",
                   str(run_dir), *flags, str(SCRIPT), str(out), *script_args, cwd=tmp_path,
                   env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    for key in first:  # the consensus model, identical on both ranks
        assert torch.equal(first[key], second[key]), key
    assert "policy auto: " in proc.stdout + proc.stderr
    return run_dir, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def policy_events(run_dir: Path) -> list[dict]:
    events = [[e for e in read_events(run_dir, r) if e["kind"] == "policy"] for r in (0, 1)]
    assert len(events[0]) == len(events[1]) == 1  # chosen once, at the same round
    assert events[0][0]["round"] == events[1][0]["round"] >= 1
    assert events[0][0]["chosen"] == events[1][0]["chosen"]
    return events[0]


def test_unequal_workers_choose_cadence_and_train_on(tmp_path):
    run_dir, summaries = auto_run(tmp_path, "cadence", "--simulate-slowdown", "1,2.5",
                                  script_args=("--samples", "4096"))
    event = policy_events(run_dir)[0]
    assert event["chosen"] == "cadence" and event["speed_spread"] > 0.5
    assert summaries[0]["policy"] == "cadence"
    assert summaries[0]["policy_choice"]["chosen"] == "cadence"


def test_an_average_too_dear_for_any_anchor_chooses_async_in_a_loop(tmp_path):
    """An overhead target of 1e-6: no anchor makes an average that cheap, so async; after the
    choice the averages mid-epoch run in the background."""
    env = clean_env({"FDL_OVERHEAD_TARGET": "0.000001"})
    run_dir, summaries = auto_run(tmp_path, "async", "--simulate-slowdown", "1,2",
                                  script_args=("--loop", "--samples", "56000"), env=env)
    event = policy_events(run_dir)[0]
    assert event["chosen"] == "async" and event["overhead_at_max_anchor"] > 1e-6
    assert summaries[0]["policy"] == "async"
    after = [e for e in read_events(run_dir, 0)
             if e["kind"] == "sync" and e["round"] > event["round"]]
    assert any(not e["blocking"] for e in after)
    assert not any(not e["blocking"] for e in read_events(run_dir, 0)
                   if e["kind"] == "sync" and e["round"] <= event["round"])


def test_a_run_that_ends_before_auto_can_call_its_link_slow_trains_as_cadence(tmp_path):
    """Every average too dear (an overhead target of 1e-6) and too few of them to tell a slow
    link from a busy host: no choice, and the summary says the run was cadence and why."""
    env = clean_env({"FDL_OVERHEAD_TARGET": "0.000001"})
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "auto", "--run-dir",
                   str(run_dir), "--simulate-slowdown", "1,2", str(SCRIPT), str(out), "--loop",
                   "--samples", "256", cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not [e for e in read_events(run_dir, 0) if e["kind"] == "policy"]
    summary = json.loads((out / "rank0.json").read_text())
    assert summary["policy"] == "cadence"
    assert summary["policy_choice"]["reason"].startswith("the run ended before auto chose")
    assert json.loads((run_dir / "summary.json").read_text())["policy"] == "cadence"


@pytest.mark.parametrize("loop", [False, True], ids=["trainer-ddp", "loop-grad-sync"])
def test_a_choice_of_sync_trains_on_through_the_gradient_all_reduce(tmp_path, loop):
    """Forced to sync (the script's seam): from the next round on, one step per rank per round
    with the gradients all-reduced (DDP's comm hook under emulation in the Trainer, the
    optimizer's pre-step all-reduce in a loop: both time it), averages only at epoch ends."""
    run_dir, summaries = auto_run(tmp_path, "sync", "--simulate-slowdown", "1,2",
                                  script_args=("--force", "sync", *(("--loop",) if loop else ())))
    event = policy_events(run_dir)[0]
    assert event["chosen"] == "sync" and summaries[0]["policy"] == "sync"
    assert all(seconds > 0 for seconds in summaries[0]["ddp_comm_s"])
    for rank in (0, 1):
        rounds = [e for e in read_events(run_dir, rank)
                  if e["kind"] == "round" and e["round"] > event["round"]]
        # one step a round; a rank without data in an epoch's sliver joins DDP's all-reduce
        assert rounds and all(e["steps"] in (0, 1) for e in rounds)
        assert sum(e["steps"] for e in rounds) >= len(rounds) - 2
        syncs = [e for e in read_events(run_dir, rank)
                 if e["kind"] == "sync" and e["round"] > event["round"]]
        epoch_ends = [e for e in read_events(run_dir, rank) if e["kind"] == "epoch"]
        assert len(syncs) <= len(epoch_ends)


def test_a_single_worker_under_auto_is_cadence_and_says_why(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--loop"], cwd=tmp_path,
                          env=clean_env({"FDL_POLICY": "auto"}), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "rank0.json").read_text())
    assert summary["policy"] == "cadence"
    assert summary["policy_choice"]["reason"].startswith("one worker")
