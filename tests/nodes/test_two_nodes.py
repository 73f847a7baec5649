"""Two machines for real: two network namespaces of this host (tests/nodes/netns.py), each with
its own network stack and an interface name of its own, run the documented multi-node command
(docs/run.md "Several machines") and train together, as two home machines would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from helpers import clean_env, end_process_tree, started, wait_all, wait_until
from netns import Node, need_namespaces, two_nodes

from fdl.launch.network import hostname_on_loopback

ROOT = Path(__file__).resolve().parents[2]
DISAGREE = ROOT / "tests" / "engine" / "scripts" / "disagree_train.py"
STOP_S = 30  # issue 27: a node with different data stops both within this
EXAMPLE = ROOT / "examples" / "mlp_synthetic.py"
PORT = 29400
DEADLINE_S = 90  # a guard only: a run that meets takes seconds
TRAIN = ["--hidden", "32", "--train-samples", "2048", "--epochs", "2", "--batch-size", "64"]


def documented_command(node: Node, endpoint: str, run_dir: Path, *extra: str,
                       script: tuple[str, ...] = (str(EXAMPLE), *TRAIN)) -> list[str]:
    """docs/run.md's command, the same on every node but for its own run directory."""
    return node.command([sys.executable, "-m", "fdl", "run", "--nnodes", "2",
                         "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, *extra,
                         "--quiet", "--run-dir", str(run_dir), *script])


def run_nodes(commands: list[list[str]], cwd: Path, *, envs: list[dict[str, str]] | None = None,
              deadline_s: float = DEADLINE_S) -> list[tuple[int, str]]:
    """Start every node's command at once (``envs``: each node's own variables) and wait for
    all; any still running after ``deadline_s`` is stopped, so a hang shows what each node
    said (and fails a test that expects the nodes to have ended)."""
    envs = envs or [{} for _ in commands]
    with ExitStack() as stack:
        procs = [stack.enter_context(started(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env=clean_env({"OMP_NUM_THREADS": "1", **extra})))
            for argv, extra in zip(commands, envs, strict=True)]
        outputs = wait_all(procs, deadline=time.monotonic() + deadline_s)
        return [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]


def shown(outputs: list[tuple[int, str]]) -> str:
    return "\n".join(f"--- node{n} exit {code}:\n{text[-3000:]}"
                     for n, (code, text) in enumerate(outputs))


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6-only"])
def test_the_documented_command_trains_on_two_machines(tmp_path, ipv6):
    """No --rdzv-id, interfaces named differently on each node, the host name resolving to
    loopback: both nodes meet at node 0's address and train one model together."""
    need_namespaces()
    with two_nodes(ipv6=ipv6) as (node0, node1):
        endpoint = f"[{node0.address}]:{PORT}" if ipv6 else f"{node0.address}:{PORT}"
        dirs = [tmp_path / "node0", tmp_path / "node1"]
        outputs = run_nodes([documented_command(node, endpoint, run_dir)
                             for node, run_dir in zip((node0, node1), dirs, strict=True)],
                            tmp_path)
        speed = f"import psutil; print(psutil.net_if_stats()[{node0.interface!r}].speed)"
        rated = subprocess.run(node0.command([sys.executable, "-c", speed]),
                               capture_output=True, text=True, check=True).stdout.strip()
    assert [code for code, _ in outputs] == [0, 0], shown(outputs)
    waiting = f"waiting for 2 nodes at {endpoint}"
    assert f"{waiting} (this node hosts it, as {node0.address}" in outputs[0][1], shown(outputs)
    assert f"{waiting} (this node joins it, as {node1.address}" in outputs[1][1], shown(outputs)
    for node, (_, text) in zip((node0, node1), outputs, strict=True):  # as the name resolves
        said = f"warning: this host's name ({socket.gethostname()}) resolves to loopback: " \
            f"fdl gives the other nodes {node.address}, from the routes"
        assert (said in text) is hostname_on_loopback(), text[-2000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs
                 if (d / "summary.json").is_file()]
    assert summaries and summaries[0]["world_size"] == 2, shown(outputs)
    # what fdl report calls what the link allows: node 0's interface's rated speed (veth's)
    network = json.loads((dirs[0] / "config.json").read_text())["network"]
    assert (network["interface"], network["link_mbit"]) == (node0.interface, int(rated))


