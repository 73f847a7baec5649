"""Evaluation of the consensus model: each rank takes a contiguous shard of the eval set in
proportion to its speed, and the batch-size-weighted sums are all-reduced, so the result is
the mean over every sample.

Equal shards leave a fast rank idle while a slow one finishes: with a GPU three times as fast
as its peer, 2/3 of its evaluation time. :func:`weighted_shard` gives rank r a share
proportional to ``weights[r]`` (its measured samples/s), in whole batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.collectives import collective_device
from fdl.engine.data import TrainData, batch_size_of, fetch_batches, index_batches, to_device
from fdl.engine.user_collectives import refused
from fdl.errors import UsageError


def weighted_shard(size: int, *, weights: Sequence[float], rank: int,
                   batch_size: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)`` of ``size`` items, the shares in
    rank order and in proportion to ``weights`` (one per rank, >= 0, not all 0).

    The ``ceil(size / batch_size)`` batches are dealt by largest remainder (exact fractions),
    so every share is whole batches but the one that ends at ``size``, and each rank's batch
    count is within one of its exact proportion. A rank of weight 0 gets nothing, any rank may
    get nothing, and every item is in exactly one share. Pure: every rank must pass the same
    ``weights`` to get shares that fit together.
    """
    if size < 0 or batch_size < 1:
        raise ValueError(f"weighted_shard: size = {size}, batch_size = {batch_size}: need "
                         f"size >= 0 and batch_size >= 1")
    if not 0 <= rank < len(weights):
        raise ValueError(f"weighted_shard: rank {rank} has no weight among {len(weights)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ValueError(f"weighted_shard: weights = {list(weights)}: need finite numbers "
                         f">= 0, not all 0")
    counts = _batch_counts(-(-size // batch_size), weights)
    start = min(size, sum(counts[:rank]) * batch_size)
    return start, min(size, start + counts[rank] * batch_size)


def _batch_counts(num_batches: int, weights: Sequence[float]) -> list[int]:
    """``num_batches`` dealt in proportion to ``weights``: each its quota's floor, and the
    rest one each to the largest remainders (the lower rank first among equals)."""
    exact = [Fraction(w) for w in weights]
    quotas = [num_batches * w / sum(exact) for w in exact]
    counts = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda r: (counts[r] - quotas[r], r))
    for r in by_remainder[:num_batches - sum(counts)]:
        counts[r] += 1
    return counts


@torch.no_grad()
def evaluate_model(model: nn.Module, data: Any,
                   evaluate: Callable[[nn.Module, Any], dict[str, float]], *, batch_size: int,
                   device: torch.device, rank: int, world_size: int,
                   weights: Sequence[float] | None = None,
                   derive: Callable[[dict[str, float]], Any] | None = None) -> dict[str, float]:
    """The mean of each of ``evaluate``'s metrics over every sample of ``data`` (a dataset, a
    DataLoader, a TrainData), each rank evaluating its :func:`weighted_shard` (``weights``:
    the same on every rank; None: equal). A DataLoader's batch size wins over ``batch_size``,
    and its collate_fn and workers are used. Each metric is averaged over the samples of the
    batches that returned it. ``derive(means) -> {name: number}`` adds metrics computed from
    those means over the whole set (F1 from the rates of true and false positives: a mean of
    each batch's F1 is not the set's), the same on every rank."""
    data = TrainData.of(data, name="eval_data")
    batch_size = data.batch_size or batch_size
    equal = [1.0] * world_size
    start, stop = weighted_shard(len(data), weights=equal if weights is None else weights,
                                 rank=rank, batch_size=batch_size)
    with refused(lambda: "an evaluation runs (each rank evaluates a shard of its own size)"
                 if world_size > 1 else None):
        sums, counts = _shard_sums(model, data, evaluate, device=device, batches=index_batches(
            torch.arange(len(data)), start=start, stop=stop, batch_size=batch_size))
    if world_size > 1:
        sums, counts = _summed_over_ranks(sums, counts, device=device, world_size=world_size)
    means = {key: sums[key] / counts[key] for key in sorted(sums) if counts[key]}
    return means if derive is None else {**means, **derived(derive, means)}


def derived(derive: Callable[[dict[str, float]], Any], means: dict[str, float]) -> dict[str, float]:
    """``derive``'s metrics from ``means`` (a copy: it cannot change them), checked: a mapping
    of names to real numbers (a one-element tensor is read), or UsageError naming what it
    returned."""
    found = derive(dict(means))
    if not isinstance(found, Mapping):
        raise UsageError(f"run.evaluate's derive returned {type(found).__name__}; it returns "
                         "a dict of metric names to numbers", hint="derive=lambda means: "
                         "{'f1': ...}")
    values = {}
    for key, value in found.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(key, str) or isinstance(value, bool) or \
                not isinstance(value, (int, float)):
            raise UsageError(f"run.evaluate's derive returned {key!r}: {value!r}; it returns "
                             "metric names (str) with numbers")
        values[key] = float(value)
    return values


def _shard_sums(model: nn.Module, data: TrainData,
                evaluate: Callable[[nn.Module, Any], dict[str, float]], *,
                device: torch.device,
                batches: list[torch.Tensor]) -> tuple[dict[str, float], dict[str, int]]:
    """Each metric's batch-size-weighted sum over the shard, and its number of samples."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    was_training = model.training
    model.eval()
    try:
        for batch in fetch_batches(data, batches):
            size = batch_size_of(batch)
            for key, value in evaluate(model, to_device(batch, device)).items():
                sums[key] = sums.get(key, 0.0) + float(value) * size
                counts[key] = counts.get(key, 0) + size
    finally:
        model.train(was_training)
    return sums, counts


def _summed_over_ranks(sums: dict[str, float], counts: dict[str, int], *,
                       device: torch.device,
                       world_size: int) -> tuple[dict[str, float], dict[str, int]]:
    """Every rank's sums and counts added up, over the union of the metrics the ranks saw (a
    rank with an empty shard saw none)."""
    seen: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(seen, sorted(sums))
    keys = sorted({key for names in seen for key in names or []})
    totals = torch.tensor([sums.get(k, 0.0) for k in keys] + [counts.get(k, 0) for k in keys],
                          dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(totals)
    values = totals.tolist()
    return ({key: values[i] for i, key in enumerate(keys)},
            {key: int(values[len(keys) + i]) for i, key in enumerate(keys)})
