"""Crash and resume with real processes: `fdl run` with 2 gloo workers, one SIGKILLed mid-run.

The killed run restarts (--max-restarts 1), resumes from the checkpoint it wrote last, at that
checkpoint's position, keeps the history of the epochs before it and learns the task; its
timeline shows the restart. A finished run resumed with one worker fewer and more epochs
continues where its checkpoint left off.

The killed run is not compared with the same run left alone: both plan their rounds from
measured speeds, so two runs differ in their last digits by design, and a bar on the
difference asserted the machine's timing as much as the resume.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from helpers import clean_env, run_fdl, started, wait_until
from trace_checks import check_against, check_format, load_strict

from fdl.rundir.timeline import read_events

# a schedule's last step and the elastic rounds follow the workers' measured speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

SCRIPTS = Path(__file__).parent / "scripts"
FLAGS = ("--nproc-per-node", "2", "--checkpoint-every", "1", "--max-restarts", "1",
         "--simulate-slowdown", "1,2", "--quiet-ranks")
NUM_SAMPLES = "16384"


def command(run_dir: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "fdl", "run", "--run-dir", str(run_dir), *flags,
            str(SCRIPTS / "recovery_train.py"), str(out), NUM_SAMPLES]


def kill_rank_when_checkpointed(proc: subprocess.Popen, run_dir: Path, rank: str) -> int:
    """SIGKILL worker ``rank`` as soon as rank 0 has logged its first checkpoint (the event
    follows the checkpoint's rename into place); its pid."""
    wait_until(lambda: any(e["kind"] == "checkpoint" for e in read_events(run_dir, 0)),
               "the first checkpoint", proc=proc)
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "fdl.launch.worker" in child.cmdline() and child.environ().get("RANK") == rank:
                child.send_signal(signal.SIGKILL)
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError("worker not found")


def test_sigkilled_worker_restarts_from_its_checkpoint_and_learns(tmp_path):
    crash_out, run_dir = tmp_path / "crash", tmp_path / "crash-run"
    crash_out.mkdir()
    with started(command(run_dir, crash_out, *FLAGS), stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True, env=clean_env()) as proc:
        kill_rank_when_checkpointed(proc, run_dir, rank="1")
        output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    assert "resuming from" in output

    crash = json.loads((crash_out / "rank0.json").read_text())
    assert crash["metrics"]["accuracy"] > 0.9  # the task is learned (chance: 0.5)
    # The schedule (the LR decays linearly to a tenth) had scaled the LR in the checkpoint's
    # optimizer state by 0.775 at epoch 1: it is not applied twice. The last step's progress is
    # just under 1 (it depends on what the elastic rounds took), so the LR ends just above a
    # tenth of 0.1; applied twice, it ended at 0.0078.
    assert 0.0100 <= crash["lrs"][0] <= 0.0110, crash["lrs"]
    assert [r["epoch"] for r in crash["history"]] == [1, 2, 3, 4]
    assert crash["summary"]["attempt"] == 1 and crash["summary"]["resumed_from"]

    # The restart starts where the newest checkpoint before the kill left off, and the epochs
    # before it are the first attempt's, not trained again.
    events = read_events(run_dir, 0)
    restart = next(i for i, e in enumerate(events) if e["kind"] == "start" and e["attempt"] == 1)
    written = [e for e in events[:restart] if e["kind"] == "checkpoint"]
    assert written, "the first attempt wrote a checkpoint before the kill"
    start = events[restart]
    assert start["resumed_from"] == written[-1]["name"] == crash["summary"]["resumed_from"]
    assert (start["epoch"], start["round"]) == (written[-1]["epoch"], written[-1]["round"])
    before = {e["epoch"]: e["train_loss"] for e in events[:restart] if e["kind"] == "epoch"}
    assert before, "the first attempt finished an epoch before its checkpoint"
    assert {r["epoch"]: r["train_loss"] for r in crash["history"] if r["epoch"] in before} \
        == before

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


def test_the_outer_optimizers_momentum_is_checkpointed_and_resumed(tmp_path):
    """``--outer-optimizer nesterov``: each rank's checkpoint file carries the momentum, and a
    resume continues from it (its step count goes on from the checkpoint's)."""
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    first = run_fdl("run", "--run-dir", str(run_dir), "--nproc-per-node", "2", "--epochs", "2",
                    "--checkpoint-every", "1", "--outer-optimizer", "nesterov",
                    "--simulate-slowdown", "1,2", str(SCRIPTS / "recovery_train.py"),
                    str(out), "2048", cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoint = next((run_dir / "checkpoints").glob("ckpt-r*"))
    saved = [torch.load(checkpoint / f"rank{rank}.pt", weights_only=True)["outer"]
             for rank in (0, 1)]
    assert saved[0]["steps"] > 0 and saved[0]["steps"] == saved[1]["steps"]
    assert torch.equal(saved[0]["momentum_buffer"], saved[1]["momentum_buffer"])
    assert saved[0]["momentum_buffer"].abs().sum() > 0
    again = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=tmp_path,
                    timeout=240)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    result = json.loads((out / "rank0.json").read_text())
    assert result["summary"]["resumed_from"] == checkpoint.name
    events = read_events(run_dir, 0)
    restart = max(i for i, e in enumerate(events) if e["kind"] == "start")
    resumed_syncs = sum(e["kind"] == "sync" for e in events[restart:])
    assert result["summary"]["outer_optimizer"]["steps"] == saved[0]["steps"] + resumed_syncs
    assert result["metrics"]["accuracy"] > 0.9
