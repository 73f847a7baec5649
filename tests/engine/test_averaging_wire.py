"""bf16, int8 and int4 on the wire (``--average-dtype bf16|int8|int4``): the parameters travel
as displacements from the last average (bf16 values, or integer codes with a float32 scale per
block), each rank's rounding error carried to its next average. Two-rank scenarios on the gloo
harness of ``test_averaging.py``, for each encoding: many blocking averages of a model whose
replicas move apart by different small steps each round, beside the exact float32 average of
the same replicas, then a few averages with no step (what is owed arrives); an async average
with progress made while it was in flight; and for int8 (int4 shares its code), a block of
zeros and a replica that blew up."""

from __future__ import annotations

import hashlib
import math
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_averaging import WORLD_SIZE, run_ranks, scenario
from torch import nn

from fdl.engine.averaging import Averager, checksum
from fdl.engine.wire import WIRE_BLOCK, WIRE_ENCODINGS, value_bytes

WEIGHTS = (0.7, 0.3)
ROUNDS = 40
SETTLE = 4  # averages with no step after the ROUNDS: what the ranks owe arrives
STEP = 1e-3  # a round's displacement, beside parameters of order 0.1
WIRES = ("bf16", "int8", "int4")
#: how far the model may trail the exact trajectory: what two ranks owe, each at most half a
#: rounding step of a displacement of a few STEPs (bf16: 2**-9 of a value; int8: 1/254 of its
#: block's largest value; int4: 1/14 of it), a fraction of one round's displacement
WORST_GAP = {"bf16": STEP / 20, "int8": STEP / 20, "int4": STEP / 2}


def build(rank: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """The same model on both ranks (seeded), and this rank's displacement for each round.
    3,120 parameters: int8's last block is short."""
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


def average(wire: Averager, rank: int) -> None:
    """A blocking average, loaded."""
    wire.pack(weight=WEIGHTS[rank], stats=[1.0], keep_snapshot=False)
    wire.all_reduce(async_op=False)
    wire.load_average()


def blocking_rounds(rank: int, wire_dtype: str) -> dict[str, Any]:
    """Each round: every replica moves by its own displacement, then a blocking average on the
    wire; the exact float32 average of the same replicas is computed beside it. Then SETTLE
    averages with no step."""
    model, steps = build(rank)
    wire = averager(model, rank, wire_dtype)
    exact = flat(model).clone()  # the exact trajectory: float32 averages of the same moves
    worst_gap = 0.0
    for step in steps:
        replicas = gathered(step)
        exact = exact + sum(w * s for w, s in zip(WEIGHTS, replicas, strict=True))
        load(model, flat(model) + step)
        average(wire, rank)
        worst_gap = max(worst_gap, float((flat(model) - exact).abs().max()))
    gap = flat(model) - exact
    owed = sum(gathered(wire.wire.error[:wire.numel].clone()))  # what both ranks still carry
    for _ in range(SETTLE):
        average(wire, rank)
    return {"gap": gap.tolist(), "owed": owed.tolist(), "worst_gap": worst_gap,
            "settled_gap": float((flat(model) - exact).abs().max()),
            "checksum": checksum(model), "bytes": wire.bytes,
            "fp32_bytes": averager(model, rank, "fp32").bytes,
            "numel": wire.numel, "memory": list(wire.memory_bytes())}


def async_round(rank: int, wire_dtype: str) -> dict[str, Any]:
    """An async average: launched, local progress made while it flies, then waited for and
    applied as ``theta += average - snapshot``."""
    model, steps = build(rank)
    wire = averager(model, rank, wire_dtype, snapshot=True)
    load(model, flat(model) + steps[0])
    packed = flat(model).clone()
    exact = sum(w * p for w, p in zip(WEIGHTS, gathered(packed), strict=True))
    wire.pack(weight=WEIGHTS[rank], stats=[1.0], keep_snapshot=True)
    pending = wire.all_reduce(async_op=True)
    load(model, flat(model) + steps[1])  # progress while the average is in flight
    pending.wait()
    wire.apply_delta()
    return {"gap": float((flat(model) - (exact + steps[1])).abs().max())}


def int8_edges(rank: int) -> dict[str, Any]:
    """int8: block 0 does not move on either rank (zeros: scale 0) in a first average; in a
    second, rank 1 has blown up: an inf in block 1, a NaN in block 2 (block 3, the short one,
    stays finite)."""
    model, steps = build(rank)
    before = flat(model).clone()
    wire = averager(model, rank, "int8")
    step = steps[0].clone()
    step[:WIRE_BLOCK] = 0
    load(model, before + step)
    average(wire, rank)
    encoded = wire.wire
    codes, scales = encoded.encoding.codes(encoded.sent), encoded.encoding.scales(encoded.sent)
    calm = {"block0_exact": bool(torch.equal(flat(model)[:WIRE_BLOCK], before[:WIRE_BLOCK])),
            "block0_scale": float(scales[0]), "block0_codes": int(codes[0].abs().max()),
            "finite": bool(flat(model).isfinite().all())}
    blown = flat(model) + step
    if rank == 1:
        blown[WIRE_BLOCK + 5], blown[2 * WIRE_BLOCK + 7] = math.inf, math.nan
    load(model, blown)
    wire.pack(weight=WEIGHTS[rank], stats=[1.0], keep_snapshot=False)
    wire.all_reduce(async_op=False)
    landed = wire.flat[:wire.numel].clone()
    blocks = [landed[b * WIRE_BLOCK:(b + 1) * WIRE_BLOCK] for b in range(4)]
    return {**calm, "nan_blocks": [bool(b.isnan().all()) for b in blocks],
            "finite_blocks": [bool(b.isfinite().all()) for b in blocks],
            "distance": wire.distance_from_average(),
            "landed": hashlib.sha256(landed.numpy().tobytes()).hexdigest()}


SCENARIOS = {**{f"blocking_rounds_{w}": partial(blocking_rounds, wire_dtype=w) for w in WIRES},
             **{f"async_round_{w}": partial(async_round, wire_dtype=w) for w in WIRES},
             "int8_edges": int8_edges}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("wire"), __name__)


