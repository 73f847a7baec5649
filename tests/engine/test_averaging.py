"""The Averager over a real 2-process gloo group (``file://`` rendezvous, no port).

Both workers are started once per module; each runs every scenario on a fresh model and
writes what it observed to ``rank<r>.json``, which the tests below read back. A scenario that
raises records its traceback instead, so only its own test fails.

Rank 0's replica holds 1.0 everywhere and rank 1's 3.0, with weights 0.75 and 0.25, so the
average is 0.75 x 1 + 0.25 x 3 = 1.5 exactly in float32.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fdl.engine.averaging import Averager, checksum

WORLD_SIZE = 2
VALUES = (1.0, 3.0)
WEIGHTS = (0.75, 0.25)
AVERAGE = 1.5
NUM_BATCHES_TRACKED = (5, 7)
NUM_STATS = 3


def build_model(rank: int) -> nn.Module:
    """Linear(3, 2) + BatchNorm1d(2): parameters, float buffers and an int buffer, every
    float set to this rank's value."""
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(VALUES[rank])
        model[1].num_batches_tracked.fill_(NUM_BATCHES_TRACKED[rank])
    return model


def make_averager(model: nn.Module, rank: int, *, params: bool = True) -> Averager:
    return Averager(model, rank=rank, world_size=WORLD_SIZE, backend="cpu",
                    device=torch.device("cpu"), num_stats=NUM_STATS, params=params)


def stats_row(rank: int) -> list[float]:
    return [10.0 * rank + 1, 10.0 * rank + 2, 10.0 * rank + 3]


def floats(module: nn.Module, *, buffers: bool = True, params: bool = True) -> list[float]:
    tensors = ([*module.parameters()] if params else []) + (
        [b for b in module.buffers() if b.is_floating_point()] if buffers else [])
    return [value for tensor in tensors for value in tensor.detach().reshape(-1).tolist()]


def blocking_average(rank: int) -> dict[str, Any]:
    model = build_model(rank)
    before = checksum(model)
    averager = make_averager(model, rank)
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    assert averager.all_reduce(async_op=False) is None
    distance = averager.distance_from_average()
    snapshot = averager.snapshot.tolist()
    averaged = averager.flat[:averager.numel].tolist()
    averager.load_average()
    return {"floats": floats(model), "num_batches_tracked": int(model[1].num_batches_tracked),
            "stats": averager.stats(), "numel": averager.numel, "distance": distance,
            "snapshot": snapshot, "averaged": averaged, "checksum_before": before,
            "checksum_after": checksum(model)}


def async_average(rank: int) -> dict[str, Any]:
    model = build_model(rank)
    averager = make_averager(model, rank)
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    work = averager.all_reduce(async_op=True)
    delta = 0.5 * (rank + 1)  # local progress made while the average is in flight
    with torch.no_grad():
        for tensor in averager.tensors:
            tensor.add_(delta)
    work.wait()
    averager.apply_delta()
    return {"floats": floats(model), "delta": delta, "stats": averager.stats(),
            "num_batches_tracked": int(model[1].num_batches_tracked)}


def buffers_only(rank: int) -> dict[str, Any]:
    model = build_model(rank)
    averager = make_averager(model, rank, params=False)
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    averager.all_reduce(async_op=False)
    averager.load_average()
    return {"params": floats(model, buffers=False), "buffers": floats(model, params=False),
            "numel": averager.numel, "num_float_buffers": len(floats(model, params=False)),
            "num_batches_tracked": int(model[1].num_batches_tracked)}


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "blocking": blocking_average, "async": async_average, "buffers_only": buffers_only}


def worker(rank: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rdzv", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=30))
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        Path(directory, f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("averaging")
    mp.spawn(worker, args=(str(directory),), nprocs=WORLD_SIZE, join=True)
    return [json.loads((directory / f"rank{r}.json").read_text(encoding="utf-8"))
            for r in range(WORLD_SIZE)]


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [result[name] for result in ranks]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


def test_blocking_average_loads_the_weighted_average_exactly(ranks):
    for result in scenario(ranks, "blocking"):
        # Linear weight and bias, BatchNorm weight, bias, running mean and running var
        assert len(result["floats"]) == 3 * 2 + 2 + 2 + 2 + 2 + 2
        assert result["numel"] == len(result["floats"])
        assert all(value == AVERAGE for value in result["floats"])


def test_blocking_average_takes_the_max_of_integer_buffers(ranks):
    for result in scenario(ranks, "blocking"):
        assert result["num_batches_tracked"] == max(NUM_BATCHES_TRACKED)


def test_every_rank_gets_every_ranks_stats_row(ranks):
    expected = [stats_row(r) for r in range(WORLD_SIZE)]
    for name in ("blocking", "async"):
        for result in scenario(ranks, name):
            assert result["stats"] == expected, name


def test_checksums_differ_before_and_agree_after_a_blocking_average(ranks):
    first, second = scenario(ranks, "blocking")
    assert first["checksum_before"] != second["checksum_before"]
    assert first["checksum_after"] == second["checksum_after"]
    assert first["checksum_after"] != first["checksum_before"]


def test_distance_from_average_is_the_relative_drift_of_the_snapshot(ranks):
    for rank, result in enumerate(scenario(ranks, "blocking")):
        snapshot, averaged = result["snapshot"], result["averaged"]
        assert all(value == VALUES[rank] for value in snapshot)  # unweighted replica
        assert all(value == AVERAGE for value in averaged)
        by_hand = math.dist(snapshot, averaged) / math.hypot(*averaged)
        assert result["distance"] == pytest.approx(by_hand, rel=1e-6)
        assert result["distance"] == pytest.approx(abs(VALUES[rank] - AVERAGE) / AVERAGE,
                                                   rel=1e-6)


def test_async_average_keeps_the_progress_made_while_it_was_in_flight(ranks):
    for result in scenario(ranks, "async"):
        assert all(value == AVERAGE + result["delta"] for value in result["floats"])
        # apply_delta leaves integer buffers alone (they are reduced at blocking averages)
    assert [r["num_batches_tracked"] for r in scenario(ranks, "async")] == \
        list(NUM_BATCHES_TRACKED)


def test_params_false_averages_buffers_and_leaves_parameters_alone(ranks):
    for rank, result in enumerate(scenario(ranks, "buffers_only")):
        assert result["numel"] == result["num_float_buffers"] == 4
        assert all(value == VALUES[rank] for value in result["params"])
        assert all(value == AVERAGE for value in result["buffers"])
        assert result["num_batches_tracked"] == max(NUM_BATCHES_TRACKED)


def test_checksum_is_a_function_of_the_bits():
    model = build_model(0)
    assert checksum(model) == checksum(build_model(0))
    assert checksum(model) != checksum(build_model(1))
    with torch.no_grad():
        model[0].weight[0, 0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert checksum(model) != checksum(build_model(0))
