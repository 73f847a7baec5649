"""The outer optimizer (fdl.engine.outer): Nesterov momentum on each average's displacement.

Its maths against the formula worked by hand, its checkpoint state (continuation exact, a torn
or hostile state refused), and, on the 2-process gloo harness of ``test_averaging.py``, the
Averager stepping the parameters' average and only that: both replicas start alike at 1.0,
rank r then moves every value by ``MOVES[r]``; with weights 0.75 and 0.25 the plain average
is 0.75 above the last consensus, every round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_averaging import WORLD_SIZE, run_ranks, scenario
from torch import nn

from fdl.engine.averaging import Averager, checksum
from fdl.engine.outer import OuterOptimizer
from fdl.errors import UsageError

LR, MOMENTUM = 0.5, 0.5
WEIGHTS = (0.75, 0.25)
MOVES = (0.5, 1.5)
#: the consensus after each of two averages, worked by hand from C0 = 1 and A - C = 0.75:
#: v1 = -0.75, C1 = 1 + 0.5 x (0.75 + 0.5 x 0.75) = 1.5625; v2 = 0.5 x v1 - 0.75 = -1.125,
#: C2 = 1.5625 + 0.5 x (0.75 + 0.5 x 1.125) = 2.21875 (all exact in float32 and bf16)
CONSENSUS = (1.5625, 2.21875)
#: the buffers' plain averages: 1 + 0.75, then 1.75 + 0.75
BUFFERS = (1.75, 2.5)
CPU = torch.device("cpu")


def outer(numel: int = 4, **kwargs: Any) -> OuterOptimizer:
    return OuterOptimizer(numel, lr=kwargs.get("lr", LR), momentum=kwargs.get("momentum",
                          MOMENTUM), device=CPU, dtype=torch.float32)


def test_each_step_is_nesterov_momentum_on_the_displacement_worked_by_hand():
    optimizer = outer()
    optimizer.rebase(torch.ones(4))
    for consensus in CONSENSUS:
        average = optimizer.consensus + 0.75  # the group moved 0.75 from the consensus
        optimizer.step(average)
        assert average.tolist() == [consensus] * 4
    assert optimizer.steps == 2


def test_learning_rate_one_without_momentum_is_plain_averaging():
    optimizer = outer(lr=1.0, momentum=0.0)
    optimizer.rebase(torch.tensor([1.0, -2.0, 3.0, 0.25]))
    average = torch.tensor([1.5, -1.0, 2.0, 0.75])
    optimizer.step(average.clone())
    torch.testing.assert_close(optimizer.consensus, average, rtol=0, atol=1e-6)


def test_a_checkpointed_state_continues_exactly_where_it_stopped():
    averages = [torch.randn(4, generator=torch.Generator().manual_seed(seed))
                for seed in range(4)]
    straight = outer()
    for average in averages:
        straight.step(average.clone())
    first = outer()
    for average in averages[:2]:
        first.step(average.clone())
    resumed = outer()
    resumed.rebase(first.consensus)  # a resume: the loaded model is the consensus
    resumed.load_state_dict(first.state_dict(), origin="ckpt")
    for average in averages[2:]:
        resumed.step(average.clone())
    assert torch.equal(resumed.consensus, straight.consensus)
    assert resumed.steps == straight.steps == 4


@pytest.mark.parametrize("state", [
    None, "momentum", {"momentum_buffer": torch.zeros(5), "steps": 1},
    {"momentum_buffer": torch.tensor([0.0, float("nan"), 0.0, 0.0]), "steps": 1},
    {"momentum_buffer": torch.zeros(4, dtype=torch.int64), "steps": 1},
    {"momentum_buffer": torch.zeros(4), "steps": -1},
    {"momentum_buffer": torch.zeros(4), "steps": True},
    {"momentum_buffer": [0.0] * 4, "steps": 1}])
def test_a_state_that_does_not_fit_is_refused_with_one_line(state):
    optimizer = outer()
    with pytest.raises(UsageError, match="ckpt-r9: its outer optimizer state does not fit"):
        optimizer.load_state_dict(state, origin="ckpt-r9")
    assert optimizer.sgd.state == {} and optimizer.steps == 0  # nothing half-loaded


# ---- two ranks ------------------------------------------------------------------------------

def build_model() -> nn.Module:
    """Linear(3, 2) + BatchNorm1d(2), every float 1.0 on both ranks (alike, as after rank 0's
    broadcast)."""
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(1.0)
    return model


def make_averager(model: nn.Module, *, rank: int, wire: str = "fp32") -> Averager:
    return Averager(model, rank=rank, world_size=WORLD_SIZE, backend="cpu", device=CPU,
                    num_stats=1, wire=wire, outer=(LR, MOMENTUM))


def move(model: nn.Module, by: float) -> None:
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(by)


def split(model: nn.Module) -> dict[str, list[float]]:
    return {"params": [v for p in model.parameters() for v in p.reshape(-1).tolist()],
            "buffers": [v for b in model.buffers() if b.is_floating_point()
                        for v in b.reshape(-1).tolist()]}


def blocking_rounds(rank: int, wire: str) -> dict[str, Any]:
    """Two blocking averages, as cadence takes them (the guard reads the plain average)."""
    model = build_model()
    averager = make_averager(model, rank=rank, wire=wire)
    seen = []
    for _ in CONSENSUS:
        move(model, MOVES[rank])
        averager.pack(weight=WEIGHTS[rank], stats=[0.0], keep_snapshot=True)
        averager.all_reduce(async_op=False)
        plain = averager.flat[0].item()
        averager.step_outer()
        averager.load_average()
        seen.append({**split(model), "plain": plain, "checksum": checksum(model)})
    return {"rounds": seen, "memory": averager.memory_bytes(), "numel": averager.param_numel}


def async_round(rank: int) -> dict[str, Any]:
    """One background average: the progress made while it was in flight is kept on top of the
    stepped consensus."""
    model = build_model()
    averager = Averager(model, rank=rank, world_size=WORLD_SIZE, backend="cpu", device=CPU,
                        num_stats=1, outer=(LR, MOMENTUM))
    move(model, MOVES[rank])
    averager.pack(weight=WEIGHTS[rank], stats=[0.0], keep_snapshot=True)
    pending = averager.all_reduce(async_op=True)
    move(model, 0.125)  # trained on meanwhile
    pending.wait()
    averager.step_outer()
    averager.apply_delta()
    return split(model)


SCENARIOS = {"fp32": lambda rank: blocking_rounds(rank, "fp32"),
             "bf16": lambda rank: blocking_rounds(rank, "bf16"), "async": async_round}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("outer"), __name__)


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_the_parameters_take_the_outer_step_and_the_buffers_the_plain_average(ranks, wire):
    results = scenario(ranks, wire)
    for result in results:
        for seen, consensus, buffers in zip(result["rounds"], CONSENSUS, BUFFERS, strict=True):
            assert seen["params"] == [consensus] * 12  # Linear 6 + 2, BatchNorm's weight and bias
            assert seen["buffers"] == [buffers] * 4  # running mean and var
    assert [r["checksum"] for r in results[0]["rounds"]] == \
        [r["checksum"] for r in results[1]["rounds"]]
    # the guard saw the plain average (C + 0.75), not the stepped one
    assert [r["plain"] for r in results[0]["rounds"]] == [1.75, CONSENSUS[0] + 0.75]


def test_its_memory_is_two_copies_of_the_parameters_beside_the_buffer(ranks):
    result = scenario(ranks, "fp32")[0]
    plain = Averager(build_model(), rank=0, world_size=WORLD_SIZE, backend="cpu", device=CPU,
                     num_stats=1).memory_bytes()
    assert result["numel"] == 12
    assert result["memory"] == [plain[0], plain[1] + 2 * 12 * 4]


def test_under_async_the_progress_made_meanwhile_stays_on_the_stepped_consensus(ranks):
    for result in scenario(ranks, "async"):
        assert result["params"] == [CONSENSUS[0] + 0.125] * 12
        assert result["buffers"] == [BUFFERS[0] + 0.125] * 4


def test_without_parameters_to_average_there_is_no_outer_optimizer():
    """sync averages buffers only (DDP keeps the parameters alike): nothing to step."""
    averager = Averager(build_model(), rank=0, world_size=1, backend="cpu", device=CPU,
                        num_stats=1, params=False, outer=(LR, MOMENTUM))
    assert averager.outer is None


def test_policy_sync_with_an_outer_optimizer_is_one_usage_error(tmp_path):
    """Refused by the launcher (from the flags) and by the engine (a script's policy)."""
    from helpers import run_fdl

    from fdl.engine.config import resolve_config

    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    proc = run_fdl("run", "--policy", "sync", "--outer-optimizer", "nesterov", "train.py",
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "error: outer_optimizer nesterov steps the averages of the parameters, and policy sync "
        "has none (its ranks step every batch together)")
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # nothing written
    with pytest.raises(UsageError, match="policy sync has none"):
        resolve_config(script={"policy": "sync"}, env={"FDL_OUTER_OPTIMIZER": "nesterov"})
    assert resolve_config(script={"policy": "async"},
                          env={"FDL_OUTER_OPTIMIZER": "nesterov"}).outer_optimizer == "nesterov"