def test_a_waiting_node_counts_the_nodes_that_joined_live(tmp_path):
    """Issue 27 D1: node 0, alone, says 1/2 joined while it waits; node 1 arrives later and
    both say 2/2, then train together."""
    need_namespaces()
    with two_nodes() as (node0, node1), ExitStack() as stack:
        endpoint = f"{node0.address}:{PORT}"
        log0 = tmp_path / "node0.out"
        env = clean_env({"OMP_NUM_THREADS": "1"})
        first = stack.enter_context(started(
            documented_command(node0, endpoint, tmp_path / "node0"),
            stdout=stack.enter_context(log0.open("w")), stderr=subprocess.STDOUT, text=True,
            cwd=tmp_path, env=env))
        wait_until(lambda: f"waiting for nodes: 1/2 joined at {endpoint}" in log0.read_text(),
                   "node 0 to count itself alone", proc=first)
        second = stack.enter_context(started(
            documented_command(node1, endpoint, tmp_path / "node1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env))
        _, said = wait_all([first, second], deadline=time.monotonic() + DEADLINE_S)
        outputs = [(first.returncode, log0.read_text()), (second.returncode, said)]
    assert [code for code, _ in outputs] == [0, 0], shown(outputs)
    for _, text in outputs:
        assert f"fdl run: 2/2 nodes joined at {endpoint}" in text, shown(outputs)
    assert "2/2" not in outputs[0][1].split("1/2 joined")[0], shown(outputs)


def test_an_interface_that_cannot_reach_the_others_is_refused(tmp_path):
    """A user's GLOO_SOCKET_IFNAME naming another node's interface, a down one, or one without
    an address of the job's family: one usage error on this node, before anything starts."""
    need_namespaces()
    script = tmp_path / "train.py"
    script.write_text("print('hello from the worker')\n")

    def dry_run(node: Node, endpoint: str, interface: str) -> subprocess.CompletedProcess:
        return subprocess.run(node.command([
            sys.executable, "-m", "fdl", "run", "--dry-run", "--nnodes", "2",
            "--rdzv-endpoint", endpoint, "train.py"]), capture_output=True, text=True,
            cwd=tmp_path, env=clean_env({"GLOO_SOCKET_IFNAME": interface}), timeout=120)

    def refused(proc: subprocess.CompletedProcess, needle: str) -> None:
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr

    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        assert dry_run(node1, endpoint, node1.interface).returncode == 0
        refused(dry_run(node1, endpoint, node0.interface),
                f"this node has no interface {node0.interface!r}")
        subprocess.run(node1.command(["ip", "link", "set", node1.interface, "down"]), check=True)
        refused(dry_run(node1, "127.0.0.1:29400", node1.interface),
                f"interface {node1.interface!r} is down")
    with two_nodes(ipv6=True) as (_, node1):  # its interface: IPv6 and link-local only
        refused(dry_run(node1, "127.0.0.1:29400", node1.interface),
                f"interface {node1.interface!r} has no ipv4 address")


@pytest.mark.alone  # a stop within STOP_S: the run's own time, not another test's load
def test_different_data_on_one_node_stops_both(tmp_path):
    """Node 1 reads other samples of the same length (a silent mixture before): both nodes
    stop before training, each saying in one line which rank and node differ, and in what."""
    need_namespaces()
    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        outputs = run_nodes(
            [documented_command(node, endpoint, tmp_path / f"node{n}",
                                script=(str(DISAGREE), "data"))
             for n, node in enumerate((node0, node1))], tmp_path,
            envs=[{"DISAGREE_HERE": "0"}, {"DISAGREE_HERE": "1"}], deadline_s=STOP_S)
    line = "rank 1 (node 1, "
    for code, text in outputs:
        assert code not in (0, -15), shown(outputs)  # failed, not stopped at the deadline
        assert line in text and "differ in data fingerprint" in text, shown(outputs)
        assert "trained data" not in text


@pytest.mark.alone  # a stop within STOP_S: the run's own time, not another test's load
@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_killed_node_stops_its_peer_naming_it(tmp_path, policy):
    """Node 1's launcher is killed mid-training (its workers die with it): node 0 stops within
    30 s, in one line naming the rank, node and address it lost, not gloo's C++ message nor a
    wait for the store's timeout. Under sync node 0 is in a collective (gloo sees the
    connection close); under cadence it may be waiting on the round's messages in the store
    (fdl.engine.liveness: node 1's counter stops)."""
    need_namespaces()
    train = ["--hidden", "64", "--train-samples", "400000", "--epochs", "20",  # minutes long
             "--policy", policy]
    with two_nodes() as (node0, node1), ExitStack() as stack:
        endpoint = f"{node0.address}:{PORT}"
        procs = [stack.enter_context(started(
            documented_command(node, endpoint, tmp_path / f"node{n}",
                               script=(str(EXAMPLE), *train)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env=clean_env({"OMP_NUM_THREADS": "1"}))) for n, node in enumerate((node0, node1))]
        timelines = [tmp_path / f"node{n}" / "timeline" for n in range(2)]
        wait_until(lambda: any('"kind": "round"' in p.read_text() for t in timelines
                               if t.is_dir() for p in t.glob("rank*.jsonl")),
                   "both nodes training", proc=procs[0], timeout=DEADLINE_S)
        end_process_tree(procs[1])  # node 1 is gone, its workers with its launcher
        # node 0 still running STOP_S later is stopped (a negative code) and its output shown
        [out] = wait_all([procs[0]], time.monotonic() + STOP_S)
    assert procs[0].returncode == 1, out[-3000:]
    assert "error: the run lost a peer: " in out, out[-3000:]
    assert "rank 1 (node 1, " in out and f", {node1.address})" in out, out[-3000:]


FAIL = ROOT / "tests" / "engine" / "scripts" / "fail_mid_run.py"


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_node_that_fails_tells_its_peer_why(tmp_path, policy):
    """Node 1's script raises mid-training: node 0 stops within 30 s, in one line naming the
    rank, its node and its error (posted in the store as it failed: fdl.engine.peers), where
    before it said only that a connection closed, or waited out a timeout."""
    need_namespaces()
    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        outputs = run_nodes(
            [documented_command(node, endpoint, tmp_path / f"node{n}", "--policy", policy,
                                script=(str(FAIL), "40"))
             for n, node in enumerate((node0, node1))], tmp_path,
            envs=[{"FAIL_HERE": "0"}, {"FAIL_HERE": "1"}], deadline_s=DEADLINE_S)
    (code0, out0), (code1, out1) = outputs
    assert code0 == 1 and code1 != 0, shown(outputs)
    assert "ValueError: a bad batch at step 40" in out1, shown(outputs)
    assert ("error: the run lost a peer: rank 1 (node 1, " in out0 and
            f", {node1.address}) failed: ValueError: a bad batch at step 40 (the script's own "
            "error)" in out0), shown(outputs)


def test_a_capped_link_carries_a_token_bucket_on_both_ends():
    """scripts/bench-lan's slow links: both ends of the pair shape their egress to the rate
    (tc tbf), so each direction is capped as a home LAN or WiFi caps it."""
    need_namespaces()
    with two_nodes(rate="100mbit") as nodes:
        shown_qdiscs = [subprocess.run(node.command(["tc", "qdisc", "show", "dev",
                                                     node.interface]),
                                       capture_output=True, text=True, check=True).stdout
                        for node in nodes]
    for text in shown_qdiscs:
        assert "qdisc tbf" in text and "rate 100Mbit" in text, text


def peer_check(node: Node, endpoint: str) -> tuple[int, dict]:
    proc = subprocess.run(node.command([sys.executable, "-m", "fdl", "diagnose", "--peer",
                                        endpoint, "--json"]),
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    return proc.returncode, json.loads(proc.stdout)["peer"]


def test_diagnose_peer_says_what_stands_between_two_machines(tmp_path):
    """`fdl diagnose --peer` from node 1: before node 0 listens, a refusal (start node 0 first);
    once something listens on the endpoint, reachable, through the address and interface the
    route gives; on node 0 itself, "this node"; a name that does not resolve, said so."""
    need_namespaces()
    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        code, refused = peer_check(node1, endpoint)
        assert code == 1 and refused["outcome"] == "refused", refused
        assert "nothing listens on the port" in refused["message"]
        assert (refused["local_addr"], refused["interface"]) == (node1.address, node1.interface)
        listen = ("import socket, sys; s = socket.socket(); "
                  f"s.bind(('{node0.address}', {PORT})); s.listen(); print('ready', flush=True);"
                  " sys.stdin.read()")
        with started(node0.command([sys.executable, "-c", listen]), stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True) as listener:
            assert listener.stdout.readline().strip() == "ready"
            code, reachable = peer_check(node1, endpoint)
            assert code == 0 and reachable["outcome"] == "reachable", reachable
            code, own = peer_check(node0, endpoint)  # the port held: node 0 could not host
            assert code == 1 and own["outcome"] == "port held", own
            assert "something already listens on the port" in own["message"]
        code, own = peer_check(node0, endpoint)
        assert code == 0 and own["outcome"] == "this node", own
        assert "the port is free" in own["message"]
        code, unknown = peer_check(node1, "node-that-is-nowhere.invalid")
        assert code == 1 and unknown["outcome"] == "unresolved", unknown
        assert unknown["endpoint"] == "node-that-is-nowhere.invalid:29400"
        assert unknown["hostname_on_loopback"] is hostname_on_loopback()  # this host's name


def worker_pids(node: Node) -> list[int]:
    """The training workers running in ``node``'s namespace (``python -m fdl.launch.worker``)."""
    import psutil

    listed = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True,
                            text=True).stdout.split()
    found = []
    for pid in map(int, listed):
        try:
            if "fdl.launch.worker" in psutil.Process(pid).cmdline():
                found.append(pid)
        except psutil.Error:
            continue
    return found


def test_two_nodes_survive_a_killed_worker_from_a_checkpoint_on_node0(tmp_path):
    """Each node its own run directory (no shared disk), a checkpoint every epoch: node 1's
    rank hands its state to rank 0, so the checkpoint on node 0 is complete. Node 1's worker is
    killed after the first checkpoint; --max-restarts restarts both nodes' workers, which resume
    from that checkpoint (node 1's rank from what rank 0 reads for it) and finish."""
    need_namespaces()
    train = ["--hidden", "64", "--train-samples", "60000", "--epochs", "4"]
    with two_nodes() as (node0, node1), ExitStack() as stack:
        endpoint = f"{node0.address}:{PORT}"
        procs = [stack.enter_context(started(
            documented_command(node, endpoint, tmp_path / f"node{n}", "--checkpoint-every",
                               "1", "--max-restarts", "1", script=(str(EXAMPLE), *train)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env=clean_env({"OMP_NUM_THREADS": "1"}))) for n, node in enumerate((node0, node1))]
        checkpoints = tmp_path / "node0" / "checkpoints"
        wait_until(lambda: any((c / "manifest.json").is_file() for c in checkpoints.glob("ckpt-*"))
                   if checkpoints.is_dir() else False,
                   "node 0's first checkpoint", proc=procs[0], timeout=DEADLINE_S)
        first = sorted(c.name for c in checkpoints.glob("ckpt-*"))[0]
        manifest = json.loads((checkpoints / first / "manifest.json").read_text())
        assert {"rank0.pt", "rank1.pt", "model.pt"} <= set(manifest["files"]), manifest
        assert not (tmp_path / "node1" / "checkpoints").exists()  # node 1 wrote nothing
        for pid in worker_pids(node1):
            os.kill(pid, signal.SIGKILL)
        outputs = wait_all(procs, deadline=time.monotonic() + DEADLINE_S)
    results = [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]
    assert [code for code, _ in results] == [0, 0], shown(results)
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["resumed_from"] == first and summary["attempt"] == 1, summary
    assert summary["epochs"] == 4
    # and `fdl run --resume` on both nodes, each its own run directory, trains one epoch more
    # from the newest checkpoint, which only node 0 holds
    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        resumed = run_nodes([node.command([
            sys.executable, "-m", "fdl", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint, "--quiet", "--resume", str(tmp_path / f"node{n}"),
            "--epochs", "5"]) for n, node in enumerate((node0, node1))], tmp_path)
    assert [code for code, _ in resumed] == [0, 0], shown(resumed)
    again = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert again["epochs"] == 5 and again["resumed_from"] > first, again


def test_two_nodes_share_one_run_directory(tmp_path):
    """Issue 27 D5 with a shared filesystem (both namespaces see this host's disk): the same
    --run-dir on both nodes, started at once. One makes it, the other joins it: one
    config.json, each rank's log and timeline, rank 0's summary and checkpoints with both
    ranks' parts; a directory of a run that trained is not joined."""
    need_namespaces()
    shared = tmp_path / "shared"
    with two_nodes() as (node0, node1):
        endpoint = f"{node0.address}:{PORT}"
        outputs = run_nodes([documented_command(node, endpoint, shared, "--checkpoint-every",
                                                "1") for node in (node0, node1)], tmp_path)
    assert [code for code, _ in outputs] == [0, 0], shown(outputs)
    joined = [n for n, (_, text) in enumerate(outputs)
              if f"joins run directory {shared} (another node of this run made it" in text]
    assert len(joined) == 1, shown(outputs)
    logs = {p.name for p in (shared / "logs").iterdir()}  # an agent log only if torch logged
    assert {"rank0.log", "rank1.log"} <= logs, logs
    assert json.loads((shared / "config.json").read_text())["rendezvous"]["endpoint"] == endpoint
    assert {p.name for p in (shared / "timeline").glob("rank*.jsonl")} == {"rank0.jsonl",
                                                                         "rank1.jsonl"}
    assert json.loads((shared / "summary.json").read_text())["world_size"] == 2
    manifests = [json.loads(m.read_text())
                 for m in (shared / "checkpoints").glob("*/manifest.json")]
    assert manifests and all({"rank0.pt", "rank1.pt"} <= set(m["files"]) for m in manifests)
    with two_nodes() as (node0, node1):  # the same command again: that run trained, refused
        endpoint = f"{node0.address}:{PORT}"
        again = run_nodes([documented_command(node, endpoint, shared) for node in (node0, node1)],
                          tmp_path, deadline_s=60)
    assert [code for code, _ in again] == [2, 2], shown(again)
    assert all(f"run directory {shared} holds an earlier run" in text for _, text in again)
    resume_the_shared_directory(tmp_path, shared, maker=1 - joined[0])


def resume_the_shared_directory(tmp_path: Path, shared: Path, *, maker: int) -> None:
    """`--resume` of the shared directory on both nodes: the node that did not make it starts
    first and joins it, leaving config.json as it was; the maker rewrites it (the resume's
    --epochs), so one config stays, the maker's, whichever node starts first."""
    config_path = shared / "config.json"
    before = config_path.read_bytes()
    with two_nodes() as nodes, ExitStack() as stack:
        endpoint = f"{nodes[0].address}:{PORT}"
        logs = [tmp_path / f"resume-node{n}.log" for n in (0, 1)]
        order = [1 - maker, maker]
        procs = {}
        for n in order:
            out = stack.enter_context(logs[n].open("w"))
            procs[n] = stack.enter_context(started(nodes[n].command([
                sys.executable, "-m", "fdl", "run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-endpoint", endpoint, "--quiet", "--resume", str(shared), "--epochs",
                "3"]), stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                env=clean_env({"OMP_NUM_THREADS": "1"})))
            if n != maker:  # it has prepared the run directory once it waits for the others
                wait_until(lambda n=n: "waiting for 2 nodes" in logs[n].read_text(),
                           "the joining node's waiting line", proc=procs[n], timeout=DEADLINE_S)
                assert config_path.read_bytes() == before
                assert f"joins run directory {shared}" in logs[n].read_text()
        wait_all([procs[n] for n in order], deadline=time.monotonic() + DEADLINE_S)
        codes = [procs[n].returncode for n in (0, 1)]
    outputs = [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]
    assert codes == [0, 0], shown(outputs)
    document = json.loads(config_path.read_text())
    assert document["network"]["local_addr"] == nodes[maker].address
    assert document["settings"]["epochs"]["value"] == 3
    assert json.loads((shared / "summary.json").read_text())["epochs"] == 3
