"""How `fdl run` ends, on real runs (2 gloo workers, real signals): what it says at the end of a
run that never used fdl's engine, of a run stopped with Ctrl-C, and of a run whose script
crashed; and what `fdl report` makes of the interrupted run.

Every wait is on a file the workers write or on the launcher's exit, with a deadline only as a
guard; a test that fails kills the launcher's process group and every process it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
from helpers import alive, clean_env, run_fdl, wait_until, wait_until_gone

SCRIPTS = Path(__file__).parent / "scripts"
STOPPED = SCRIPTS / "stopped_train.py"
TWO_CPU_WORKERS = ("--nproc-per-node", "2")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
GUARD_S = 120
# What must not reach the terminal when a run is stopped: the workers' tracebacks and torch's
# own log lines ("W1126 08:02:43.132000 29047 torch/distributed/elastic/...").
TORCH_LOG_LINE = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
UNREAD = "warning: the script did not train with fdl (fdl.init or fdl.Trainer)"


def _default_sigint() -> None:
    """The launcher starts as a terminal starts it: a pytest started in the background by a
    non-interactive shell ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def launched(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen]:
    """`fdl run ARGS` in its own process group, output captured; on the way out (a test that
    failed included) the group and every process the launcher started are killed."""
    proc = subprocess.Popen([sys.executable, "-m", "fdl", "run", *TWO_CPU_WORKERS, *args],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(CPU_ONLY), start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            try:
                started = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                started = []
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for child in started:
                with suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.communicate(timeout=GUARD_S)


def interrupt(proc: subprocess.Popen, out: Path) -> tuple[str, str, list[int]]:
    """Ctrl-C once a worker holds; (stdout, stderr, the holding workers' pids)."""
    wait_until(lambda: any(out.glob("held-?")), "a worker to hold", proc=proc, timeout=GUARD_S)
    pids = [int(path.read_text()) for path in out.glob("held-?")]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher (its workers have sessions
    stdout, stderr = proc.communicate(timeout=GUARD_S)  # of their own, as torchrun's do)
    return stdout, stderr, pids


def last_round(run_dir: Path) -> dict:
    events = [json.loads(line) for line in
              (run_dir / "timeline" / "rank0.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if e["kind"] == "round"][-1]


def assert_quiet_stop(stdout: str, stderr: str) -> None:
    both = stdout + stderr
    assert "Traceback" not in both and "KeyboardInterrupt" not in both, both
    assert not TORCH_LOG_LINE.search(both), both
    assert "death signal" not in both, both


# --- engine settings that were never read ------------------------------------------------------


def test_engine_settings_a_plain_ddp_script_never_reads_are_named_in_one_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "fdl.toml").write_text("epochs = 2\n")
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "ddp_train.py"), str(out),
                   cwd=tmp_path, env={**CPU_ONLY, "FDL_SEED": "3"}, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(UNREAD)]
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (f"{UNREAD}, so these settings were never read: policy (--policy), "
                        f"epochs ({tmp_path / 'fdl.toml'}), seed (FDL_SEED)")
    assert proc.stderr.splitlines()[-1] == lines[0], "said at the end of the run"


def test_a_trainer_script_reads_its_settings_and_nothing_is_said(tmp_path):
    release = tmp_path / "release"
    release.touch()  # watched_train.py trains straight through
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "watched_train.py"), str(release),
                   cwd=tmp_path, env=CPU_ONLY, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert "never read" not in proc.stderr, proc.stderr
    assert "fdl report: cadence on 2 worker(s)" in proc.stdout


# --- a loop that never calls run.finish() -------------------------------------------------------

UNFINISHED = """
import fdl, torch
run = fdl.init(seed=1)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for features, target in run.batches([(torch.ones(2), torch.ones(1))] * 8, model=model,
                                    optimizer=optimizer, batch_size=4, epochs=1):
    torch.nn.functional.mse_loss(model(features), target).backward()
    optimizer.step()
    optimizer.zero_grad()
{ending}
"""


