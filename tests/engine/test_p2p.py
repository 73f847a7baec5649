"""NCCL peer-to-peer: the pure choice, and the worker's check at the CUDA boundary (the only
thing mocked: ``torch.cuda``'s device count and peer answers, since this host has no GPU)."""

from __future__ import annotations

import pytest
import torch

from fdl.engine.collectives import nccl_p2p
from fdl.engine.p2p import P2P_ENV, missing_pairs, node_devices, p2p_choice, peer_pairs


def test_pairs_are_checked_both_ways_and_a_failing_query_is_no_access():
    asked = []

    def can(i, j):
        asked.append((i, j))
        if (i, j) == (2, 0):
            raise RuntimeError("driver said no")
        return (i, j) != (1, 0)  # 0 reaches 1 but 1 does not reach 0

    pairs = peer_pairs([2, 0, 1, 1], can)
    assert pairs == [(0, 1, False), (0, 2, False), (1, 2, True)]
    assert set(asked) == {(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)}
    assert missing_pairs(pairs) == ((0, 1), (0, 2))


def test_the_users_value_wins_then_a_missing_pair_turns_p2p_off():
    assert p2p_choice([(0, 1)], env={P2P_ENV: "0"}).value == "0"
    user = p2p_choice([], env={P2P_ENV: "1"})
    assert (user.value, user.source) == ("1", "user")
    off = p2p_choice([(0, 1)], env={})
    assert (off.value, off.source, off.reason) == (
        "1", "fdl", "no peer access between cuda:0 and cuda:1")
    assert p2p_choice([], env={}).value is None
    assert p2p_choice([], env={}, checked=False).reason.startswith("one GPU")
    assert off.to_dict() == {"env": "1", "source": "fdl", "missing": [[0, 1]],
                             "reason": off.reason}


@pytest.mark.parametrize(("local", "count", "devices"), [
    (2, 2, [0, 1]), (4, 2, [0, 1]), (1, 2, [0]), (3, 8, [0, 1, 2]), (2, 0, [])])
def test_the_nodes_devices_are_its_local_ranks_modulo_the_visible_gpus(local, count, devices):
    assert node_devices(local, count) == devices


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda with 2 devices whose peer answers the test sets (the CUDA boundary)."""
    answers = {"access": True, "asked": 0}

    def can(i, j):
        answers["asked"] += 1
        return answers["access"]

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can)
    return answers


def test_a_worker_turns_nccl_p2p_off_when_its_gpus_lack_peer_access(two_gpus):
    two_gpus["access"] = False
    env: dict[str, str] = {}
    choice = nccl_p2p(env, local_world_size=2)
    assert env == {P2P_ENV: "1"} and choice.missing == ((0, 1),)


def test_a_worker_leaves_nccl_alone_with_peer_access_or_one_gpu(two_gpus):
    env: dict[str, str] = {}
    assert nccl_p2p(env, local_world_size=2).value is None and env == {}
    two_gpus["access"] = False
    assert nccl_p2p(env, local_world_size=1).value is None and env == {}


def test_the_users_nccl_p2p_disable_is_kept_and_nothing_is_asked(two_gpus):
    two_gpus["access"] = False
    env = {P2P_ENV: "0"}
    choice = nccl_p2p(env, local_world_size=2)
    assert env == {P2P_ENV: "0"} and choice.source == "user" and two_gpus["asked"] == 0
