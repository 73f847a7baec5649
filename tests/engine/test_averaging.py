"""The Averager over a real 2-process gloo group (``file://`` rendezvous, no port).

Both workers are started once per module; each runs every scenario of the module's
``SCENARIOS`` on a fresh model and writes what it observed to ``rank<r>.json``, which the tests
read back. A scenario that raises records its traceback instead, so only its own test fails.
``test_averaging_dtypes.py`` runs its own scenarios through the same harness (``run_ranks``).

Rank 0's replica holds 1.0 everywhere and rank 1's 3.0, with weights 0.75 and 0.25, so the
average is 0.75 x 1 + 0.25 x 3 = 1.5 exactly in float32.
"""

from __future__ import annotations

import gc
import importlib
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

from fdl.engine import averaging
from fdl.engine.averaging import Averager, checksum
from fdl.engine.collectives import broadcast_from_rank0

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


def make_averager(model: nn.Module, rank: int, *, params: bool = True,
                  snapshot: bool = True) -> Averager:
    return Averager(model, rank=rank, world_size=WORLD_SIZE, backend="cpu",
                    device=torch.device("cpu"), num_stats=NUM_STATS, params=params,
                    snapshot=snapshot)


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


def lean_blocking_average(rank: int) -> dict[str, Any]:
    """A blocking average without a snapshot (cadence's): the same model and drift."""
    model = build_model(rank)
    averager = make_averager(model, rank, snapshot=False)
    kept = make_averager(build_model(rank), rank).memory_bytes()
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    averager.all_reduce(async_op=False)
    distance = averager.distance_from_average()
    averager.load_average()
    return {"floats": floats(model), "distance": distance, "checksum_after": checksum(model),
            "memory": averager.memory_bytes(), "memory_with_snapshot": kept,
            "numel": averager.numel}


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


def consensus_view(rank: int) -> dict[str, Any]:
    """Async's epoch end: the landed average in the model for a while (the evaluation), then
    the replica as it was, bit for bit, and the delta applied as usual. A bf16 model, whose
    residuals (what rounding dropped) must come back too."""
    model = build_model(rank).to(torch.bfloat16)
    averager = make_averager(model, rank)
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    work = averager.all_reduce(async_op=True)
    with torch.no_grad():
        for tensor in averager.tensors:
            tensor.add_(0.5 * (rank + 1))  # local progress while the average is in flight
        for residual in averager.residuals:
            residual.fill_(1e-4 * (rank + 1))
    local, owed = checksum(model), [r.tolist() for r in averager.residuals]
    work.wait()
    with averager.average_loaded():
        inside = {"checksum": checksum(model), "floats": floats(model),
                  "num_batches_tracked": int(model[1].num_batches_tracked)}
    after = {"checksum": checksum(model), "residuals": [r.tolist() for r in averager.residuals],
             "num_batches_tracked": int(model[1].num_batches_tracked)}
    return {"inside": inside, "after": after, "local": local, "owed": owed}


def buffers_only(rank: int) -> dict[str, Any]:
    model = build_model(rank)
    averager = make_averager(model, rank, params=False)
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    averager.all_reduce(async_op=False)
    averager.load_average()
    return {"params": floats(model, buffers=False), "buffers": floats(model, params=False),
            "numel": averager.numel, "num_float_buffers": len(floats(model, params=False)),
            "num_batches_tracked": int(model[1].num_batches_tracked)}


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather", "scatter",
               "barrier", "send", "recv", "isend", "irecv")


def counted_average(rank: int) -> dict[str, Any]:
    """A blocking average with every torch.distributed collective wrapped to log its calls."""
    model = build_model(rank)
    averager = make_averager(model, rank)
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in COLLECTIVES:
            setattr(dist, name, counting(name))
        averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
        averager.all_reduce(async_op=False)
        averager.distance_from_average()
        averager.load_average()
        averager.stats()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"calls": calls, "checksum": checksum(model),
            "num_batches_tracked": int(model[1].num_batches_tracked)}


