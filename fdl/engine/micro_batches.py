"""Micro-batches: a rank computes its batch in parts of at most ``size`` samples, each part's
loss weighted by its share of the batch and the gradients accumulated before the one optimizer
step, so the step's maths is the whole batch's (a mean loss over the batch; BatchNorm's
statistics are the one exception: they are a part's) and a 6 GB card trains with the batch a
16 GB card sets.

The ``micro_batch_size`` setting (fdl.settings) is one choice for every rank or one per rank:
a size, or ``auto``: on a CUDA device the rank starts with the whole batch and halves the
micro-batch each time a step runs out of memory (``torch.cuda.OutOfMemoryError``: the step's
gradients are dropped, the cache emptied, the step redone), so it settles on the largest that
fits, within the first steps; on the CPU ``auto`` is the batch. A rank's size and its peak
memory go into ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fdl.engine.data import batch_size_of
from fdl.settings import choice_for_rank


def micro_for_rank(spec: tuple[int | str, ...] | None, rank: int,
                   world_size: int) -> int | str | None:
    """Rank ``rank``'s choice: None (no micro-batches), a size or ``"auto"``. A list of another
    length than ``world_size`` is a UsageError naming both."""
    return None if spec is None else choice_for_rank("micro_batch_size", spec, rank, world_size)


@dataclasses.dataclass
class MicroBatches:
    """This rank's micro-batch size: ``size`` (None: the batch), ``auto`` halving on CUDA's
    out-of-memory error."""

    size: int | None
    auto: bool = False

    @classmethod
    def of(cls, choice: int | str | None, device: torch.device) -> MicroBatches:
        if choice == "auto":
            return cls(None, auto=device.type == "cuda")
        return cls(choice if isinstance(choice, int) else None)

    def parts(self, batch: Any) -> list[tuple[Any, float]]:
        """``batch`` in parts of at most :attr:`size` samples, each with its share of the
        batch (the weight of its mean loss); the batch itself, weight 1, when it fits."""
        total = batch_size_of(batch)
        if self.size is None or self.size >= total:
            return [(batch, 1.0)]
        return [(take(batch, low, min(low + self.size, total)),
                 (min(low + self.size, total) - low) / total)
                for low in range(0, total, self.size)]

    def shrink(self, batch_size: int) -> bool:
        """After an out-of-memory error: halve the size (from the batch, under ``auto``);
        False when it cannot (not ``auto``, or already one sample)."""
        current = self.size if self.size is not None else batch_size
        if not self.auto or current <= 1:
            return False
        self.size = max(1, current // 2)
        return True

    def label(self, batch_size: int) -> int:
        """The size this rank computes in (the batch when it never split)."""
        return min(self.size, batch_size) if self.size is not None else batch_size


def take(batch: Any, low: int, high: int) -> Any:
    """Samples ``[low, high)`` of a collated batch: every tensor's leading dimension and every
    collated list, through tuples, lists, mappings and dataclasses; anything else (a scalar, a
    string that is not one per sample) as it is."""
    total = batch_size_of(batch)
    return _take(batch, low, high, total)


def _take(value: Any, low: int, high: int, total: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[low:high] if value.dim() and value.shape[0] == total else value
    if isinstance(value, Mapping):
        items = {key: _take(item, low, high, total) for key, item in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple):
        items = [_take(item, low, high, total) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        if len(value) == total and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple))
                                           for v in value):
            return value[low:high]  # one item per sample (strings, ids)
        return [_take(item, low, high, total) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: _take(getattr(value, f.name), low, high, total)
            for f in dataclasses.fields(value) if f.init})
    return value