def test_a_loop_that_never_calls_finish_is_not_done(tmp_path):
    """It ended "fdl run: done", exit 0, with no summary and no model."""
    (tmp_path / "train.py").write_text(UNFINISHED.format(ending=""))
    proc = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                   "train.py", cwd=tmp_path, env=CPU_ONLY, timeout=GUARD_S)
    assert proc.returncode == 1, proc.stderr
    assert "fdl run: done" not in proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        f"error: the script trained with fdl but ended without run.finish(): no summary.json "
        f"and no model.pt in {tmp_path / 'run'}",
        "hint: end the script with result = run.finish() after its loop (fdl.Trainer.fit() "
        "calls it)"]
    (tmp_path / "train.py").write_text(UNFINISHED.format(ending="run.finish()"))
    proc = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "again"),
                   "train.py", cwd=tmp_path, env=CPU_ONLY, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert "fdl run: done" in proc.stdout + proc.stderr


def test_a_run_whose_loss_diverged_is_not_done(tmp_path):
    """A NaN loss ended "fdl run: done", exit 0, with an all-NaN model.pt; the report's "final
    loss NaN (diverged)" was the only sign."""
    diverging = UNFINISHED.format(ending="run.finish()").replace("lr=0.1", "lr=1e38")
    (tmp_path / "train.py").write_text(diverging.replace(
        "    optimizer.step()\n", "    run.log(loss=torch.nn.functional.mse_loss(model(features), "
        "target).detach())\n    optimizer.step()\n"))
    proc = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                   "train.py", cwd=tmp_path, env=CPU_ONLY, timeout=GUARD_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fdl run: done" not in proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-2].startswith(
        "error: the run diverged: its final loss is ")
    assert (tmp_path / "run" / "model.pt").is_file()  # nothing written is lost


# --- SIGTERM while no worker runs, and a signal as the run ends -----------------------------------


def test_sigterm_before_the_workers_start_ends_with_one_line(tmp_path):
    """SIGTERM in the launch's first second ended it with exit 143 and no line. Here the
    launcher waits on a --worker-python that never answers (its waiting line says when), and
    the probe it started goes with it."""
    (tmp_path / "train.py").write_text("")
    hung = tmp_path / "python"
    daemon = tmp_path / "daemon.pid"
    hung.write_text(f"#!/bin/sh\nsleep 1000 &\necho $! > {daemon}\nsleep 1000\n")
    hung.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "fdl", "run", *TWO_CPU_WORKERS,
                             "--worker-python", f"1={hung}", "train.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(CPU_ONLY), start_new_session=True)
    try:
        line = proc.stderr.readline()  # the probe's waiting line, 5 s into the wait
        assert line.startswith("fdl run: waiting for "), line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert err.splitlines()[-2:] == [
        "error: fdl run: stopped by SIGTERM while no worker was running",
        "hint: run the same command again (fdl run --resume RUN_DIR continues a run that wrote "
        "a checkpoint)"]
    wait_until_gone([int(daemon.read_text())], "the probe's daemon to go with the launcher")


def test_a_signal_as_the_run_ended_says_there_is_nothing_to_resume(tmp_path):
    """A signal as summary.json appeared said "resume with: fdl run --resume ..." for a run
    that had finished (resuming retrained an epoch)."""
    from types import SimpleNamespace

    from fdl.cli.run import _interrupted_line
    from fdl.launch.elastic import LaunchResult

    stopped = LaunchResult(143, interrupted=True, stop_signal="SIGTERM")
    line = _interrupted_line(stopped, SimpleNamespace(run_dir=tmp_path), finished=True)
    assert line == (f"stopped by SIGTERM once the run had finished: summary.json and model.pt "
                    f"are in {tmp_path}; nothing to resume")


# --- Ctrl-C ------------------------------------------------------------------------------------


