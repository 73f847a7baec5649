"""`fdl run` with real processes: torch.distributed.elastic workers on gloo over loopback.

Compared against torchrun itself for parameters and worker environment; failures, kills,
restarts and two "nodes" on loopback are exercised for real. No GPU is used or mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import clean_env, free_port, run_fdl, started, wait_all, wait_until, wait_until_gone

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def fdl(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_fdl("run", *args, cwd=cwd, timeout=timeout)


def load_params(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(directory / f"rank{rank}.pt")


@dataclass(frozen=True)
class DdpRun:
    """One `fdl run` of ddp_train.py on 2 workers with --policy async --epochs 3 (settings the
    script ignores: they show what reaches the workers and config.json)."""

    base: Path
    out: Path  # rank<r>.pt and rank<r>.json
    run_dir: Path
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> DdpRun:
    base = tmp_path_factory.mktemp("ddp")
    out, run_dir = base / "out", base / "run"
    out.mkdir()
    proc = fdl("--nproc-per-node", "2", "--policy", "async", "--epochs", "3", "--run-dir",
               str(run_dir), str(SCRIPTS / "ddp_train.py"), str(out), cwd=base)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return DdpRun(base, out, run_dir, proc)


def test_ddp_script_matches_torchrun_bit_for_bit(ddp_run, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    ref = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "ddp_train.py"), str(theirs)], capture_output=True,
                         text=True, timeout=180, env=clean_env(), cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    for rank in (0, 1):
        a, b = load_params(ddp_run.out, rank), load_params(theirs, rank)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Worker environment: exactly torchrun's variables, plus what the planned spec adds
    # (recorded in config.json, shown by --dry-run), with the spec's values.
    added = json.loads((ddp_run.run_dir / "config.json").read_text())["env"]
    # Besides fdl's own: threads, the devices (empty for CPU workers: CUDA hidden), and gloo
    # pinned to the loopback interface (one node).
    assert {k for k in added if not k.startswith("FDL_")} - {"CUDA_DEVICE_ORDER"} == \
        {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME"}
    for rank in (0, 1):
        env_ours = json.loads((ddp_run.out / f"rank{rank}.json").read_text())
        env_theirs = json.loads((theirs / f"rank{rank}.json").read_text())
        assert env_ours.keys() - env_theirs.keys() == added.keys() - env_theirs.keys()
        assert {k: env_ours[k] for k in added} == added
        assert env_theirs.keys() - env_ours.keys() == set()
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"):
            assert env_ours[key] == env_theirs[key], key
        assert env_ours["MASTER_ADDR"] == "127.0.0.1"
        assert env_ours["MASTER_PORT"] != "29500"
        assert env_ours["FDL_RUN_DIR"] == str(ddp_run.run_dir)
        assert int(env_ours["OMP_NUM_THREADS"]) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_run_directory_logs_and_terminal_prefixes(ddp_run):
    stdout = ddp_run.proc.stdout
    assert "[rank 0] rank 0 final loss" in stdout
    assert "[rank 1] rank 1 final loss" in stdout
    assert "rank 1 final loss" in (ddp_run.run_dir / "logs" / "rank1.log").read_text()
    config = json.loads((ddp_run.run_dir / "config.json").read_text())
    assert config["settings"]["policy"] == {"value": "async", "source": "flag"}
    assert config["settings"]["epochs"] == {"value": 3, "source": "flag"}
    assert config["settings"]["batch_size"]["source"] == "default"
    env = json.loads((ddp_run.out / "rank0.json").read_text())
    assert env["FDL_POLICY"] == "async" and env["FDL_EPOCHS"] == "3"
    assert json.loads(env["FDL_SOURCES"])["policy"] == "flag"


def test_quiet_ranks_keeps_only_rank_0_on_the_terminal(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = fdl("--quiet-ranks", "--run-dir", str(tmp_path / "run"),
               str(SCRIPTS / "ddp_train.py"), str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0]" in proc.stdout and "[rank 1]" not in proc.stdout
    assert "rank 1 final loss" in (tmp_path / "run" / "logs" / "rank1.log").read_text()


def _no_survivors(out: Path) -> None:
    pids = [int(p.read_text()) for p in out.glob("pid-*")]
    assert pids
    wait_until_gone(pids)


@pytest.mark.parametrize(("mode", "code", "needle"), [  # SIGKILL: tests/faults
    ("exit", 7, "exited with code 7"),
    ("raise", 1, "exited with code 1"),
])
def test_a_failing_rank_stops_the_others_with_a_root_cause(tmp_path, mode, code, needle):
    out = tmp_path / "out"
    out.mkdir()
    proc = fdl("--run-dir", str(tmp_path / "run"), str(SCRIPTS / "fail.py"), mode, "1",
               str(out), cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert f"error: worker rank 1 {needle}" in proc.stderr
    assert "root cause: rank 1" in proc.stderr
    if mode == "raise":  # what the worker recorded: the script's frame, then the error
        raising = next(n for n, line in enumerate(
            (SCRIPTS / "fail.py").read_text().splitlines(), 1) if "raise RuntimeError" in line)
        assert (f'  | File "{SCRIPTS / "fail.py"}", line {raising}, in <module>\n'
                '  |   raise RuntimeError("boom from the training loop")\n'
                "  | RuntimeError: boom from the training loop\n") in proc.stderr
    else:  # no exception to record: the log's last lines
        assert "  | about to fail: the root cause line" in proc.stderr
    # rank 0 waits 120 s and then says it was never stopped (within fdl()'s 180 s timeout)
    assert "was never stopped" not in proc.stdout
    assert "was never stopped" not in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    _no_survivors(out)


def test_max_restarts_restarts_the_group_and_keeps_the_first_log(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    proc = fdl("--max-restarts", "1", "--run-dir", str(run_dir), str(SCRIPTS / "fail.py"),
               "kill-once", "1", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 attempt 1 ok" in (run_dir / "logs" / "rank1.log").read_text()
    assert "attempt 0 starting" in (run_dir / "logs" / "rank1.attempt0.log").read_text()


def test_ctrl_c_stops_everything_and_exits_130(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with started([sys.executable, "-m", "fdl", "run", "--run-dir", str(tmp_path / "r"),
                  str(SCRIPTS / "fail.py"), "none", "-1", str(out)],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                 env=clean_env()) as proc:
        wait_until(lambda: len(list(out.glob("pid-*"))) >= 2, "both workers to start", proc=proc)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C sends to the launcher
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    _no_survivors(out)


def test_two_nodes_on_loopback(tmp_path):
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    with ExitStack() as nodes:
        procs = [nodes.enter_context(started(
            [sys.executable, "-m", "fdl", "run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
             "--run-dir", str(tmp_path / f"node{n}"), str(SCRIPTS / "ddp_train.py"), str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env=clean_env({"FDL_DEBUG": "1"}))) for n in range(2)]
        outputs = wait_all(procs, deadline=time.monotonic() + 240)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(
        f"--- node{n} exit {p.returncode}:\n{text}" for n, (p, text) in
        enumerate(zip(procs, outputs, strict=True)))
    a, b = load_params(out, 0), load_params(out, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    envs = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "1"]


def test_launch_config_fields_an_older_torch_lacks_are_left_out():
    """torch 2.11's LaunchConfig has no shutdown_timeout: passing it failed every fdl run."""
    from dataclasses import dataclass

    from torch.distributed.launcher.api import LaunchConfig

    from fdl.launch.elastic import supported_fields

    @dataclass
    class OlderLaunchConfig:
        min_nodes: int

    assert supported_fields(OlderLaunchConfig, {"shutdown_timeout": 5}) == {}
    assert supported_fields(LaunchConfig, {"shutdown_timeout": 5}) == {"shutdown_timeout": 5}