@pytest.mark.parametrize("wire", WIRES)
def test_every_rank_holds_the_same_bits_after_each_average(ranks, wire):
    first, second = scenario(ranks, f"blocking_rounds_{wire}")
    assert first["checksum"] == second["checksum"]


@pytest.mark.parametrize("wire", WIRES)
def test_rounding_errors_are_carried_not_accumulated(ranks, wire):
    """After 40 averages the model differs from the exact float32 trajectory by exactly what
    the ranks still owe (error feedback: each rounding error arrives one average late), never
    by a sum of 40 roundings; the gap is a fraction of one round's displacement."""
    for result in scenario(ranks, f"blocking_rounds_{wire}"):
        gap, owed = torch.tensor(result["gap"]), torch.tensor(result["owed"])
        # atol: float32 rounding of both trajectories over 40 rounds (a bf16 sum: 3e-5)
        assert torch.allclose(gap, -owed, atol=1e-6), float((gap + owed).abs().max())
        assert float(owed.abs().max()) > 1e-6  # something is owed: the check above bites
        assert result["worst_gap"] < WORST_GAP[wire]


@pytest.mark.parametrize("wire", WIRES)
def test_averages_with_no_step_deliver_what_is_owed(ranks, wire):
    """Once the replicas stop moving, each average sends what the last one dropped (and drops
    a small fraction of that again): a few land the exact float32 mean, to float32 rounding."""
    for result in scenario(ranks, f"blocking_rounds_{wire}"):
        assert result["settled_gap"] < 1e-6, result["settled_gap"]


def test_bf16_on_the_wire_sends_half_the_bytes(ranks):
    for result in scenario(ranks, "blocking_rounds_bf16"):
        tail = result["fp32_bytes"] - 4 * result["numel"]  # the float32 rows (stats)
        assert result["bytes"] == 2 * result["numel"] + tail
        # fdl's memory grows by the reference (4 B/value), the bf16 buffer (2), the error (4)
        # and every rank's bf16 displacements (2 each)
        assert result["memory"][1] == result["fp32_bytes"] + 14 * result["numel"]