def test_ctrl_c_says_in_one_line_where_the_run_stopped_and_how_to_resume_it(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    with launched(tmp_path, "--checkpoint-every", "1", "--run-dir", str(run_dir),
                  str(STOPPED), str(out), "hold") as proc:
        stdout, stderr, pids = interrupt(proc, out)
    assert proc.returncode == 130, stderr
    assert_quiet_stop(stdout, stderr)
    stopped = last_round(run_dir)  # the script holds in epoch 2, once epoch 1's checkpoint is in
    assert stderr.splitlines()[-1] == (  # place
        f"error: interrupted in epoch 2 of 3 (after round {stopped['round']}), all workers "
        f"stopped; resume with: fdl run --resume {run_dir}")
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == \
        stderr.splitlines()[-1:]
    # the workers' logs keep what the terminal was spared
    assert any("KeyboardInterrupt" in log.read_text() for log in (run_dir / "logs").glob("*.log"))
    wait_until_gone(pids)
    _assert_report_of_a_partial_run(run_dir, stopped)


def _assert_report_of_a_partial_run(run_dir: Path, stopped: dict) -> None:
    """`fdl report` on the interrupted run: what its timelines hold, marked incomplete."""
    proc = run_fdl("report", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["complete"] is False
    assert f"epoch 2 of 3 (after round {stopped['round']})" in doc["reason"], doc["reason"]
    assert doc["world_size"] == 2 and doc["policy"] == "cadence"
    assert all(rank["samples"] > 0 for rank in doc["ranks"])
    assert doc["incomplete"] == [], "each rank's figures cover what its timeline holds"
    text = run_fdl("report", str(run_dir))
    assert text.returncode == 0, text.stderr
    assert f"incomplete {doc['reason']}" in " ".join(text.stdout.split())


def test_ctrl_c_without_a_checkpoint_says_none_was_written_and_how_to_get_one(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    with launched(tmp_path, "--run-dir", str(run_dir), str(STOPPED), str(out), "hold") as proc:
        stdout, stderr, pids = interrupt(proc, out)
    assert proc.returncode == 130, stderr
    assert_quiet_stop(stdout, stderr)
    stopped = last_round(run_dir)
    assert stderr.splitlines()[-1] == (
        f"error: interrupted in epoch 2 of 3 (after round {stopped['round']}), all workers "
        "stopped; no checkpoint was written, so it cannot resume (--checkpoint-every N writes "
        "one every N epochs, or 10m every 10 minutes)")
    wait_until_gone(pids)
    assert not any(alive(pid) for pid in pids)


# --- a crash -----------------------------------------------------------------------------------


def test_a_crash_shows_the_frame_in_the_script_whole_then_the_error_then_one_error_line(
        tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    with launched(tmp_path, "--run-dir", str(run_dir), str(STOPPED), str(out), "crash") as proc:
        _, stderr = proc.communicate(timeout=GUARD_S)
    assert proc.returncode == 1, stderr
    lines = stderr.splitlines()
    start = lines.index("root cause: rank 1 (local rank 1), exit code 1, raised in your code:")
    source = STOPPED.read_text().splitlines()
    raising = next(n for n, line in enumerate(source, 1) if "F.cross_entropy(logits" in line)
    assert lines[start + 1] == f'  | File "{STOPPED}", line {raising}, in train_step'
    assert lines[start + 2] == f"  |   {source[raising - 1].strip()}"
    assert lines[start + 3].strip(" |^") == "", "the frame is whole: its carets too"
    assert lines[start + 4] == ("  | ValueError: Expected input batch_size (16) to match target "
                                "batch_size (3).")
    assert lines[start + 5:] == [
        "error: worker rank 1 exited with code 1; the other workers were stopped",
        f"hint: full log: {run_dir / 'logs' / 'rank1.log'}"]
    assert not TORCH_LOG_LINE.search(stderr), stderr
