"""El Che end to end: `fdl run` with 2 real gloo workers on loopback, one emulated 2.5x slower.

Checks the contracts: sync equals plain torch DDP, and its all-reduce is booked as sync, not as
the compute the emulation multiplies; replicas are bitwise identical after every blocking
average and at the end; the planner gives the fast rank the larger share; summary.json has
every field; the launcher's flags beat the script's values, which beat defaults. (The
divergence guard acting on a real run: test_divergence_run.py; the trainer's correctness
fixes: test_trainer_fixes.py.) One test compares measured speed with plain DDP's: it is marked
``timing`` and runs only when asked (``-m timing``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_fdl

from fdl.rundir.report import run_report
from fdl.rundir.timeline import read_events
from fdl.rundir.timeline_merge import merge_timeline

# the plan's shares and the policies' rounds follow the workers' measured speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

SCRIPTS = Path(__file__).parent / "scripts"
EXAMPLES = Path(__file__).parents[2] / "examples"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def fdl_train(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> tuple[Path, Path]:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir(exist_ok=True)
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), *flags,
                   str(SCRIPTS / "elche_train.py"), str(out), *script_args, cwd=tmp_path,
                   env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fdl report:" in proc.stdout and "efficiency" in proc.stdout  # printed at the end
    return out, run_dir


def planned_samples(run_dir: Path) -> list[int]:
    """Each rank's samples in the plans of the rounds after calibration (round 0), as the
    rounds' events record them: what the planner decided, not what a clock measured."""
    return [sum(e["planned"] for e in read_events(run_dir, rank)
                if e["kind"] == "round" and e["round"] > 0) for rank in (0, 1)]


