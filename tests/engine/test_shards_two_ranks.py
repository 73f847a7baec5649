"""ShardStream on a real 2-process gloo group (``test_averaging.run_ranks``: ``file://``
rendezvous, no port), claiming through the group's store: 7 text shards, rank 0 taking three
batches for each one of rank 1's, turn by turn (an all-reduce ends each turn and tells when both
ranks read epoch 2), once straight through and twice stopped, resumed from the states of a turn
(in the same store half way through shards, then a new store as after a restart, with the
ranks an epoch apart) and read to the same end."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_averaging import run_ranks, scenario
from test_shards import (
    EPOCHS,
    Record,
    ShardStream,
    assert_once_per_epoch,
    shards_read,
    tagged_stream,
    take_turn,
    write_shards,
)

SHARDS_DIR = "SHARDS_TEST_DIR"  # where the test wrote the shards, for the spawned ranks
LOST_TURNS = 2  # read after the states were taken, then lost with the "crash"


def shard_paths() -> list[Path]:
    return sorted(Path(os.environ[SHARDS_DIR]).glob("shard-*.txt"),
                  key=lambda path: int(path.stem.split("-")[1]))


def stream(rank: int, name: str, store: Any = None) -> ShardStream:
    return tagged_stream(shard_paths(), rank=rank, world_size=2, name=name, store=store)


def read_on(stream: ShardStream, rank: int, *, turns: int | None = None,
            ordered: bool = False) -> list[Record]:
    """Turns of this rank, each ended by an all-reduce of the lowest epoch of the two: ``turns``
    of them, or until both ranks read the epoch after the last one checked. In an ``ordered``
    turn rank 0 reads before rank 1 (a barrier between), so the claims come in the order of
    test_shards' in-process runs; otherwise both claim at once."""
    records: list[Record] = []
    for done in itertools.count(1):
        for reader in (0, 1) if ordered else (rank,):
            if reader == rank:
                records += take_turn(stream, rank)
            if ordered:
                dist.barrier()
        lowest = torch.tensor([stream.epoch])
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        if done == turns if turns is not None else int(lowest) >= EPOCHS:
            return records
    raise AssertionError("unreachable")


def straight(rank: int) -> dict[str, Any]:
    return {"records": read_on(stream(rank, "straight"), rank)}


def resumed(rank: int, *, name: str, cut: int, new_store: bool) -> dict[str, Any]:
    """Ordered turns, so the cut falls where test_shards' runs put it (cut 2: both ranks half
    way through a shard of epoch 0; cut 7: rank 0 in epoch 2, rank 1 in a shard of epoch 1)."""
    first = stream(rank, name)
    records = read_on(first, rank, turns=cut, ordered=True)
    state = first.state_dict()  # every rank between the same two all-reduces
    read_on(first, rank, turns=LOST_TURNS, ordered=True)
    store = dist.FileStore(str(Path(os.environ[SHARDS_DIR], f"{name}-store")), 2) if new_store \
        else None
    again = stream(rank, name, store)
    again.load_state_dict(state)
    return {"records": records + read_on(again, rank, ordered=True), "state": state}


SCENARIOS = {
    "straight": straight,
    "resumed_in_the_same_store": lambda rank: resumed(rank, name="same", cut=2, new_store=False),
    "resumed_in_a_new_store": lambda rank: resumed(rank, name="new", cut=7, new_store=True),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    shards = tmp_path_factory.mktemp("shards")
    write_shards(shards)
    os.environ[SHARDS_DIR] = str(shards)  # the spawned ranks inherit it
    try:
        return run_ranks(tmp_path_factory.mktemp("shards_gloo"), __name__)
    finally:
        del os.environ[SHARDS_DIR]


def records_of(ranks: list[dict[str, Any]], name: str) -> list[list[Record]]:
    return [[(epoch, line) for epoch, line in result["records"]]
            for result in scenario(ranks, name)]


def test_two_ranks_read_every_line_once_per_epoch_and_the_fast_one_more_shards(ranks):
    records = records_of(ranks, "straight")
    assert_once_per_epoch(records)
    assert shards_read(records[0]) > shards_read(records[1]) > 0
    assert len(records[0]) == 3 * len(records[1])  # the schedule: three batches for one


def test_ranks_resumed_half_way_through_shards_read_every_line_once_per_epoch(ranks):
    name = "resumed_in_the_same_store"
    assert_once_per_epoch(records_of(ranks, name))
    states = [result["state"] for result in scenario(ranks, name)]
    assert [state["epoch"] for state in states] == [0, 0]
    assert all(state["offset"] for state in states)


def test_ranks_resumed_an_epoch_apart_in_a_new_store_read_every_line_once_per_epoch(ranks):
    name = "resumed_in_a_new_store"
    assert_once_per_epoch(records_of(ranks, name))
    states = [result["state"] for result in scenario(ranks, name)]
    assert [state["epoch"] for state in states] == [2, 1]  # epoch 1 claimed out, rank 1 in it
    assert states[1]["offset"]
