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


def trained_run(run_dir: Path) -> Path:
    """An earlier run that trained: config.json, logs, a timeline, a summary."""
    made_by_another_node(run_dir)
    (run_dir / "timeline").mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"world_size": 2}))
    return run_dir


def test_two_nodes_overwriting_at_once_replace_the_run_once(tmp_path, monkeypatch):
    """Both nodes start with --overwrite-run-dir on a run that trained. The first holds the
    replacement open (its removal waits) until the second has decided; the second must not
    remove anything itself (the first's new logs and config) but wait and join."""
    run_dir = trained_run(tmp_path / "run")
    second_decided, results = threading.Event(), {}
    remove, sleep = layout._remove_run, time.sleep

    def slow_remove(path: Path) -> None:
        if threading.current_thread().name == "first":
            assert second_decided.wait(timeout=60)
        remove(path)

    def watched_sleep(seconds: float) -> None:
        if threading.current_thread().name == "second":
            second_decided.set()  # it waits (for the first): it decided not to replace
        sleep(seconds)

    monkeypatch.setattr(layout, "_remove_run", slow_remove)
    monkeypatch.setattr(layout.time, "sleep", watched_sleep)

    def node(name: str) -> None:
        try:
            results[name] = layout.join_or_prepare_run_dir(run_dir, spec=spec(),
                                                           fdl_version=VERSION, use="overwrite")
        except Exception as exc:  # the test reports it below
            results[name] = exc
        finally:
            if name == "second":
                second_decided.set()  # it is done: whatever it did, the first goes on
            else:
                (run_dir / "logs" / "agent.log").write_text("first\n")  # its launcher's log

    first = threading.Thread(target=node, args=("first",), name="first")
    first.start()
    while not (run_dir / layout.OVERWRITING).exists() and first.is_alive():
        time.sleep(0.01)  # the first has claimed the replacement
    second = threading.Thread(target=node, args=("second",), name="second")
    second.start()
    first.join(timeout=120)
    second.join(timeout=120)
    assert results == {"first": False, "second": True}
    assert not (run_dir / "timeline").exists() and not (run_dir / "summary.json").exists()
    assert (run_dir / "logs" / "agent.log").read_text() == "first\n"
    assert not (run_dir / layout.OVERWRITING).exists()


def test_a_claim_of_another_run_is_refused_and_a_stale_one_taken_over(tmp_path):
    run_dir = trained_run(tmp_path / "run")
    marker = run_dir / layout.OVERWRITING
    marker.write_text("another run")
    with pytest.raises(UsageError, match="is being replaced by another fdl run"):
        layout.join_or_prepare_run_dir(run_dir, spec=spec(), fdl_version=VERSION,
                                       use="overwrite")
    assert (run_dir / "summary.json").exists()  # nothing removed
    old = time.time() - layout.CLAIM_STALE_S - 60
    os.utime(marker, (old, old))  # left by a launcher that died long ago
    assert layout.join_or_prepare_run_dir(run_dir, spec=spec(), fdl_version=VERSION,
                                          use="overwrite") is False
    assert not (run_dir / "summary.json").exists() and not marker.exists()
    assert (run_dir / "config.json").exists()


def test_overwriting_an_empty_directory_on_several_nodes_makes_the_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert layout.join_or_prepare_run_dir(run_dir, spec=spec(), fdl_version=VERSION,
                                          use="overwrite") is False
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "logs"]


def test_a_claim_read_before_its_run_id_is_written_is_read_again(tmp_path, monkeypatch):
    """A node made the claim a moment ago and has not written its run id into it yet: the
    node beside it reads it again (and joins, the run being the same), where an empty claim
    read once counted as another run's (the overwrite race above failed that way once)."""
    run_dir = trained_run(tmp_path / "run")
    marker = run_dir / layout.OVERWRITING
    marker.write_text("")
    sleep = time.sleep

    def the_id_lands(seconds: float) -> None:  # while the reader waits, the maker writes
        marker.write_text(layout._run_id(spec()))
        sleep(seconds)

    monkeypatch.setattr(layout.time, "sleep", the_id_lands)
    assert layout._claim_overwrite(run_dir, spec()) is False


def test_a_claim_seen_half_made_and_then_gone_is_joined_not_taken_over(tmp_path, monkeypatch):
    """The maker replaced the run and removed its claim while this node waited for the claim's
    run id: this node joins the run just made instead of replacing it again."""
    run_dir = trained_run(tmp_path / "run")
    marker = run_dir / layout.OVERWRITING
    marker.write_text("")
    sleep = time.sleep

    def the_maker_finishes(seconds: float) -> None:
        marker.unlink(missing_ok=True)
        sleep(seconds)

    monkeypatch.setattr(layout.time, "sleep", the_maker_finishes)
    assert layout._claim_overwrite(run_dir, spec()) is False
    assert not marker.exists()  # no claim of its own made
