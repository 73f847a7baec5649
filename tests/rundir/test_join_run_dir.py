"""A node of a multi-node run joins the run directory another node of the same run made (a
shared filesystem), and nothing else: fdl.rundir.layout.joinable and join_or_prepare_run_dir
on real directories. The two nodes on real network stacks: tests/nodes/test_two_nodes.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from fdl.errors import UsageError
from fdl.rundir import layout

VERSION = "1.2.3"


def spec(**changes) -> dict:
    base = {"script": "/work/train.py", "args": ["--x", "1"], "nnodes": 2,
            "rendezvous": {"backend": "c10d", "endpoint": "198.18.0.1:29400", "run_id": "fdl",
                           "node_rank": None, "source": "flags"},
            "network": {"several_nodes": True, "local_addr": "198.18.0.1"}}
    return {**base, **changes}


def made_by_another_node(run_dir: Path) -> Path:
    """What the first node leaves before the rendezvous: config.json and logs/."""
    layout.prepare_run_dir(run_dir, spec=spec(), fdl_version=VERSION)
    return run_dir


def test_the_same_run_still_meeting_is_joined_and_left_as_it_was(tmp_path):
    run_dir = made_by_another_node(tmp_path / "run")
    before = (run_dir / "config.json").read_bytes()
    mine = spec(network={"several_nodes": True, "local_addr": "198.18.0.2"})
    assert layout.join_or_prepare_run_dir(run_dir, spec=mine, fdl_version=VERSION) is True
    assert (run_dir / "config.json").read_bytes() == before  # one config: the first node's


@pytest.mark.parametrize("differs", [
    {"rendezvous": {**spec()["rendezvous"], "run_id": "other"}},
    {"rendezvous": {**spec()["rendezvous"], "endpoint": "198.18.0.9:29400"}},
    {"script": "/work/other.py"}, {"args": []}, {"nnodes": 3},
    {"network": {"several_nodes": False}}, {"network": None}])
def test_another_run_or_one_node_is_not_joined(tmp_path, differs):
    run_dir = made_by_another_node(tmp_path / "run")
    assert not layout.joinable(run_dir, spec=spec(**differs), fdl_version=VERSION)
    assert not layout.joinable(run_dir, spec=spec(), fdl_version="9.9.9")


@pytest.mark.parametrize("trained", ["timeline", "summary", "stale", "torn", "absent"])
def test_a_run_that_trained_or_went_quiet_is_not_joined_and_refused(tmp_path, trained):
    run_dir = made_by_another_node(tmp_path / "run")
    config = run_dir / "config.json"
    if trained == "timeline":
        (run_dir / "timeline").mkdir()
    elif trained == "summary":
        (run_dir / "summary.json").write_text(json.dumps({"world_size": 2}))
    elif trained == "stale":
        old = time.time() - layout.JOIN_WINDOW_S - 60
        os.utime(config, (old, old))
    elif trained == "torn":
        config.write_text('{"fdl_version": "1.2')
    else:
        config.unlink()
    assert not layout.joinable(run_dir, spec=spec(), fdl_version=VERSION)
    if trained in ("timeline", "summary", "stale"):
        with pytest.raises(UsageError, match="holds an earlier run"):
            layout.join_or_prepare_run_dir(run_dir, spec=spec(), fdl_version=VERSION)


def test_two_nodes_at_once_the_one_that_lost_the_claim_joins(tmp_path):
    """The other node has claimed the directory (logs/) but not written config.json yet: this
    one waits for it, then joins."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    result: dict = {}

    def second_node() -> None:
        try:
            result["joined"] = layout.join_or_prepare_run_dir(run_dir, spec=spec(),
                                                              fdl_version=VERSION)
        except Exception as exc:  # the test reports it below
            result["error"] = exc

    node = threading.Thread(target=second_node)
    node.start()
    from fdl.rundir import config

    config.write_config(run_dir, spec(), fdl_version=VERSION)  # the first node, a moment later
    node.join(timeout=60)
    assert result == {"joined": True}


def test_one_node_is_never_joined_and_is_refused_as_before(tmp_path):
    run_dir = made_by_another_node(tmp_path / "run")
    single = spec(network=None)
    with pytest.raises(UsageError, match="holds an earlier run"):
        layout.join_or_prepare_run_dir(run_dir, spec=single, fdl_version=VERSION)


def test_a_joining_nodes_agent_log_is_its_own_and_names_nothing_outside(tmp_path):
    logs = tmp_path / "logs"
    assert layout.agent_log_path(logs) == logs / "agent.log"
    assert layout.agent_log_path(logs, node="198.18.0.2") == logs / "agent-198.18.0.2.log"
    assert layout.agent_log_path(logs, node="fd00::2") == logs / "agent-fd00__2.log"
    assert layout.agent_log_path(logs, node="../../etc/x").parent == logs
