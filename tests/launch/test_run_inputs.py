"""`fdl run` input handling: every bad input is one line, exit 2, and nothing started;
--dry-run shows the resolved spec (GPU hosts described by FDL_GPU_SURVEY fixtures)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, assert_one_error, clean_env, free_port, run_fdl, started

from fdl.errors import UsageError

HELLO = "print('hello from the worker')\n"


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "train.py").write_text(HELLO)
    return tmp_path


def fdl_run(project: Path, *args: str, env: dict[str, str] | None = None):
    return run_fdl("run", *args, cwd=project, env=env)


def assert_usage_error(proc, *needles: str) -> None:
    """One usage error naming ``needles`` in its `error:` line, and no worker started."""
    error = assert_one_error(proc, 2).splitlines()[0]
    for needle in needles:
        assert needle in error, (needle, error)
    assert "hello from the worker" not in proc.stdout


@pytest.mark.parametrize(("make", "what"), [
    (lambda path: path.mkdir(), "a directory"),
    (lambda path: os.mkfifo(path), "a named pipe (FIFO)"),
    (lambda path: path.symlink_to("/dev/null"), "a device"),
])
def test_a_script_that_is_no_file_is_named_for_what_it_is(project, make, what):
    """A FIFO, a device or a directory was called "script not found" (and a FIFO that fdl
    opened to check it could be read would have blocked)."""
    make(project / "odd.py")
    assert_usage_error(fdl_run(project, "odd.py"), f"the script odd.py is {what}, not a file")


@pytest.mark.parametrize(("args", "needles"), [
    (["missing.py"], ["script not found: missing.py"]),
    (["--nproc-per-node", "two", "train.py"], ["--nproc-per-node", "'two'"]),
    (["--nproc-per-node", "0", "train.py"], ["--nproc-per-node", "0"]),
    (["--policy", "fast", "train.py"], ["unknown policy 'fast'"]),
    (["--backend", "tpu", "train.py"], ["unknown backend 'tpu'"]),
    (["--simulate-slowdown", "1,2,3", "train.py"], ["3 factor(s) for 2 worker(s)"]),
    (["--precision", "bf16,fp32,fp32", "train.py"], ["--precision has 3 values for 2 worker(s)"]),
    (["--simulate-slowdown", "1,0", "train.py"], ["simulate_slowdown"]),
    (["--simulate-slowdown", "1,x", "train.py"], ["simulate_slowdown"]),
    (["--epochs", "0", "train.py"], ["epochs", "0"]),
    (["--batch-size", "-4", "train.py"], ["batch_size", "-4"]),
    (["--nnodes", "2", "train.py"], ["--rdzv-endpoint"]),
    (["--nnodes", "3:2", "train.py"], ["--nnodes"]),
    (["--rdzv-backend", "etcd", "train.py"], ["--rdzv-backend"]),
    (["--frobnicate", "train.py"], ["--frobnicate"]),
])
def test_bad_flags(project, args, needles):
    proc = fdl_run(project, *args)
    assert_usage_error(proc, *needles)
    assert not (project / "runs").exists()


def test_devices_naming_a_missing_gpu(project):
    env = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "gtx1060_rtx5060ti.json")}
    proc = fdl_run(project, "--devices", "0,5", "train.py", env=env)
    assert_usage_error(proc, "GPU 5", "visible GPUs: 0, 1")


def test_master_port_in_use(project):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = fdl_run(project, "--master-port", str(port), "train.py")
    assert_usage_error(proc, f"--master-port {port} is already in use")


def test_unwritable_run_dir(project):
    (project / "a-file").write_text("")
    proc = fdl_run(project, "--run-dir", str(project / "a-file" / "run"), "train.py")
    assert_usage_error(proc, "cannot use run directory")


def test_unknown_config_key_names_file_and_key(project):
    (project / "fdl.toml").write_text('polcy = "async"\n')
    proc = fdl_run(project, "train.py")
    assert_usage_error(proc, "unknown key 'polcy'", str(project / "fdl.toml"))


def test_bad_env_value_names_the_variable(project):
    proc = fdl_run(project, "train.py", env={"FDL_POLICY": "turbo"})
    assert_usage_error(proc, "FDL_POLICY")


def test_torch_not_installed(project, tmp_path_factory):
    hide = tmp_path_factory.mktemp("hide-torch")
    # sys.modules["torch"] = None makes the interpreter behave as if torch were absent.
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    proc = fdl_run(project, "train.py", env={"PYTHONPATH": str(hide)})
    assert_usage_error(proc, "torch is not installed")
    assert "fdl[torch]" in proc.stderr


def dry_run(project: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = fdl_run(project, "--dry-run", "--json", *args, "train.py", "--lr", "0.1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert not (project / "runs").exists()
    return json.loads(proc.stdout)


def test_dry_run_cpu_defaults(project):
    spec = dry_run(project)
    assert spec["args"] == ["--lr", "0.1"]
    assert spec["nproc_per_node"] == 2 and spec["devices"]["kind"] == "cpu"
    assert spec["rendezvous"]["backend"] == "c10d"
    assert spec["rendezvous"]["endpoint"] == "127.0.0.1:0"
    assert spec["run_dir"].startswith(str(project / "runs"))
    assert spec["run_dir"].endswith("-train-cadence")
    assert [w["rank"] for w in spec["workers"]] == [0, 1]


def test_workers_and_threads_are_planned_on_the_cores_this_process_may_use(project):
    """Under ``taskset``, a container's cpuset or a scheduler's allocation the affinity holds
    fewer cores than the machine has: ``--nproc-per-node cpu`` and the threads per worker
    count those (here one core of the host's, whatever their number)."""
    one = min(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "fdl", "run", "--dry-run", "--json",
                           "--nproc-per-node", "cpu", "train.py"], capture_output=True,
                          text=True, env=clean_env(), cwd=project, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["nproc_per_node"] == 1 and spec["devices"]["threads_per_worker"] == 1


def test_dry_run_human_output(project):
    proc = fdl_run(project, "--dry-run", "--policy", "async", "train.py")
    assert proc.returncode == 0
    assert "c10d at 127.0.0.1:0" in proc.stdout and "FDL_POLICY" in proc.stdout


def test_dry_run_one_worker_per_gpu_each_on_its_own_device(project):
    env = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "gtx1060_rtx5060ti.json")}
    spec = dry_run(project, env=env)
    assert spec["devices"]["kind"] == "cuda"
    assert [w["device"] for w in spec["workers"]] == [
        "cuda:0 NVIDIA GeForce RTX 5060 Ti (sm_120)", "cuda:1 NVIDIA GeForce GTX 1060 6GB (sm_61)"]
    assert spec["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert spec["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    picked = dry_run(project, "--devices", "1", env=env)
    assert [w["device"] for w in picked["workers"]] == ["cuda:0 NVIDIA GeForce GTX 1060 6GB (sm_61)"]
    assert picked["env"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_dry_run_cpu_workers_share_the_cores(project):
    spec = dry_run(project, "--nproc-per-node", "1")
    import os

    assert spec["env"]["OMP_NUM_THREADS"] == str(os.cpu_count())


def test_precedence_flag_env_file_default(project):
    (project / "fdl.toml").write_text('policy = "sync"\nepochs = 9\nbatch_size = 16\n')
    spec = dry_run(project, "--policy", "async", env={"FDL_EPOCHS": "4"})
    settings = spec["settings"]
    assert settings["policy"] == {"value": "async", "source": "flag"}
    assert settings["epochs"] == {"value": 4, "source": "env"}
    assert settings["batch_size"] == {"value": 16,
                                      "source": f"file:{project / 'fdl.toml'}"}
    assert settings["seed"] == {"value": 42, "source": "default"}
    assert spec["env"]["FDL_BATCH_SIZE"] == "16" and "FDL_SEED" not in spec["env"]


def test_pyproject_tool_fdl_is_read(project):
    (project / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.fdl]\npolicy = "sync"\n')
    assert dry_run(project)["settings"]["policy"]["source"].startswith("file:")


def test_slurm_allocation_sets_nodes_rank_and_endpoint(project):
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}
    spec = dry_run(project, env=env)
    assert spec["nnodes"] == 2
    assert spec["rendezvous"] == {"backend": "c10d", "endpoint": "gpu07:29400",
                                  "run_id": "4242", "node_rank": None, "source": "slurm"}
    assert [w["rank"] for w in spec["workers"]] == [None, None]  # assigned at rendezvous
    # explicit flags win over the allocation
    spec = dry_run(project, "--rdzv-endpoint", "head:1234", env=env)
    assert spec["rendezvous"]["endpoint"] == "head:1234"


def test_master_addr_and_port_use_torchruns_static_rendezvous(project):
    port = free_port()
    spec = dry_run(project, "--master-port", str(port))
    assert spec["rendezvous"]["backend"] == "static"
    assert spec["rendezvous"]["endpoint"] == f"127.0.0.1:{port}"


def test_users_omp_num_threads_wins(project):
    assert dry_run(project, env={"OMP_NUM_THREADS": "3"})["env"]["OMP_NUM_THREADS"] == "3"


def test_dry_run_shows_all_that_fdl_adds_to_a_worker_environment(project):
    """The launcher pid and the live-progress interval are planned, not added after the spec."""
    terminal = {"TTY_COMPATIBLE": "1", "TERM": "xterm"}  # rich takes stderr for a terminal
    with started([sys.executable, "-m", "fdl", "run", "--dry-run", "--json", "train.py"],
                 cwd=project, env=clean_env(terminal), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    env = json.loads(out)["env"]
    assert env["FDL_PROGRESS"] == "0.25"
    assert env["FDL_LAUNCHER_PID"] == str(proc.pid)  # the process that would start the workers
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env  # no restarts
    assert "FDL_PROGRESS" not in dry_run(project, "--quiet", env=terminal)["env"]
    assert "FDL_PROGRESS" not in dry_run(project)["env"]  # stderr is a pipe: nothing live


def test_restarts_give_each_attempt_its_own_store_unless_the_user_decided(project):
    restarts = ("--max-restarts", "1")
    assert dry_run(project, *restarts)["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    own = dry_run(project, *restarts, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in own["env"]  # the user's own value stays


def test_fdl_options_after_the_script_are_fdls(project):
    proc = fdl_run(project, "train.py", "--dry-run", "--json", "--policy", "async", "--lr",
                   "0.1", "--epochs=3", "--nproc-per-node", "1", "--", "--seed", "9")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["settings"]["policy"] == {"value": "async", "source": "flag"}
    assert spec["settings"]["epochs"] == {"value": 3, "source": "flag"}
    assert spec["settings"]["seed"]["source"] == "default"
    assert spec["args"] == ["--lr", "0.1", "--seed", "9"]
    assert spec["nproc_per_node"] == 1
    # the same option before the script wins
    before = json.loads(fdl_run(project, "--dry-run", "--json", "--policy", "sync", "train.py",
                                "--policy", "async").stdout)
    assert before["settings"]["policy"]["value"] == "sync"


def test_el_che_flag_without_a_value_after_the_script(project):
    assert_usage_error(fdl_run(project, "train.py", "--policy"), "--policy needs a value")


@pytest.mark.parametrize(("text", "default", "parsed"), [
    ("node0:29400", None, ("node0", 29400)),
    ("10.0.0.1", 29400, ("10.0.0.1", 29400)),
    ("[::1]:1234", None, ("::1", 1234)),
    ("::1", 5, ("::1", 5)),
    ("fe80::1:80", None, ("fe80::1:80", None)),  # bare IPv6: no port, as an address
])
def test_parse_endpoint_reads_torchs_forms(text, default, parsed):
    from fdl.launch.rendezvous import parse_endpoint

    if parsed[1] is None:
        with pytest.raises(UsageError):
            parse_endpoint(text, flag="--rdzv-endpoint", default_port=default)
        return
    assert parse_endpoint(text, flag="--rdzv-endpoint", default_port=default) == parsed


@pytest.mark.parametrize("text", ["", ":80", "host:", "host:http", "host:0", "host:65536",
                                  "[::1", "[::1]x", "bad host:80", "host:٣"])
def test_parse_endpoint_refuses_the_rest(text):
    from fdl.launch.rendezvous import parse_endpoint

    with pytest.raises(UsageError) as caught:
        parse_endpoint(text, flag="--rdzv-endpoint", default_port=29400)
    assert caught.value.message == (f"--rdzv-endpoint must be HOST:PORT with a port 1-65535, "
                                    f"got {text!r}")
    assert caught.value.hint


@pytest.mark.parametrize(("text", "what"), [
    ("0.0.0.0:29444", "the any-address"), ("[::]:29400", "the any-address"),
    ("255.255.255.255:29400", "the broadcast address"), ("224.0.0.1:29400", "a multicast address"),
    ("[ff02::1]:29400", "a multicast address")])
def test_an_address_no_node_can_connect_to_is_refused(project, text, what):
    """0.0.0.0 was taken and handed to the other nodes, which cannot connect to it."""
    proc = fdl_run(project, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", text,
                   "--dry-run", "train.py")
    assert_one_error(proc, 2, "--rdzv-endpoint: ", f"is {what}", "not an address a node connects")


def test_dry_run_ipv6_static_endpoint_is_bracketed(project):
    spec = dry_run(project, "--master-addr", "::1", "--master-port", "2345")
    assert spec["rendezvous"]["backend"] == "static"
    assert spec["rendezvous"]["endpoint"] == "[::1]:2345"
    # one node on an IPv6 address: the job's family and address are the endpoint's
    network = spec["network"]
    assert (network["family"], network["endpoint_address"], network["local_addr"]) == (
        "ipv6", "::1", "::1")
    assert dry_run(project)["network"]["family"] == "ipv4"  # a loopback name: IPv4's


def test_overwrite_run_dir_after_the_script_is_fdls(project):
    proc = fdl_run(project, "--dry-run", "--json", "train.py", "--overwrite-run-dir")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["args"] == []


def test_module_check_finds_what_python_m_would(tmp_path):
    import sys

    from fdl.launch.worker import module_problem

    (tmp_path / "local_mod.py").write_text("")
    (tmp_path / "local_pkg").mkdir()
    (tmp_path / "local_pkg" / "__main__.py").write_text("")
    (tmp_path / "ns_pkg" / "inner").mkdir(parents=True)  # a namespace package
    (tmp_path / "ns_pkg" / "inner" / "mod.py").write_text("")
    path = [str(tmp_path), *sys.path[1:]]
    # fdl itself may come from an editable install: a meta path finder, not a sys.path entry
    for name in ("local_mod", "local_pkg", "ns_pkg.inner.mod", "json.tool", "fdl",
                 "fdl.launch.worker"):
        assert module_problem(name, search_path=path) is None, name
    assert module_problem("local_mod.sub", search_path=path) == (
        f"no module named 'local_mod.sub' in {tmp_path} or this Python's path")
    assert module_problem("bad-name", search_path=path) == "'bad-name' is not a module name"


def test_module_check_cannot_judge_a_package_that_computes_its_path(tmp_path):
    import sys

    from fdl.launch.worker import module_problem

    (tmp_path / "old_ns").mkdir()
    (tmp_path / "old_ns" / "__init__.py").write_text(
        "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n")
    assert module_problem("old_ns.elsewhere", search_path=[str(tmp_path), *sys.path[1:]]) is None


def test_default_run_dir_taken_in_the_same_second_gets_a_suffix(project):
    from datetime import datetime, timezone

    from fdl.launch.request import RunRequest
    from fdl.launch.spec import place_workers
    from fdl.settings import resolve_run_settings
    from fdl.system.gpus import GpuSurvey

    settings = resolve_run_settings(flags={}, env={}, file_values={}, file_path=None)

    def planned() -> Path:
        return place_workers(
            RunRequest("train.py"), settings=settings, survey=GpuSurvey("none", (), None, None),
            env={}, cwd=project,
            now=datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc), run_id="x",
            logical_cores=2, taken=Path.exists).run_dir

    first = planned()
    assert first == project / "runs" / "20300102T030405Z-train-cadence"
    first.mkdir(parents=True)
    assert planned() == project / "runs" / "20300102T030405Z-train-cadence-2"


def test_nodes_without_a_run_id_all_meet_under_one(project):
    """docs/run.md's multi-node command gives no --rdzv-id: every node must derive the same one
    (each drew its own before, so each waited in a rendezvous of its own)."""
    args = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"]
    ids = {dry_run(project, *args)["rendezvous"]["run_id"] for _ in range(2)}
    assert ids == {"fdl"}
    assert dry_run(project, *args, "--rdzv-id", "job7")["rendezvous"]["run_id"] == "job7"


def test_the_dry_run_shows_how_a_node_reaches_the_others(project):
    spec = dry_run(project, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400")
    network = spec["network"]
    assert network["family"] == "ipv4" and network["local_addr"] == "127.0.0.1"
    assert network["interface"] == "lo"
    assert spec["env"]["GLOO_SOCKET_IFNAME"] == spec["env"]["NCCL_SOCKET_IFNAME"] == "lo"
    assert network["hosts_rendezvous"] is None  # loopback: left to torch (several launchers)
    one = dry_run(project)  # one node: gloo pinned to loopback, not the host name's address
    assert not one["network"]["several_nodes"] and one["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in one["env"]


def test_a_users_socket_interface_is_kept(project):
    spec = dry_run(project, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400",
                   env={"GLOO_SOCKET_IFNAME": "lo"})
    assert spec["network"]["user_set"] == ["GLOO_SOCKET_IFNAME"]
    assert "GLOO_SOCKET_IFNAME" not in spec["env"]  # the user's own reaches the workers as is
    assert spec["env"]["NCCL_SOCKET_IFNAME"] == "lo"


def test_master_addr_with_a_node_rank_is_torchruns_static_rendezvous(project):
    spec = dry_run(project, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
                   "29500", "--node-rank", "1")
    assert spec["rendezvous"]["backend"] == "static"
    assert spec["rendezvous"]["node_rank"] == 1
    proc = fdl_run(project, "--nnodes", "2", "--master-addr", "127.0.0.1", "train.py")
    assert_usage_error(proc, "--node-rank")


def test_torchruns_underscore_spellings_are_accepted(project):
    spec = dry_run(project, "--nproc_per_node", "1", "--max_restarts", "1", "--nnodes", "2",
                   "--rdzv_endpoint", "127.0.0.1:29400", "--rdzv_id", "j")
    assert spec["nproc_per_node"] == 1 and spec["max_restarts"] == 1
    assert spec["rendezvous"]["run_id"] == "j"


@pytest.mark.parametrize(("args", "needles"), [
    (["--local-addr", "127.0.0.1"], ["--local-addr is for several nodes"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "203.0.113.9"],
     ["--local-addr 203.0.113.9 is not an address of this node"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "::1"],
     ["--local-addr ::1 is ipv6 but the rendezvous 127.0.0.1:29400 is ipv4"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "a b"],
     ["--local-addr must be an address or host name"]),
])
def test_bad_local_addr(project, args, needles):
    """Refused before anything starts, with --dry-run too where the flag itself is wrong."""
    proc = fdl_run(project, *args, "train.py")
    assert_usage_error(proc, *needles)
    assert not (project / "runs").exists()


@pytest.mark.parametrize("nodes", [[], ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"]],
                         ids=["one node", "two nodes"])
def test_a_socket_interface_this_node_lacks_is_refused(project, nodes):
    """gloo would fail at its first collective, after every node started, in C++ frames."""
    for dry in ([], ["--dry-run"]):
        proc = fdl_run(project, *nodes, *dry, "train.py", env={"GLOO_SOCKET_IFNAME": "lo,nope9"})
        assert_usage_error(proc, "GLOO_SOCKET_IFNAME=lo,nope9", "no interface 'nope9'")
    assert not (project / "runs").exists()
