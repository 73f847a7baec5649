"""Evaluation sharded by measured speed: weighted_shard's properties, and evaluate_model over a
real 2-process gloo group (the harness of ``test_averaging.py``) against the mean over every
sample computed in one process."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_averaging import WORLD_SIZE, run_ranks, scenario
from test_data import Sequences, pad_collate
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fdl.engine.evaluation import evaluate_model, weighted_shard
from fdl.errors import UsageError

# ---------------------------------------------------------------------------------------------
# weighted_shard

weights_lists = st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
                         min_size=1, max_size=8).filter(any)


def shards(size: int, weights: list[float], batch_size: int) -> list[tuple[int, int]]:
    return [weighted_shard(size, weights=weights, rank=rank, batch_size=batch_size)
            for rank in range(len(weights))]


@given(size=st.integers(0, 600), batch_size=st.integers(1, 70), weights=weights_lists)
def test_every_item_once_in_rank_order_in_whole_batches(size, batch_size, weights):
    got = shards(size, weights, batch_size)
    assert [i for start, stop in got for i in range(start, stop)] == list(range(size))
    for start, stop in got:
        assert start % batch_size == 0 or start == stop == size
        assert (stop - start) % batch_size == 0 or stop == size  # only the last is partial


@given(size=st.integers(0, 600), batch_size=st.integers(1, 70), weights=weights_lists)
def test_batch_counts_are_within_one_of_the_exact_proportion(size, batch_size, weights):
    num_batches = math.ceil(size / batch_size)
    total = sum(Fraction(w) for w in weights)
    for (start, stop), weight in zip(shards(size, weights, batch_size), weights, strict=True):
        quota = num_batches * Fraction(weight) / total
        assert abs(math.ceil((stop - start) / batch_size) - quota) < 1
        if weight == 0:
            assert start == stop


@given(size=st.integers(0, 600), batch_size=st.integers(1, 70), weights=weights_lists,
       scale=st.sampled_from([2.0, 4.0]))  # exact in floats
def test_only_the_ratios_of_the_weights_matter(size, batch_size, weights, scale):
    assert shards(size, weights, batch_size) == \
        shards(size, [w * scale for w in weights], batch_size)


@given(size=st.integers(0, 600), batch_size=st.integers(1, 70), world_size=st.integers(1, 8))
def test_equal_weights_give_batch_counts_within_one(size, batch_size, world_size):
    counts = [math.ceil((stop - start) / batch_size)
              for start, stop in shards(size, [1.0] * world_size, batch_size)]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the extra batches go to the first ranks


def test_a_three_times_faster_rank_gets_three_quarters():
    assert shards(37, [3.0, 1.0], 4) == [(0, 32), (32, 37)]  # 10 batches: 7.5 + 2.5
    assert shards(400, [3.0, 1.0], 1) == [(0, 300), (300, 400)]
    assert shards(10, [0.0, 2.0, 0.0], 3) == [(0, 0), (0, 10), (10, 10)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weights": [1.0, -1.0]}, "finite numbers >= 0"),
    ({"weights": [1.0, math.nan]}, "finite numbers >= 0"),
    ({"weights": [1.0, math.inf]}, "finite numbers >= 0"),
    ({"weights": [0.0, 0.0]}, "not all 0"),
    ({"weights": [1.0, 1.0], "rank": 2}, "rank 2 has no weight among 2"),
    ({"weights": [1.0], "batch_size": 0}, "batch_size >= 1"),
])
def test_weights_that_cannot_share_are_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        weighted_shard(10, **{"rank": 0, **kwargs})


# ---------------------------------------------------------------------------------------------
# evaluate_model

SIZE = 37
BATCH_SIZE = 4


def values() -> TensorDataset:
    x = torch.arange(SIZE, dtype=torch.float32).unsqueeze(1) * 0.5 - 3
    return TensorDataset(x, torch.arange(SIZE) % 3)


def model() -> nn.Module:
    linear = nn.Linear(1, 1)
    with torch.no_grad():
        linear.weight.fill_(2.0)
        linear.bias.fill_(1.0)
    return linear


def metrics(model: nn.Module, batch: list[torch.Tensor]) -> dict[str, float]:
    """Per-batch means; ``tail`` only from batches of samples 32 and up."""
    x, y = batch
    out = model(x).squeeze(1)
    result = {"mse": float(((out - y) ** 2).mean()), "mean_out": float(out.mean())}
    if bool((x.squeeze(1) >= 32 * 0.5 - 3).all()):
        result["tail"] = float(out.mean())
    return result


def reference() -> dict[str, float]:
    """The mean over every sample, in float64, one sample at a time."""
    x, y = (t.double() for t in values().tensors)
    out = 2 * x.squeeze(1) + 1
    return {"mse": float(((out - y) ** 2).mean()), "mean_out": float(out.mean()),
            "tail": float(out[32:].mean())}


def sequence_metrics(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    del model
    return {"mean_value": float((batch["input"].sum(1) / batch["lengths"]).mean()),
            "width": float(batch["input"].shape[1])}


def counts(model: nn.Module, batch: list[torch.Tensor]) -> dict[str, float]:
    """A classifier's per-batch rates of true positives, false positives and false negatives
    (positive: out > 5, against label 0), and the batch's own F1 (1 where it has no positive)."""
    x, y = batch
    predicted, actual = model(x).squeeze(1) > 5, y == 0
    tp, fp = (predicted & actual).double(), (predicted & ~actual).double()
    fn = (~predicted & actual).double()
    found = 2 * tp.sum() + fp.sum() + fn.sum()
    return {"tp": float(tp.mean()), "fp": float(fp.mean()), "fn": float(fn.mean()),
            "batch_f1": float(2 * tp.sum() / found) if found else 1.0}


