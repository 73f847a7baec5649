"""One global sample stream per epoch, and the batches a rank draws from its slice of it.

Epoch ``e`` visits the training set in the order ``torch.randperm(n)`` drawn from a generator
seeded with ``seed + e`` (DistributedSampler's convention). A round's plan gives rank r the
stream positions ``[start, stop)``; :func:`slice_batches` yields them as batches of
``batch_size`` (the last one possibly partial), collated with ``default_collate``, or by direct
indexing for a ``TensorDataset`` (same result, much faster).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate


def epoch_permutation(*, seed: int, epoch: int, size: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits ``size`` samples (identical on every rank)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator)


def slice_batches(dataset: Dataset, order: torch.Tensor, *, start: int, stop: int,
                  batch_size: int) -> Iterator[Any]:
    """Batches of the samples ``order[start:stop]``, in order."""
    for low in range(start, stop, batch_size):
        yield collate(dataset, order[low:min(low + batch_size, stop)])


def collate(dataset: Dataset, indices: torch.Tensor) -> Any:
    if isinstance(dataset, TensorDataset):  # what default_collate returns, without the loop
        return [tensor[indices] for tensor in dataset.tensors]
    return default_collate([dataset[int(i)] for i in indices])


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values are left alone."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list):
        return [to_device(value, device) for value in batch]
    if isinstance(batch, tuple):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    return batch


def shard(size: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)`` of ``size`` items (for evaluation)."""
    per, extra = divmod(size, world_size)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a collated batch: the leading dimension of its first tensor,
    or the length of a collated list of non-tensors (e.g. strings)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (dict, list, tuple)) and not isinstance(batch, (str, bytes)):
        values = list(batch.values()) if isinstance(batch, dict) else list(batch)
        for value in values:
            if isinstance(value, (torch.Tensor, dict, list, tuple)):
                try:
                    return batch_size_of(value)
                except TypeError:
                    continue
        if isinstance(batch, list) and values:
            return len(values)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")