@pytest.mark.parametrize(("wire", "per_byte"), [("int8", 1), ("int4", 2)])
def test_int8_and_int4_send_their_codes_and_a_scale_a_block(ranks, wire, per_byte):
    for result in scenario(ranks, f"blocking_rounds_{wire}"):
        numel = result["numel"]
        num_blocks = -(-numel // WIRE_BLOCK)
        padded = num_blocks * WIRE_BLOCK
        assert padded > numel  # the last block is short: its padding is counted
        sent = padded // per_byte + 4 * num_blocks  # the codes, float32 scales
        assert sent == value_bytes(wire) * padded  # what the simulator's link model charges
        tail = result["fp32_bytes"] - 4 * numel  # the float32 rows (stats)
        assert result["bytes"] == sent + tail
        # fdl's memory grows by the reference (4 B/value), the buffer sent, the error (4 B a
        # padded value) and every rank's gathered buffer
        assert result["memory"][1] == (result["fp32_bytes"] + 4 * numel + sent + 4 * padded
                                       + WORLD_SIZE * sent)


@pytest.mark.parametrize("wire", WIRES)
def test_an_async_average_keeps_the_progress_made_in_flight(ranks, wire):
    for result in scenario(ranks, f"async_round_{wire}"):
        assert result["gap"] < WORST_GAP[wire]


def test_an_int8_block_of_zeros_sends_scale_zero_and_lands_the_reference_exactly(ranks):
    for result in scenario(ranks, "int8_edges"):
        assert result["block0_scale"] == 0 and result["block0_codes"] == 0
        assert result["block0_exact"] and result["finite"]


def test_an_int8_average_of_a_blown_up_replica_is_nan_where_it_blew_up(ranks):
    """An inf or a NaN in rank 1's displacement: that block's scale is not finite, so the
    landed block is NaN on every rank (the same bits), and the divergence guard's distance
    reads NaN."""
    first, second = scenario(ranks, "int8_edges")
    for result in (first, second):
        assert result["nan_blocks"] == [False, True, True, False]
        assert result["finite_blocks"] == [True, False, False, True]
        assert math.isnan(result["distance"])
    assert first["landed"] == second["landed"]


@pytest.mark.parametrize(("wire", "levels"), [("int8", 127), ("int4", 7)])
def test_codes_are_within_half_a_scale_step_and_the_error_is_the_rest(wire, levels):
    """One encoding, no collective: codes in [-levels, levels], each decoded value within half
    its block's scale of the value, a block of small values on its own scale, a block of zeros
    on scale 0, and decoded + error = the value."""
    numel = 2 * WIRE_BLOCK + 10
    encoding = WIRE_ENCODINGS[wire](numel)
    values = torch.zeros(encoding.padded_numel)
    values[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    values[WIRE_BLOCK:2 * WIRE_BLOCK] *= 1e-4
    values[2 * WIRE_BLOCK:numel] = 0  # the short last block: zeros
    original = values[:numel].clone()
    sent = encoding.empty(device=torch.device("cpu"), pinned=False)
    encoding.encode(values, sent)
    codes, scales = encoding.codes(sent), encoding.scales(sent)
    decoded = torch.zeros(numel)
    encoding.add_decoded(decoded, sent)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == levels
    assert int(codes.min()) == -levels  # both signs survive the packing
    step = scales.expand(-1, WIRE_BLOCK).reshape(-1)[:numel]
    assert float(step[WIRE_BLOCK]) < 1e-3 * float(step[0])  # each block its own scale
    assert float(scales[2]) == 0 and int(codes[2].abs().max()) == 0  # zeros: no 0 / 0
    assert bool(((decoded - original).abs() <= step / 2 * (1 + 1e-5)).all())
    assert torch.equal(decoded + values[:numel], original)
    assert bool((values[numel:] == 0).all())  # the padding owes nothing