def f1(means: dict[str, float]) -> dict[str, float]:
    return {"f1": 2 * means["tp"] / (2 * means["tp"] + means["fp"] + means["fn"])}


def whole_set_f1() -> float:
    x, y = values().tensors
    predicted, actual = model()(x).squeeze(1) > 5, y == 0
    tp = int((predicted & actual).sum())
    return 2 * tp / (2 * tp + int((predicted & ~actual).sum()) + int((~predicted & actual).sum()))


def evaluate(rank: int, weights: list[float] | None, data: Any = None,
             evaluate_fn: Any = metrics, derive: Any = None) -> dict[str, Any]:
    result = evaluate_model(model(), values() if data is None else data, evaluate_fn,
                            batch_size=BATCH_SIZE, device=torch.device("cpu"), rank=rank,
                            world_size=WORLD_SIZE, weights=weights, derive=derive)
    size = SIZE if data is None else len(data.dataset)
    batch_size = BATCH_SIZE if data is None else data.batch_size
    equal = [1.0] * WORLD_SIZE
    return {"metrics": result, "shard": weighted_shard(
        size, weights=equal if weights is None else weights, rank=rank, batch_size=batch_size)}


SCENARIOS = {
    "equal": lambda rank: evaluate(rank, None),
    "unequal": lambda rank: evaluate(rank, [3.0, 1.0]),
    "rank0_empty": lambda rank: evaluate(rank, [0.0, 1.0]),
    "rank1_empty": lambda rank: evaluate(rank, [2.5, 0.0]),
    "loader": lambda rank: evaluate(
        rank, [1.0, 2.5], DataLoader(Sequences(), batch_size=2, collate_fn=pad_collate),
        sequence_metrics),
    "f1": lambda rank: evaluate(rank, [3.0, 1.0], evaluate_fn=counts, derive=f1),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("evaluation"), __name__)


