"""`fdl run` under process and network faults, with real launchers and real workers: where its
rendezvous listens, what happens to the workers when the launcher or a worker is killed, and a
run directory given twice.

Worker scripts write `pid-<rank>` (their pid, MASTER_PORT and environment, as JSON) when they
start and then wait for a `release` file; every wait here is on a file or a process, with a
deadline only as a guard."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
from helpers import alive, clean_env, run_fdl, started, wait_until, wait_until_gone

FAIL_SCRIPT = Path(__file__).parents[1] / "launch" / "scripts" / "fail.py"
GUARD_S = 60
# Two CPU workers on any host: a GPU host would otherwise start one worker per GPU.
TWO_CPU_WORKERS = ("--nproc-per-node", "2")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
BLOCKING = """\
import json, os, sys, time
out = sys.argv[1]
if "--process-group" in sys.argv:
    import torch.distributed as dist
    dist.init_process_group("gloo")
with open(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"), "w") as fh:
    json.dump({"pid": os.getpid(), "master_port": int(os.environ["MASTER_PORT"]),
               "env": dict(os.environ)}, fh)
os.replace(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"),
           os.path.join(out, f"pid-{os.environ['RANK']}"))
deadline = time.monotonic() + 120  # so that a test that fails leaves no worker for long
while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"rank {os.environ['RANK']} released", flush=True)
"""


@pytest.fixture
def blocking(tmp_path: Path) -> tuple[Path, Path]:
    """(script, its output directory)."""
    script, out = tmp_path / "blocking.py", tmp_path / "out"
    script.write_text(BLOCKING)
    out.mkdir()
    return script, out


@contextmanager
def started_run(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen]:
    """A running `fdl run ARGS`; on the way out its workers are released and it is waited for,
    then whatever still runs (the test failed, or the run overran the guard) is killed with
    every process it started (helpers.started)."""
    with started([sys.executable, "-m", "fdl", "run", *TWO_CPU_WORKERS, *args], cwd=tmp_path,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 env=clean_env(CPU_ONLY)) as proc:
        try:
            yield proc
        finally:
            (tmp_path / "out" / "release").touch()
            with suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=GUARD_S)


def kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with suppress(psutil.NoSuchProcess):
            p.kill()


def wait_for_workers(out: Path, proc: subprocess.Popen, count: int) -> list[dict[str, int]]:
    wait_until(lambda: len(list(out.glob("pid-?"))) >= count, f"{count} workers to start",
               proc=proc, timeout=GUARD_S)
    return [json.loads(p.read_text()) for p in sorted(out.glob("pid-?"))]


def listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("restarts", ["0", "1"])  # 1: the workers host a store of their own
def test_single_node_rendezvous_listens_on_loopback_only(tmp_path, blocking, restarts):
    script, out = blocking
    with started_run(tmp_path, "--max-restarts", restarts, "--run-dir", str(tmp_path / "run"),
                     str(script), str(out), "--process-group") as proc:
        workers = wait_for_workers(out, proc, 2)
        launcher = listening(proc.pid)
        rank0 = listening(workers[0]["pid"])
        assert launcher, "the launcher hosts the rendezvous store"
        assert {ip for ip, _ in launcher} == {"127.0.0.1"}, launcher
        master = [(ip, port) for ip, port in launcher | rank0 if port == workers[0]["master_port"]]
        assert master, "someone listens on MASTER_PORT"
        assert {ip for ip, _ in master} == {"127.0.0.1"}, master
        # What the workers got is what the spec planned: the launcher's pid, and with restarts
        # a store per attempt (the reason rank 0 hosts a store above).
        planned = json.loads((tmp_path / "run" / "config.json").read_text())["env"]
        assert planned["FDL_LAUNCHER_PID"] == str(proc.pid)
        assert planned.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == ("1" if restarts == "1"
                                                                     else None)
        for worker in workers:
            assert {k: worker["env"].get(k) for k in planned} == planned
    assert proc.returncode == 0, proc.stdout


def test_sigkill_of_the_launcher_stops_its_workers(tmp_path, blocking):
    script, out = blocking
    with started_run(tmp_path, "--run-dir", str(tmp_path / "run"), str(script), str(out)) as proc:
        pids = [w["pid"] for w in wait_for_workers(out, proc, 2)]
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=GUARD_S)
            wait_until_gone(pids)
        finally:
            for pid in pids:
                kill_tree(pid)


def test_sigkill_of_a_worker_fails_the_run_naming_rank_and_signal(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--run-dir", str(tmp_path / "run"), str(FAIL_SCRIPT),
                   "kill", "1", str(out), cwd=tmp_path, timeout=180, env=CPU_ONLY)
    assert proc.returncode == 128 + 9, proc.stderr
    assert "error: worker rank 1 was killed by SIGKILL; the other workers were stopped" \
        in proc.stderr
    assert "root cause: rank 1 (local rank 1), SIGKILL" in proc.stderr
    assert "  | about to fail: the root cause line" in proc.stderr
    pids = [int(p.read_text()) for p in out.glob("pid-*")]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids), "a worker was left running"


def test_a_run_directory_is_not_reused_unless_asked(tmp_path, blocking):
    script, out = blocking
    (out / "release").touch()
    run_dir = tmp_path / "run"
    first = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(run_dir), str(script),
                    str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    config = (run_dir / "config.json").read_text()
    again = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(run_dir), str(script),
                    str(out), "second", cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    assert again.stderr.startswith(f"error: run directory {run_dir} holds an earlier run")
    assert (run_dir / "config.json").read_text() == config
    assert (run_dir / "logs" / "rank0.log").read_text() == "rank 0 released\n"
    replaced = run_fdl("run", "--nproc-per-node", "1", "--run-dir", str(run_dir),
                       "--overwrite-run-dir", str(script), str(out), "second", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((run_dir / "config.json").read_text())["args"] == [str(out), "second"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "logs"]


def ipv6_loopback_port() -> int:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
            return sock.getsockname()[1]
    except OSError:
        pytest.skip("this host has no IPv6 loopback")


def test_ipv6_loopback_master_addr(tmp_path, blocking):
    script, out = blocking
    (out / "release").touch()
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--master-addr", "::1", "--master-port",
                   str(ipv6_loopback_port()), "--run-dir", str(tmp_path / "run"), str(script),
                   str(out), "--process-group", cwd=tmp_path, env=CPU_ONLY)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 released" in proc.stdout


def test_a_worker_whose_launcher_is_already_gone_does_not_run(tmp_path):
    """The race before PR_SET_PDEATHSIG takes effect: the launcher died first."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    script = tmp_path / "script.py"
    script.write_text("open('MARKER', 'w').write('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "fdl.launch.worker", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=GUARD_S,
                          env=clean_env({"FDL_LAUNCHER_PID": gone.stdout.strip()}))
    assert proc.returncode == 1
    assert "its launcher" in proc.stdout and "is gone" in proc.stdout
    assert not (tmp_path / "MARKER").exists()


def test_an_fdl_error_in_a_worker_is_error_and_hint_lines_with_its_exit_code(tmp_path):
    """The engine's usage errors (no usable checkpoint to resume, a model that does not fit
    it) end the worker as `fdl` itself ends: one error line, a hint, exit 2, no traceback.
    A real worker process, started as the elastic agent starts it."""
    script = tmp_path / "train.py"
    script.write_text("from fdl.errors import UsageError\n"
                      "raise UsageError('no usable checkpoint in run/checkpoints', "
                      "hint='start a new run')\n")
    other = tmp_path / "other.py"
    other.write_text("raise ValueError('a bug in the script')\n")
    result = subprocess.run([sys.executable, "-m", "fdl.launch.worker", str(script)],
                            capture_output=True, text=True, env=clean_env(), timeout=60)
    assert result.returncode == 2
    assert result.stdout.splitlines() == ["error: no usable checkpoint in run/checkpoints",
                                          "hint: start a new run"]
    plain = subprocess.run([sys.executable, "-m", "fdl.launch.worker", str(other)],
                           capture_output=True, text=True, env=clean_env(), timeout=60)
    assert plain.returncode == 1
    assert "Traceback" in plain.stdout and "ValueError: a bug in the script" in plain.stdout