def exchanged_in_parts(rank: int) -> dict[str, Any]:
    """A blocking average of random replicas whose exchange goes in messages of 5 values (the
    buffer holds 26: six messages, the last of one), beside gloo's all-reduce of the same
    packed buffer."""
    model = build_model(rank)
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    saved, averaging.EXCHANGE_FLOATS = averaging.EXCHANGE_FLOATS, 5
    try:
        averager = make_averager(model, rank)
    finally:
        averaging.EXCHANGE_FLOATS = saved
    averager.pack(weight=WEIGHTS[rank], stats=stats_row(rank), keep_snapshot=True)
    reduced = averager.flat.clone()
    dist.all_reduce(reduced)
    averager.all_reduce(async_op=False)
    return {"values": averager.flat.numel(), "message": averager.received[0].numel(),
            "as_all_reduce": torch.equal(averager.flat, reduced),
            "sum": averager.flat.tolist(), "stats": averager.stats()}


def subgroups(rank: int) -> dict[str, Any]:
    """Each rank alone in its own group: averaging and broadcasting over it must not mix in
    the other rank's values (they would over the default group)."""
    groups = [dist.new_group([r]) for r in range(WORLD_SIZE)]  # every rank creates every group
    own = groups[rank]
    model = build_model(rank)
    averager = Averager(model, rank=0, world_size=1, backend="cpu", device=torch.device("cpu"),
                        num_stats=NUM_STATS, group=own)
    averager.pack(weight=1.0, stats=stats_row(rank), keep_snapshot=True)
    averager.all_reduce(async_op=False)
    averager.load_average()
    broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                         via_host=True, group=own)
    return {"floats": floats(model), "stats": averager.stats(),
            "num_batches_tracked": int(model[1].num_batches_tracked)}


def broadcast(rank: int) -> dict[str, Any]:
    model = build_model(rank)
    broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                         via_host=True)
    return {"floats": floats(model), "num_batches_tracked": int(model[1].num_batches_tracked),
            "checksum": checksum(model)}


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "blocking": blocking_average, "async": async_average, "buffers_only": buffers_only,
    "lean_blocking": lean_blocking_average,
    "counted": counted_average, "exchanged_in_parts": exchanged_in_parts,
    "subgroups": subgroups, "broadcast": broadcast,
    "consensus_view": consensus_view}


