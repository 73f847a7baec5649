"""Evaluation of the consensus model: each rank takes a contiguous shard of the eval set, and
the batch-size-weighted sums are all-reduced, so the result is the mean over every sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.collectives import collective_device
from fdl.engine.data import batch_size_of, collate, shard, to_device


@torch.no_grad()
def evaluate_model(model: nn.Module, dataset: Any,
                   evaluate: Callable[[nn.Module, Any], dict[str, float]], *, batch_size: int,
                   device: torch.device, rank: int, world_size: int) -> dict[str, float]:
    start, stop = shard(len(dataset), rank=rank, world_size=world_size)
    sums: dict[str, float] = {}
    count = 0
    was_training = model.training
    model.eval()
    try:
        for low in range(start, stop, batch_size):
            batch = collate(dataset, torch.arange(low, min(low + batch_size, stop)))
            size = batch_size_of(batch)
            for key, value in evaluate(model, to_device(batch, device)).items():
                sums[key] = sums.get(key, 0.0) + float(value) * size
            count += size
    finally:
        model.train(was_training)
    if world_size == 1:
        return {key: value / count for key, value in sums.items()} if count else {}
    keys = [sorted(sums)]
    dist.broadcast_object_list(keys, src=0)  # rank 0 always has a non-empty shard
    totals = torch.tensor([sums.get(k, 0.0) for k in keys[0]] + [float(count)],
                          dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(totals)
    values = totals.tolist()
    return {key: values[i] / values[-1] for i, key in enumerate(keys[0])}