def test_sync_equals_plain_torch_ddp(tmp_path):
    """Also emulated at 1,2.5, which changes nothing but time: the model still equals plain
    DDP's, and DDP's all-reduce is booked as sync (the fast rank's wait for the slow one
    happens there), never as compute for the emulation to multiply."""
    out, run_dir = fdl_train(tmp_path, "--policy", "sync", "--simulate-slowdown", "1,2.5")
    check_ddp_communication_is_sync(run_dir)
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "ddp_reference.py"), str(ref)], capture_output=True,
                          text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = torch.load(out / "rank0.pt"), torch.load(ref / "rank0.pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6, rtol=0), name
    # and training moved them: the comparison is not between two untouched inits
    torch.manual_seed(7)
    sys.path.insert(0, str(SCRIPTS))
    from common import build_model

    init = build_model().state_dict()
    assert any(not torch.allclose(init[n], ours[n]) for n in ours)


def check_ddp_communication_is_sync(run_dir: Path) -> None:
    """Every step's time in DDP's all-reduce (comm_s) is in the rounds' events, outside their
    busy time, drawn as sync spans of those rounds and counted as sync by fdl report; the slow
    rank's emulated sleep follows its compute alone (1.5x at 2.5x over the run's second half,
    once the first, slower steps have left the 15 steps the sleep follows: 1.61-1.71 measured,
    let up to 2; sleeping on compute and all-reduce gave ~5x here), is drawn as its own span
    kind, and the fast rank never sleeps."""
    rounds = [[e for e in read_events(run_dir, rank) if e["kind"] == "round"] for rank in (0, 1)]
    for events in rounds:
        assert sum(e["comm_s"] for e in events) > 0
        assert all(e["busy_s"] + e["comm_s"] <= e["compute_s"] + 1e-6 for e in events)
    assert all(e["sleep_s"] == 0 for e in rounds[0])
    steady = rounds[1][len(rounds[1]) // 2:]  # sync: one step a round
    slept = sum(e["sleep_s"] for e in steady)
    computed = sum(e["busy_s"] - e["sleep_s"] for e in steady)
    assert 1.2 <= slept / computed <= 2.0, (slept, computed)
    spans = merge_timeline(run_dir)["spans"]
    numbered = {(e["rank"], e["round"]) for events in rounds for e in events}
    ddp_sync = {s["rank"] for s in spans if s["kind"] == "sync" and (s["rank"], s["round"])
                in numbered and s["end"] > s["start"]}
    assert ddp_sync == {0, 1}
    assert {s["rank"] for s in spans if s["kind"] == "emulated"} == {1}
    report = run_report(run_dir)
    for rank, events in zip(report["ranks"], rounds, strict=True):
        assert rank["time_s"]["sync_wait"] >= sum(e["comm_s"] for e in events)
    assert report["ranks"][1]["time_s"]["emulated"] > 0 == report["ranks"][0]["time_s"]["emulated"]


@pytest.mark.parametrize(("policy", "average_dtype", "outer"), [
    ("cadence", "fp32", "none"), ("async", "fp32", "none"), ("cadence", "bf16", "none"),
    ("async", "bf16", "none"), ("cadence", "fp32", "nesterov"), ("async", "bf16", "nesterov"),
    ("async", "int8", "none")])
def test_replicas_are_bitwise_identical_after_every_average(tmp_path, policy, average_dtype,
                                                            outer):
    """bf16 and int8 on the wire too: every rank lands the same float32 sum of the gathered
    displacements on the same reference; and with the outer optimizer, whose step every rank
    takes on the same bits."""
    _, run_dir = fdl_train(tmp_path, "--policy", policy, "--simulate-slowdown", "1,2.5",
                           "--epochs", "6", "--average-dtype", average_dtype,
                           "--outer-optimizer", outer,
                           script_args=("--batch-norm",), env={"FDL_VERIFY_REPLICAS": "1"})
    events = [read_events(run_dir, r) for r in (0, 1)]
    summary = json.loads((run_dir / "summary.json").read_text())
    syncs = sum(e["kind"] == "sync" for e in events[0])
    assert summary["outer_optimizer"]["name"] == outer
    assert summary["outer_optimizer"]["steps"] == (syncs if outer != "none" else 0)
    checks = [[(e["round"], e["checksum"]) for e in ev if e["kind"] == "sync" and
               "checksum" in e] for ev in events]
    assert checks[0] == checks[1]
    epochs = [[e["checksum"] for e in ev if e["kind"] == "epoch"] for ev in events]
    assert len(epochs[0]) == 6 and epochs[0] == epochs[1]  # each epoch ends on one model
    ends = [max(e["round"] for e in events[0] if e["kind"] == "round" and e["epoch"] == epoch)
            for epoch in range(6)]
    blocking = {e["round"]: e["blocking"] for e in events[0] if e["kind"] == "sync"}
    if policy == "cadence":  # every round blocks (and checks)
        assert len(checks[0]) >= 6 and all(blocking.values())
    else:  # async runs through the epoch ends: it blocks at calibration and the last round
        assert [blocking[r] for r in ends] == [False] * 5 + [True]
        assert len(checks[0]) >= 2
    finals = [next(e["checksum"] for e in ev if e["kind"] == "final") for ev in events]
    assert finals[0] == finals[1]
    # the planner gave the fast rank the larger share
    planned = planned_samples(run_dir)
    assert planned[0] > 1.5 * planned[1], planned


def test_an_epoch_end_that_waited_for_asyncs_average_is_not_booked_as_the_average(tmp_path):
    """async runs through epoch ends: the epoch's evaluation runs at the next boundary, when
    the epoch's average lands. An evaluation made slow (each batch sleeps 0.1 s: the workload)
    must not be booked as that average's time, or the anchor tuner grows the rounds for it: no
    average's wait comes near one evaluation, which the run itself timed (summary eval_s)."""
    _, run_dir = fdl_train(tmp_path, "--policy", "async", "--simulate-slowdown", "1,2.5",
                           "--epochs", "4", script_args=("--slow-eval", "0.1"))
    summary = json.loads((run_dir / "summary.json").read_text())
    one_evaluation = summary["eval_s"] / 4
    assert one_evaluation > 0.2  # 4-5 batches of 0.1 s on rank 0
    waits = [e["wait_s"] for e in read_events(run_dir, 0) if e["kind"] == "sync"]
    assert waits and max(waits) < one_evaluation / 2, (max(waits), one_evaluation)


def test_sync_replicas_identical_including_batchnorm_buffers(tmp_path):
    out, _ = fdl_train(tmp_path, "--policy", "sync", script_args=("--batch-norm",))
    a, b = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_process_group_is_gone_when_the_trainer_returns(tmp_path):
    """No gloo thread outlives fit(): the group is really destroyed, not left to the
    interpreter's teardown (where a worker used to abort now and then, SIGABRT). The Trainer
    makes its optimizer after the group exists, which imports torch._dynamo and with it the
    module that used to keep the group referenced. Under sync, with DDP's wrapper (the loop
    tests check cadence, async and a loop's sync)."""
    out, _ = fdl_train(tmp_path, "--policy", "sync")
    for rank in (0, 1):
        threads = json.loads((out / f"rank{rank}.json").read_text())["threads_after_finish"]
        assert not [name for name in threads if "gloo" in name], threads


def test_summary_has_every_contract_field_and_metrics(tmp_path):
    out, run_dir = fdl_train(tmp_path, "--policy", "async", "--simulate-slowdown", "1,2.5")
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("policy", "backend", "world_size", "devices", "emulated_slowdown", "epochs",
                "samples", "wall_s", "throughput", "sync", "idle_fraction", "eval",
                "final_loss"):
        assert key in summary, key
    assert summary["policy"] == "async" and summary["backend"] == "cpu"
    assert summary["world_size"] == 2 and len(summary["devices"]) == 2
    assert summary["emulated_slowdown"] == [1.0, 2.5]
    assert summary["samples"] == 2 * 1024
    assert set(summary["throughput"]) == {"samples_per_s", "per_rank_samples_per_s"}
    assert len(summary["throughput"]["per_rank_samples_per_s"]) == 2
    assert summary["emulated_sleep_s"][0] == 0 < summary["emulated_sleep_s"][1]
    for rank in (0, 1):  # the data wait of the run: its rounds' in the rank's timeline
        rounds = [e for e in read_events(run_dir, rank) if e["kind"] == "round"]
        assert summary["data_wait_s"][rank] == pytest.approx(sum(e["data_s"] for e in rounds))
        assert 0 < summary["data_wait_s"][rank] < summary["wall_s"]
    # async keeps a snapshot beside the flat buffer: fdl's memory, on the host under gloo
    assert [m["device"] for m in summary["fdl_memory_bytes"]] == [0, 0]
    assert summary["fdl_memory_bytes"][0]["host"] > 2 * 4 * sum(
        t.numel() for t in torch.load(out / "rank0.pt").values())
    assert summary["micro_batch_size"] == [32, 32] and summary["peak_memory_bytes"] == [None] * 2
    planned = planned_samples(run_dir)
    rounds = {rank: [(e["round"], e["planned"], e["steps"], round(e["step_ms"], 2))
                     for e in read_events(run_dir, rank) if e["kind"] == "round"]
              for rank in (0, 1)}  # (round, planned, steps, ms a step): what the planner saw
    assert planned[0] > 1.5 * planned[1], (planned, rounds)  # rank 1 seen as the slow one
    assert set(summary["sync"]) == {"rounds", "mean_ms", "overhead"}
    assert summary["sync"]["rounds"] >= 2
    assert 0.5 <= summary["eval"]["accuracy"] <= 1.0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    assert (run_dir / "model.pt").is_file()
    result = json.loads((out / "rank0.json").read_text())
    assert result["metrics"] == summary["eval"]
    assert len(result["history"]) == 2


def test_launcher_flag_beats_script_value_beats_default(tmp_path):
    _, run_dir = fdl_train(tmp_path, "--policy", "cadence", script_args=("--policy", "sync"))
    engine = json.loads((run_dir / "config.json").read_text())["engine"]
    assert engine["policy"] == {"value": "cadence", "source": "flag"}
    assert engine["seed"] == {"value": 7, "source": "script"}
    assert engine["backend"] == {"value": "auto", "source": "default"}
    assert engine["resolved_backend"] == "cpu"



@pytest.mark.timing
def test_sync_at_1_2_5_runs_as_fast_as_plain_ddp_slept_on_compute_only(tmp_path):
    """fdl sync with --simulate-slowdown 1,2.5 against examples/ddp_plain.py --slowdown 1,2.5
    (plain torch DDP, each rank sleeping (f - 1) x each step's time less its all-reduce): within
    10 % of each other, the median of 3 back-to-back pairs, on the bench's MLP at a width whose
    all-reduce (1.2 MB) takes a good part of a step, as fdl init's MLP's does. Measured on the
    2-core VM: 1.00-1.06 (0.76-0.92 before the fix, which also slept 1.5x the all-reduce)."""
    task = ["--hidden", "512", "--train-samples", "4096", "--epochs", "2", "--batch-size", "64"]
    path = [str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    fdl_rates, ddp_rates = [], []
    for attempt in range(3):
        ref = tmp_path / f"ddp{attempt}.json"
        proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                               str(EXAMPLES / "ddp_plain.py"), str(ref), "--slowdown", "1,2.5",
                               *task], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                              env=clean_env(env))
        assert proc.returncode == 0, proc.stderr[-3000:]
        ddp_rates.append(json.loads(ref.read_text())["samples_per_s"])
        run_dir = tmp_path / f"fdl{attempt}"
        proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "sync",
                       "--simulate-slowdown", "1,2.5", "--run-dir", str(run_dir),
                       str(EXAMPLES / "mlp_synthetic.py"), *task, cwd=tmp_path, env=env,
                       timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        fdl_rates.append(summary["throughput"]["samples_per_s"])
    ratio = statistics.median(f / d for f, d in zip(fdl_rates, ddp_rates, strict=True))
    assert 0.9 <= ratio <= 1.1, (fdl_rates, ddp_rates)