@pytest.mark.parametrize(("name", "shards_seen"), [
    ("equal", [[0, 20], [20, 37]]),
    ("unequal", [[0, 32], [32, 37]]),
    ("rank0_empty", [[0, 0], [0, 37]]),
    ("rank1_empty", [[0, 37], [37, 37]]),
])
def test_every_rank_gets_the_mean_over_every_sample(ranks, name, shards_seen):
    results = scenario(ranks, name)
    assert [result["shard"] for result in results] == shards_seen
    expected = reference()
    for result in results:
        assert result["metrics"] == pytest.approx(expected, rel=1e-6)


def test_a_dataloader_as_eval_data_is_sharded_with_its_batch_size_and_collate_fn(ranks):
    results = scenario(ranks, "loader")
    # 20 batches of 2, dealt 1 : 2.5 (5.7 and 14.3: 6 and 14)
    assert [result["shard"] for result in results] == [[0, 12], [12, 40]]
    lengths = [(i % 5) + 1 for i in range(40)]  # sample i's length, Sequences' rule
    widths = [max(lengths[i - i % 2:i - i % 2 + 2]) for i in range(40)]  # its batch's longest
    for result in results:
        assert result["metrics"]["mean_value"] == pytest.approx(sum(range(40)) / 40, rel=1e-9)
        assert result["metrics"]["width"] == pytest.approx(sum(widths) / 40, rel=1e-9)


def test_a_derived_metric_is_the_whole_set_s_on_every_rank(ranks):
    """F1 over the whole eval set from the ranks' unequal shards, the same on both ranks: the
    mean of each batch's F1 is another number, which is why derive exists."""
    expected = whole_set_f1()
    for result in scenario(ranks, "f1"):
        assert result["metrics"]["f1"] == pytest.approx(expected, rel=1e-9)
        assert abs(result["metrics"]["batch_f1"] - expected) > 0.05
    assert 0 < expected < 1


@pytest.mark.parametrize(("derive", "needle"), [
    (lambda means: 0.5, "returned 0.5 (a float)"),
    (lambda means: {"f1": "high"}, "returned 'f1': 'high' (a str)"),
])
def test_a_derive_that_returns_no_metrics_is_told(derive, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        evaluate_model(model(), values(), counts, batch_size=BATCH_SIZE,
                       device=torch.device("cpu"), rank=0, world_size=1, derive=derive)


@pytest.mark.parametrize(("returned", "needle"), [
    ("accuracy", "returned 'accuracy' (a str); it returns a dict of metric names to numbers"),
    (None, "returned None (a NoneType)"),
    ([0.5], "returned [0.5] (a list)"),
    ({"acc": torch.ones(3)}, "returned 'acc': a tensor of shape (3,)"),
    ({"acc": "high"}, "returned 'acc': 'high' (a str)"),
    ({"acc": True}, "returned 'acc': True (a bool)"),
    ({"acc": 10 ** 400}, "returned 'acc': 1000000000"),
    ({1: 0.5}, "returned 1: 0.5 (a float)"),
])
def test_an_evaluation_that_returns_no_metrics_is_told_what_to_return(returned, needle):
    """Each of these raised inside fdl (float() of a str, .items() of None) with no word of
    what the function must return."""
    with pytest.raises(UsageError, match=re.escape(needle)) as refused:
        evaluate_model(model(), values(), lambda model, batch: returned, batch_size=BATCH_SIZE,
                       device=torch.device("cpu"), rank=0, world_size=1)
    assert refused.value.message.startswith("run.evaluate's function returned")
    assert "return {'loss'" in refused.value.hint


def test_a_one_element_tensor_and_an_int_are_metrics():
    result = evaluate_model(model(), values(), lambda model, batch: {
        "loss": torch.tensor([0.25]), "count": 2}, batch_size=BATCH_SIZE,
        device=torch.device("cpu"), rank=0, world_size=1)
    assert result == {"count": 2.0, "loss": 0.25}


def test_in_one_process_a_metric_is_averaged_over_the_batches_that_returned_it():
    result = evaluate_model(model(), values(), metrics, batch_size=BATCH_SIZE,
                            device=torch.device("cpu"), rank=0, world_size=1)
    assert result == pytest.approx(reference(), rel=1e-6)
