"""bf16 on the wire (``--average-dtype bf16``): the parameters travel as bf16 displacements from
the last average, each rank's rounding error carried to its next average. Two-rank scenarios
on the gloo harness of ``test_averaging.py``: many blocking averages of a model whose replicas
move apart by different small steps each round, beside the exact float32 average of the same
replicas, and an async average with progress made while it was in flight."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_averaging import WORLD_SIZE, run_ranks, scenario
from torch import nn

from fdl.engine.averaging import Averager, checksum

WEIGHTS = (0.7, 0.3)
ROUNDS = 40
STEP = 1e-3  # a round's displacement, beside parameters of order 0.1


def build(rank: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """The same model on both ranks (seeded), and this rank's displacement for each round."""
    model = nn.Linear(64, 48)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    numel = sum(p.numel() for p in model.parameters())
    return model, [torch.randn(numel, generator=generator) * STEP for _ in range(ROUNDS)]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(WORLD_SIZE)]
    dist.all_gather(out, tensor)
    return out


def averager(model: nn.Module, rank: int, wire: str, *, snapshot: bool = False) -> Averager:
    return Averager(model, rank=rank, world_size=WORLD_SIZE, backend="cpu",
                    device=torch.device("cpu"), num_stats=1, snapshot=snapshot, wire=wire)


def blocking_rounds(rank: int) -> dict[str, Any]:
    """Each round: every replica moves by its own displacement, then a blocking bf16-wire
    average; the exact float32 average of the same replicas is computed beside it."""
    model, steps = build(rank)
    wire = averager(model, rank, "bf16")
    exact = flat(model).clone()  # the exact trajectory: float32 averages of the same moves
    worst_gap = 0.0
    for step in steps:
        replicas = gathered(step)
        exact = exact + sum(w * s for w, s in zip(WEIGHTS, replicas, strict=True))
        load(model, flat(model) + step)
        wire.pack(weight=WEIGHTS[rank], stats=[1.0], keep_snapshot=False)
        wire.all_reduce(async_op=False)
        wire.load_average()
        worst_gap = max(worst_gap, float((flat(model) - exact).abs().max()))
    owed = sum(gathered(wire.wire_error.clone()))  # what both ranks still carry
    return {"gap": (flat(model) - exact).tolist(), "owed": owed.tolist(),
            "worst_gap": worst_gap, "checksum": checksum(model),
            "bytes": wire.bytes, "fp32_bytes": averager(model, rank, "fp32").bytes,
            "numel": wire.numel, "memory": list(wire.memory_bytes())}


def async_round(rank: int) -> dict[str, Any]:
    """An async average: launched, local progress made while it flies, then waited for and
    applied as ``theta += average - snapshot``."""
    model, steps = build(rank)
    wire = averager(model, rank, "bf16", snapshot=True)
    load(model, flat(model) + steps[0])
    packed = flat(model).clone()
    exact = sum(w * p for w, p in zip(WEIGHTS, gathered(packed), strict=True))
    wire.pack(weight=WEIGHTS[rank], stats=[1.0], keep_snapshot=True)
    pending = wire.all_reduce(async_op=True)
    load(model, flat(model) + steps[1])  # progress while the average is in flight
    pending.wait()
    wire.apply_delta()
    return {"gap": float((flat(model) - (exact + steps[1])).abs().max())}


SCENARIOS = {"blocking_rounds": blocking_rounds, "async_round": async_round}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("wire"), __name__)


def test_every_rank_holds_the_same_bits_after_each_bf16_average(ranks):
    first, second = scenario(ranks, "blocking_rounds")
    assert first["checksum"] == second["checksum"]


def test_rounding_errors_are_carried_not_accumulated(ranks):
    """After 40 averages the model differs from the exact float32 trajectory by exactly what
    the ranks still owe (error feedback: each rounding error arrives one average late), never
    by a sum of 40 roundings; the gap is a fraction of one round's displacement."""
    for result in scenario(ranks, "blocking_rounds"):
        gap, owed = torch.tensor(result["gap"]), torch.tensor(result["owed"])
        # atol: float32 rounding of both trajectories over 40 rounds (a bf16 sum: 3e-5)
        assert torch.allclose(gap, -owed, atol=1e-6), float((gap + owed).abs().max())
        assert result["worst_gap"] < STEP / 20  # bf16 keeps 8 bits of a displacement


def test_bf16_on_the_wire_sends_half_the_bytes(ranks):
    for result in scenario(ranks, "blocking_rounds"):
        tail = result["fp32_bytes"] - 4 * result["numel"]  # the float32 rows (stats)
        assert result["bytes"] == 2 * result["numel"] + tail
        # fdl's memory grows by the reference (4 B/value), the bf16 buffer (2), the error (4)
        # and every rank's bf16 displacements (2 each)
        assert result["memory"][1] == result["fp32_bytes"] + 14 * result["numel"]


def test_an_async_bf16_average_keeps_the_progress_made_in_flight(ranks):
    for result in scenario(ranks, "async_round"):
        assert result["gap"] < STEP / 20
