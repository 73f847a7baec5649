"""The Averager is exact in the model's dtype: float64 averaged in float64, bf16 deltas smaller
than half an ulp kept by the residual, integer buffers carried exactly inside the one
collective. Two-rank scenarios run on the gloo harness of ``test_averaging.py``; the refusals
need no process group.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_averaging import WORLD_SIZE, run_ranks, scenario
from torch import nn

from fdl.engine.averaging import Averager, checksum
from fdl.errors import FdlError

WEIGHTS = (0.75, 0.25)
#: float64 values whose float32 roundings are equal (1.0): only a float64 buffer tells them apart
FLOAT64_VALUES = (1.0, 1.0 + 2**-40)
#: per rank: num_batches_tracked and a signed int64 buffer, at and near the float32 limit (2**48)
#: and beyond float32's 2**24, where a single float32 would round them
INTEGERS = ((2**40 + 3, [2**48, -(2**48), 7]), (2**40 + 1, [5, -(2**48) + 1, -(2**30) - 1]))
#: float64 carries integers up to 2**53 directly
FLOAT64_INTEGERS = (2**53, 2**50 + 1)
#: bf16: every average lands 2**-12 (relative) above the replica, 1/32 of bf16's ulp at 1.0
EPSILON = 2**-12
NUM_ASYNC_ROUNDS = 256
BF16_ULP_AT_ONE = 2**-7


def model_with_integers(*, num_batches_tracked: int, counts: list[int],
                        dtype: torch.dtype = torch.float32) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(dtype)
    model.register_buffer("counts", torch.tensor(counts, dtype=torch.int64))
    model[1].num_batches_tracked.fill_(num_batches_tracked)
    return model


def averager(model: nn.Module, rank: int = 0, world_size: int = WORLD_SIZE) -> Averager:
    return Averager(model, rank=rank, world_size=world_size, backend="cpu",
                    device=torch.device("cpu"), num_stats=1)


def blocking(model: nn.Module, rank: int, weight: float) -> Averager:
    result = averager(model, rank)
    result.pack(weight=weight, stats=[float(rank)], keep_snapshot=True)
    result.all_reduce(async_op=False)
    result.load_average()
    return result


def float64_average(rank: int) -> dict[str, Any]:
    model = model_with_integers(num_batches_tracked=FLOAT64_INTEGERS[rank], counts=[rank],
                                dtype=torch.float64)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(FLOAT64_VALUES[rank])
    used = blocking(model, rank, WEIGHTS[rank])
    values = [v for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()
              for v in t.reshape(-1).tolist()]
    return {"values": [value.hex() for value in values], "dtype": str(used.flat.dtype),
            "num_batches_tracked": int(model[1].num_batches_tracked),
            "checksum": checksum(model)}


def integer_rows(rank: int) -> dict[str, Any]:
    num_batches_tracked, counts = INTEGERS[rank]
    model = model_with_integers(num_batches_tracked=num_batches_tracked, counts=counts)
    used = blocking(model, rank, WEIGHTS[rank])
    return {"num_batches_tracked": int(model[1].num_batches_tracked),
            "counts": model.counts.tolist(), "dtype": str(used.flat.dtype),
            "stats": used.stats(), "checksum": checksum(model)}


def bf16_async(rank: int) -> dict[str, Any]:
    """Identical bf16 replicas at 1.0; weights summing to 1 + EPSILON make each async delta
    about EPSILON x theta, far under half an ulp, so bf16 rounding alone would keep 1.0."""
    model = nn.Linear(4, 2).to(torch.bfloat16)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.fill_(1.0)
    used = averager(model, rank)
    weight = 0.5 + EPSILON if rank == 0 else 0.5
    deltas = []
    for _ in range(NUM_ASYNC_ROUNDS):
        used.pack(weight=weight, stats=[float(rank)], keep_snapshot=True)
        used.all_reduce(async_op=True).wait()
        deltas.append(float((used.flat[:used.numel] - used.snapshot).max()))
        used.apply_delta()
    return {"values": [float(v) for t in model.parameters() for v in t.reshape(-1)],
            "deltas": deltas, "dtype": str(used.flat.dtype)}


SCENARIOS = {"float64": float64_average, "integers": integer_rows, "bf16": bf16_async}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("averaging_dtypes"), __name__)


def test_a_float64_model_is_averaged_exactly_in_float64(ranks):
    expected = WEIGHTS[0] * FLOAT64_VALUES[0] + WEIGHTS[1] * FLOAT64_VALUES[1]
    assert expected != 1.0  # what a float32 buffer would have produced
    first, second = scenario(ranks, "float64")
    for result in (first, second):
        assert result["dtype"] == "torch.float64"
        assert result["values"] and set(result["values"]) == {expected.hex()}
        assert result["num_batches_tracked"] == max(FLOAT64_INTEGERS)
    assert first["checksum"] == second["checksum"]


def test_integer_buffers_travel_exactly_in_float32_halves(ranks):
    expected_counts = [max(pair) for pair in zip(INTEGERS[0][1], INTEGERS[1][1], strict=True)]
    first, second = scenario(ranks, "integers")
    for result in (first, second):
        assert result["dtype"] == "torch.float32"
        assert result["num_batches_tracked"] == max(INTEGERS[0][0], INTEGERS[1][0])
        assert result["counts"] == expected_counts
        assert result["stats"] == [[0.0], [1.0]]  # the rows after the integers are intact
    assert first["checksum"] == second["checksum"]


def test_bf16_deltas_under_half_an_ulp_add_up(ranks):
    for result in scenario(ranks, "bf16"):
        assert result["dtype"] == "torch.float32"
        deltas = result["deltas"]
        # each delta alone rounds away when added to a bf16 value in [1, 2)
        assert 0 < max(deltas) < BF16_ULP_AT_ONE / 2
        exact = 1.0 + math.fsum(deltas)
        assert exact - 1.0 > 4 * BF16_ULP_AT_ONE  # ... yet together they move it 4+ ulps
        for value in result["values"]:
            assert abs(value - exact) <= BF16_ULP_AT_ONE


@pytest.mark.parametrize(("dtype", "expected"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32), (torch.float64, torch.float64)])
def test_the_buffer_is_float64_only_for_a_float64_model(dtype, expected):
    used = averager(nn.Linear(3, 2).to(dtype))
    assert used.flat.dtype == used.snapshot.dtype == expected
    assert used.bytes == used.flat.numel() * expected.itemsize


def test_one_float64_tensor_makes_the_buffer_float64():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1).double())
    assert averager(model).flat.dtype == torch.float64


@pytest.mark.parametrize(("dtype", "limit"), [(torch.float32, 2**48), (torch.float64, 2**53)])
def test_integers_beyond_the_exact_range_are_refused_at_construction(dtype, limit):
    averager(model_with_integers(num_batches_tracked=limit, counts=[-limit], dtype=dtype))
    for too_large in (limit + 1, -limit - 1):
        model = model_with_integers(num_batches_tracked=0, counts=[1, too_large], dtype=dtype)
        with pytest.raises(FdlError, match=rf"'counts' holds {abs(too_large)}.*"
                                           rf"\|value\| <= 2\*\*{limit.bit_length() - 1}"):
            averager(model)


def test_an_integer_that_outgrows_the_range_is_refused_at_pack():
    model = model_with_integers(num_batches_tracked=0, counts=[0])
    used = averager(model)
    model[1].num_batches_tracked.fill_(2**48 + 1)
    with pytest.raises(FdlError, match=r"'1\.num_batches_tracked' holds"):
        used.pack(weight=1.0, stats=[0.0], keep_snapshot=False)