def worker(rank: int, directory: str, module: str) -> None:
    # Before the group exists, as fdl.init does (fdl.engine.collectives): imported later (by a
    # scenario's first optimizer, through torch._dynamo) FSDP binds the group as a default
    # argument, its gloo threads outlive destroy_process_group, and the worker now and then
    # aborts at exit ("terminate called without an active exception"): seen in test_outer.
    import torch.distributed.fsdp  # noqa: F401

    dist.init_process_group("gloo", init_method=f"file://{directory}/rdzv", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=30))
    results: dict[str, Any] = {}
    try:
        for name, scenario in importlib.import_module(module).SCENARIOS.items():
            try:
                results[name] = scenario(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        Path(directory, f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
        gc.collect()  # what the scenarios left in reference cycles, while the group is alive
        dist.destroy_process_group()


def run_ranks(directory: Path, module: str) -> list[dict[str, Any]]:
    """Run ``module``'s SCENARIOS on WORLD_SIZE gloo workers; every rank's results."""
    mp.spawn(worker, args=(str(directory), module), nprocs=WORLD_SIZE, join=True)
    return [json.loads((directory / f"rank{r}.json").read_text(encoding="utf-8"))
            for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("averaging"), __name__)


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


def test_without_a_snapshot_the_average_and_the_drift_are_the_same_in_less_memory(ranks):
    """cadence keeps no snapshot (only async applies average - snapshot): the same bits, the
    same drift for the guard, measured from the replica before the average lands, and
    4 bytes a value less in fdl's buffers (on the GPU under nccl; host memory here)."""
    for full, lean in zip(scenario(ranks, "blocking"), scenario(ranks, "lean_blocking"),
                          strict=True):
        assert lean["checksum_after"] == full["checksum_after"]
        assert lean["distance"] == pytest.approx(full["distance"], rel=1e-6)
        (device, host), (_, host_kept) = lean["memory"], lean["memory_with_snapshot"]
        assert device == 0 and host_kept - host == 4 * lean["numel"]


def test_async_average_keeps_the_progress_made_while_it_was_in_flight(ranks):
    for result in scenario(ranks, "async"):
        assert all(value == AVERAGE + result["delta"] for value in result["floats"])
        # apply_delta leaves integer buffers alone (they are reduced at blocking averages)
    assert [r["num_batches_tracked"] for r in scenario(ranks, "async")] == \
        list(NUM_BATCHES_TRACKED)


def test_an_epoch_end_under_async_sees_the_consensus_and_then_its_own_replica_again(ranks):
    first, second = scenario(ranks, "consensus_view")
    assert first["inside"]["checksum"] == second["inside"]["checksum"]  # the consensus
    assert all(value == AVERAGE for value in first["inside"]["floats"])
    assert first["inside"]["num_batches_tracked"] == max(NUM_BATCHES_TRACKED)
    for rank, result in enumerate((first, second)):  # then the replica, exactly as it was
        assert result["after"]["checksum"] == result["local"] != result["inside"]["checksum"]
        assert result["after"]["residuals"] == result["owed"]
        assert result["after"]["num_batches_tracked"] == NUM_BATCHES_TRACKED[rank]


def test_params_false_averages_buffers_and_leaves_parameters_alone(ranks):
    for rank, result in enumerate(scenario(ranks, "buffers_only")):
        assert result["numel"] == result["num_float_buffers"] == 4
        assert all(value == VALUES[rank] for value in result["params"])
        assert all(value == AVERAGE for value in result["buffers"])
        assert result["num_batches_tracked"] == max(NUM_BATCHES_TRACKED)


def test_a_blocking_average_of_two_ranks_is_one_exchange(ranks):
    """Each rank sends its buffer and receives the other's (fdl.engine.averaging says what
    it saves), the receive posted first (sent first, the exchange took twice the
    all-reduce's time on a capped link)."""
    first, second = scenario(ranks, "counted")
    assert first["calls"] == second["calls"] == ["irecv", "isend"]
    # integer buffers rode along in that one exchange: max taken, replicas bitwise equal
    assert first["num_batches_tracked"] == second["num_batches_tracked"] == \
        max(NUM_BATCHES_TRACKED)
    assert first["checksum"] == second["checksum"]


def test_the_exchange_in_parts_sums_the_same_bits_as_an_all_reduce_on_both_ranks(ranks):
    first, second = scenario(ranks, "exchanged_in_parts")
    assert first["values"] == second["values"] == 26
    assert first["message"] == second["message"] == 5
    assert first["as_all_reduce"] and second["as_all_reduce"]
    assert first["sum"] == second["sum"]
    assert first["stats"] == second["stats"] == [stats_row(0), stats_row(1)]


def test_averaging_and_broadcast_run_over_the_given_group(ranks):
    for rank, result in enumerate(scenario(ranks, "subgroups")):
        assert all(value == VALUES[rank] for value in result["floats"])
        assert result["num_batches_tracked"] == NUM_BATCHES_TRACKED[rank]
        assert result["stats"] == [stats_row(rank)]


def test_broadcast_from_rank0_gives_every_rank_rank0s_values(ranks):
    first, second = scenario(ranks, "broadcast")
    assert all(value == VALUES[0] for value in second["floats"])
    assert second["num_batches_tracked"] == NUM_BATCHES_TRACKED[0]
    assert first["checksum"] == second["checksum"]


def test_checksum_is_a_function_of_the_bits():
    model = build_model(0)
    assert checksum(model) == checksum(build_model(0))
    assert checksum(model) != checksum(build_model(1))
    with torch.no_grad():
        model[0].weight[0, 0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert checksum(model) != checksum(build_model(0))


def test_a_module_added_after_training_started_is_named_not_left_unaveraged():
    """A head added to the model after the first step was never averaged and never mentioned:
    each rank's copy drifted apart. The boundary checks the model against what the averager
    was built on before every average (fdl.engine.boundary.Boundary.average)."""
    from fdl.errors import UsageError

    model = nn.Sequential(nn.Linear(4, 4))
    averager = Averager(model, rank=0, world_size=1, backend="cpu", device=torch.device("cpu"),
                        num_stats=1)
    averager.check_unchanged(model)  # as built: nothing to say
    model.append(nn.BatchNorm1d(4))  # 2 parameters and 2 floating-point buffers more
    with pytest.raises(UsageError, match=r"the model changed during training: it holds 4 "
                                         r"parameter and 2 buffer tensors, 2 and 0 when") as told:
        averager.check_unchanged(model)
    assert "before run.batches" in told.value.hint
