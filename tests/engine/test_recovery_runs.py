"""Crash and resume with real processes: `fdl run` with 2 gloo workers, one SIGKILLed mid-run.

The killed run restarts (--max-restarts 1), resumes from its last checkpoint and must end
within 1 accuracy point of the same run left alone; its timeline shows the restart. A finished
run resumed with one worker fewer and more epochs continues where its checkpoint left off.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import clean_env, run_fdl, wait_until
from trace_checks import check_against, check_format, load_strict

from fdl.rundir.timeline import read_events

SCRIPTS = Path(__file__).parent / "scripts"
FLAGS = ("--nproc-per-node", "2", "--checkpoint-every", "1", "--max-restarts", "1",
         "--simulate-slowdown", "1,2", "--quiet-ranks")
NUM_SAMPLES = "16384"


def command(run_dir: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "fdl", "run", "--run-dir", str(run_dir), *flags,
            str(SCRIPTS / "recovery_train.py"), str(out), NUM_SAMPLES]


def kill_rank_when_checkpointed(proc: subprocess.Popen, run_dir: Path, rank: str) -> int:
    """SIGKILL worker ``rank`` as soon as the first checkpoint is in place; its pid."""
    wait_until(lambda: list((run_dir / "checkpoints").glob("ckpt-r*")), "the first checkpoint",
               proc=proc)
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "fdl.launch.worker" in child.cmdline() and child.environ().get("RANK") == rank:
                child.send_signal(signal.SIGKILL)
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError("worker not found")


def test_sigkilled_worker_restarts_from_checkpoint_and_matches(tmp_path):
    steady_out, crash_out = tmp_path / "steady", tmp_path / "crash"
    steady_out.mkdir()
    crash_out.mkdir()
    steady = subprocess.run(command(tmp_path / "steady-run", steady_out, *FLAGS),
                            capture_output=True, text=True, env=clean_env(), timeout=240)
    assert steady.returncode == 0, steady.stdout[-2000:] + steady.stderr[-2000:]

    run_dir = tmp_path / "crash-run"
    proc = subprocess.Popen(command(run_dir, crash_out, *FLAGS), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=clean_env())
    kill_rank_when_checkpointed(proc, run_dir, rank="1")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    assert "resuming from" in output

    steady = json.loads((steady_out / "rank0.json").read_text())
    steady_acc = steady["metrics"]["accuracy"]
    crash = json.loads((crash_out / "rank0.json").read_text())
    # The schedule had scaled the LR in the checkpoint's optimizer state (by 0.775 at epoch 1):
    # it is not applied twice. (The last step's progress, so its LR, differs between two runs
    # by what the elastic rounds took: under 0.2% here.)
    assert crash["lrs"] == pytest.approx(steady["lrs"], rel=0.01) and steady["lrs"][0] < 0.011
    assert abs(crash["metrics"]["accuracy"] - steady_acc) <= 0.01
    assert [r["epoch"] for r in crash["history"]] == [1, 2, 3, 4]
    assert crash["summary"]["attempt"] == 1 and crash["summary"]["resumed_from"]

    starts = [e for e in read_events(run_dir, 1) if e["kind"] == "start"]
    assert [e["attempt"] for e in starts] == [0, 1]
    assert starts[0]["resumed_from"] is None and starts[1]["resumed_from"].startswith("ckpt-r")
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [1, 2, 3, 4]
    merged = json.loads((run_dir / "timeline" / "timeline.json").read_text())
    assert sum(e["kind"] == "start" for e in merged["events"]) == 4  # 2 ranks x 2 attempts
    trace = load_strict(run_dir / "timeline" / "trace.json")  # the same run for Perfetto
    check_format(trace)
    check_against(trace, merged)
    instants = {e["name"] for e in trace["traceEvents"] if e["ph"] == "i"}
    assert {"start", "restart", "checkpoint", "epoch end", "final"} <= instants


def test_resume_with_one_worker_fewer_and_more_epochs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    first = run_fdl("run", "--run-dir", str(run_dir), "--nproc-per-node", "2", "--epochs", "2",
                    "--checkpoint-every", "1", str(SCRIPTS / "recovery_train.py"), str(out),
                    "2048", cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    # the last epoch takes no checkpoint (model.pt is the result): epoch 1 is the newest
    again = run_fdl("run", "--resume", str(run_dir), "--nproc-per-node", "1", "--epochs", "3",
                    cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    starts = [e for e in read_events(run_dir, 0) if e["kind"] == "start"]
    assert starts[-1]["world_size"] == 1 and starts[-1]["epoch"] == 1
    assert starts[-1]["resumed_from"] is not None
    result = json.loads((out / "rank0.json").read_text())
    assert [r["epoch"] for r in result["history"]] == [1, 2, 3]
    assert result["summary"]["world_size"] == 1 and result["metrics"]["accuracy"] > 0.9
    config = json.loads((run_dir / "config.json").read_text())
    assert config["settings"]["checkpoint_every"]["value"] == "1"  # reapplied from the run
