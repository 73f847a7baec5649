"""What the user's data is, one global sample stream per epoch, and a rank's batches of it.

``train_data`` (and ``eval_data``) may be a map-style dataset (``len()`` and ``data[i]``: a
torch ``Dataset``, a ``TensorDataset``, a list of samples) or a ``DataLoader`` over one.
:meth:`TrainData.of` reads either into a :class:`TrainData`: the dataset, and of a loader its
``batch_size``, ``drop_last``, ``collate_fn`` and worker options. fdl draws its own batches:
the loader's sampler and batching are replaced (the rules are in :meth:`TrainData.of`).

Epoch ``e`` visits the training set in the order ``torch.randperm(n)`` drawn from a generator
seeded with ``seed + e`` (DistributedSampler's convention); with ``drop_last`` an epoch is that
order's first ``n - n % batch_size`` positions. A round's plan gives rank r the
stream positions ``[start, stop)``; :func:`slice_batches` yields them as batches of
``batch_size`` (the last one possibly partial), collated with the data's ``collate_fn``, by
direct indexing for a ``TensorDataset`` under the default collate (same result, much faster),
else in this process or, with ``num_workers > 0``, through a DataLoader's workers.
:class:`fdl.engine.batch_loader.BatchLoader` keeps those workers from one round to the next.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

from fdl.errors import UsageError

MAX_WORKERS = 256  # loader processes per rank
MAX_PREFETCH = 1024  # batches per loader worker
ACCEPTED = ("a map-style dataset (len() and data[i]: a torch Dataset, a TensorDataset, a list "
            "of samples) or a torch DataLoader over one")


@dataclass(frozen=True, kw_only=True)
class TrainData:
    """A dataset and how its batches are made: of a DataLoader, its ``batch_size`` (None for a
    plain dataset: the engine's batch size applies), ``collate_fn``, ``drop_last`` and worker
    options. With ``num_workers > 0`` the workers fetch and collate, and ``pin_memory`` pins
    their batches (on a CUDA host); without, batches are made unpinned in the training
    process. ``drop_last``: every batch is whole (:meth:`epoch_samples`)."""

    dataset: Any
    batch_size: int | None = None
    drop_last: bool = False
    collate_fn: Callable[[list[Any]], Any] = default_collate
    num_workers: int = 0
    pin_memory: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    prefetch_factor: int | None = None
    multiprocessing_context: Any = None

    @classmethod
    def of(cls, data: Any, *, name: str = "train_data") -> TrainData:
        """``data`` read as fdl uses it; ``name`` is the argument named in errors.

        * A ``TrainData`` is itself; a map-style dataset is itself with the defaults.
        * A ``DataLoader`` gives its ``dataset``, ``batch_size``, ``drop_last``,
          ``collate_fn``, ``num_workers``, ``pin_memory``, ``worker_init_fn``,
          ``prefetch_factor`` and ``multiprocessing_context``. Its order is not kept: fdl
          visits every sample once per epoch in its own seeded order, split between the ranks
          by speed, so the default sequential or random sampler is replaced (``shuffle=False``
          is shuffled too). A ``DistributedSampler`` is replaced with a warning (fdl
          shards the data itself). A sampler that picks or weights samples
          (``WeightedRandomSampler``, ``SubsetRandomSampler``, any other), a ``batch_sampler``
          other than a plain ``BatchSampler`` (its batches vary: fdl's do not) and
          ``batch_size=None`` are a ``UsageError``: replacing them would change what trains.
        * An ``IterableDataset`` (or a loader over one), a mapping (a DatasetDict: pass a split)
          and anything without ``len()`` and ``[i]`` are a ``UsageError``.
        """
        if isinstance(data, TrainData):
            return data
        if isinstance(data, DataLoader):
            return cls._of_loader(data, name=name)
        _check_dataset(data, name=name)
        return cls(dataset=data)

    @classmethod
    def _of_loader(cls, loader: DataLoader, *, name: str) -> TrainData:
        _check_dataset(loader.dataset, name=f"{name}.dataset")
        batch_size = loader.batch_size
        batches = loader.batch_sampler
        if batches is not None and batch_size is None:  # the user's own batch_sampler
            if type(batches) is not BatchSampler:
                raise UsageError(
                    f"{name} is a DataLoader with batch_sampler={type(batches).__name__}; fdl "
                    f"draws batches of one size from its own order and cannot keep it",
                    hint="pass DataLoader(dataset, batch_size=N, collate_fn=...): a collate_fn "
                         "that pads to the batch's longest sample keeps padding small")
            batch_size = batches.batch_size
        if batch_size is None:
            raise UsageError(f"{name} is a DataLoader with batch_size=None (its items are "
                             f"whole batches); fdl batches samples itself",
                             hint="give the DataLoader a batch_size, or pass the dataset")
        _check_sampler(batches.sampler if batches is not None else loader.sampler,
                       loader.dataset, name=name)
        return cls(dataset=loader.dataset, batch_size=batch_size, drop_last=loader.drop_last,
                   collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                   pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
                   prefetch_factor=loader.prefetch_factor,
                   multiprocessing_context=loader.multiprocessing_context)

    def with_options(self, *, device: torch.device, num_workers: int | None = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None,
                     pin_memory: bool | None = None, prefetch: int | None = None,
                     drop_last: bool | None = None) -> TrainData:
        """This data with the loader options a script gave ``run.batches`` (they win over a
        DataLoader's): ``num_workers`` loader processes, ``collate_fn``, ``pin_memory`` (None:
        on when ``device`` is CUDA or the DataLoader pinned), ``prefetch`` batches per
        worker (DataLoader's ``prefetch_factor``; needs workers) and ``drop_last``.
        ``UsageError`` for a value that cannot be used."""
        changes: dict[str, Any] = {}
        if drop_last is not None:
            if not isinstance(drop_last, bool):
                raise UsageError(f"drop_last must be True or False, got {drop_last!r}")
            changes["drop_last"] = drop_last
        if num_workers is not None:
            if isinstance(num_workers, bool) or not isinstance(num_workers, int) or \
                    not 0 <= num_workers <= MAX_WORKERS:
                raise UsageError(f"num_workers must be a whole number in [0, {MAX_WORKERS}], "
                                 f"got {num_workers!r}")
            changes["num_workers"] = num_workers
        if collate_fn is not None:
            if not callable(collate_fn):
                raise UsageError(f"collate_fn must be a function of a list of samples, got "
                                 f"{type(collate_fn).__name__}")
            changes["collate_fn"] = collate_fn
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise UsageError(f"pin_memory must be True or False, got {pin_memory!r}")
        changes["pin_memory"] = pin_memory if pin_memory is not None else \
            self.pin_memory or device.type == "cuda"
        if prefetch is not None:
            if isinstance(prefetch, bool) or not isinstance(prefetch, int) or \
                    not 1 <= prefetch <= MAX_PREFETCH:
                raise UsageError(f"prefetch must be a whole number in [1, {MAX_PREFETCH}] "
                                 f"(batches per loader worker), got {prefetch!r}")
            if not changes.get("num_workers", self.num_workers):
                raise UsageError("prefetch needs loader workers: the training process makes "
                                 "its batches when it needs them",
                                 hint="add num_workers=N (N >= 1)")
            changes["prefetch_factor"] = prefetch
        return dataclasses.replace(self, **changes)

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch_samples(self, batch_size: int) -> int:
        """The samples an epoch trains on in batches of ``batch_size``: every one, or with
        ``drop_last`` the whole batches' (the rest, a different set each epoch, is left out:
        the epoch's order is drawn over the whole dataset and cut, as DataLoader's shuffle
        with ``drop_last`` does)."""
        size = len(self.dataset)
        return size - size % batch_size if self.drop_last else size

    @property
    def indexes_tensors(self) -> bool:
        """Batches are the dataset's tensors indexed at once (a TensorDataset, default collate):
        faster than any worker, so workers are not started."""
        return isinstance(self.dataset, TensorDataset) and self.collate_fn is default_collate

    @property
    def uses_workers(self) -> bool:
        return self.num_workers > 0 and not self.indexes_tensors

    def loader(self, batch_sampler: Any, *, persistent_workers: bool = False) -> DataLoader:
        """A DataLoader that fetches the index lists ``batch_sampler`` yields, with this data's
        collate_fn and worker options."""
        return DataLoader(self.dataset, batch_sampler=batch_sampler, collate_fn=self.collate_fn,
                          num_workers=self.num_workers,
                          pin_memory=self.pin_memory and torch.cuda.is_available(),
                          worker_init_fn=self.worker_init_fn,
                          prefetch_factor=self.prefetch_factor,
                          multiprocessing_context=self.multiprocessing_context,
                          persistent_workers=persistent_workers and self.num_workers > 0)


def _check_dataset(data: Any, *, name: str) -> None:
    if isinstance(data, IterableDataset):
        raise UsageError(f"{name} is an IterableDataset ({type(data).__name__}); fdl splits "
                         f"each epoch between the ranks by sample index", hint=f"use {ACCEPTED}")
    if isinstance(data, Mapping):
        raise UsageError(f"{name} is a mapping ({type(data).__name__} of {len(data)}: "
                         f"{', '.join(map(repr, list(data)[:4]))}), not a dataset",
                         hint="pass one split, e.g. data['train']")
    if isinstance(data, (str, bytes)) or not (hasattr(data, "__len__")
                                              and hasattr(data, "__getitem__")):
        raise UsageError(f"{name} has type {type(data).__name__}; fdl trains on {ACCEPTED}")


def _check_sampler(sampler: Any, dataset: Any, *, name: str) -> None:
    if type(sampler) is SequentialSampler:
        return
    if type(sampler) is RandomSampler and not sampler.replacement \
            and sampler.num_samples == len(dataset):
        return
    if isinstance(sampler, DistributedSampler):
        warnings.warn(f"{name}'s DistributedSampler is not used: fdl shards each epoch between "
                      f"the ranks by their speed", stacklevel=4)
        return
    raise UsageError(f"{name} is a DataLoader with sampler={type(sampler).__name__}; fdl "
                     f"visits every sample once per epoch in its own order and cannot keep it",
                     hint="for a subset pass torch.utils.data.Subset(dataset, indices)")


def epoch_permutation(*, seed: int, epoch: int, size: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits ``size`` samples (identical on every rank)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator)


def index_batches(order: torch.Tensor, *, start: int, stop: int,
                  batch_size: int) -> list[torch.Tensor]:
    """The samples ``order[start:stop]`` cut into batches of ``batch_size``, in order (views of
    ``order``: a TensorDataset is indexed with them directly)."""
    return [order[low:min(low + batch_size, stop)] for low in range(start, stop, batch_size)]


def index_lists(batches: Sequence[torch.Tensor | Sequence[int]]) -> list[list[int]]:
    """Each batch's indices as a list of ints, what a dataset's ``[i]`` expects from workers."""
    return [b.tolist() if isinstance(b, torch.Tensor) else [int(i) for i in b] for b in batches]


def slice_batches(data: TrainData | Dataset, order: torch.Tensor, *, start: int, stop: int,
                  batch_size: int) -> Iterator[Any]:
    """Batches of the samples ``order[start:stop]``, in order (:func:`fetch_batches`)."""
    return fetch_batches(TrainData.of(data), index_batches(order, start=start, stop=stop,
                                                             batch_size=batch_size))


def fetch_batches(data: TrainData,
                  batches: Sequence[torch.Tensor | Sequence[int]]) -> Iterator[Any]:
    """The batches of the samples each of ``batches`` lists, in order. With ``num_workers > 0``
    a DataLoader's workers start now, prefetch them, and stop after the last (a BatchLoader
    keeps them)."""
    if data.uses_workers and batches:
        return iter(data.loader(index_lists(batches)))
    return (collate(data, indices) for indices in batches)


def collate(data: TrainData | Dataset, indices: torch.Tensor | Sequence[int]) -> Any:
    """One batch of the samples ``indices``, fetched in this process."""
    data = TrainData.of(data)
    if data.indexes_tensors:  # what default_collate returns, without the loop
        return [tensor[indices] for tensor in data.dataset.tensors]
    indices = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    if hasattr(data.dataset, "__getitems__"):  # batched fetch, as DataLoader's workers use it
        return data.collate_fn(data.dataset.__getitems__(indices))
    return data.collate_fn([data.dataset[i] for i in indices])


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values are left alone. A
    mapping with a ``.to`` (HuggingFace's BatchEncoding) moves itself; a dataclass is copied
    with its fields moved."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=device.type == "cuda"),
                       move=device)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any], *,
                move: torch.device | None = None) -> Any:
    """``fn`` of every tensor of a (nested) batch, through dicts and other mappings, lists,
    tuples (a named tuple stays one) and dataclasses (copied); other values as they are.
    With ``move``, a mapping that has a ``.to`` (a BatchEncoding) is moved by its own."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        if move is not None and not isinstance(batch, dict) and callable(getattr(batch, "to", None)):
            return batch.to(move)
        return {key: map_tensors(value, fn, move=move) for key, value in batch.items()}
    if isinstance(batch, list):
        return [map_tensors(value, fn, move=move) for value in batch]
    if isinstance(batch, tuple):
        moved = [map_tensors(value, fn, move=move) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{
            f.name: map_tensors(getattr(batch, f.name), fn, move=move)
            for f in dataclasses.fields(batch) if f.init})
    return batch


def batch_size_of(batch: Any) -> int:
    """The number of samples in a collated batch: the leading dimension of its first tensor,
    or the length of a collated list of non-tensors (e.g. strings)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, (Mapping, list, tuple)):
        values = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        for value in values:
            if isinstance(value, (torch.Tensor, Mapping, list, tuple)) or \
                    dataclasses.is_dataclass(value):
                try:
                    return batch_size_of(value)
                except TypeError:
                    continue
        if isinstance(batch, list) and values:
            return len(values)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")
