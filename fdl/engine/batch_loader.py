"""A rank's batches for the whole run, through DataLoader workers that outlive each round.

A round's slice is known only when the round is planned, and is 10-100 batches. A DataLoader
started per slice pays its workers' start in every round. ``scripts/bench_batch_loader.py`` on
a shared 2-core CPU host (2 workers, 3x32x32 samples, batches of 32; three runs, medians of
7-11): the first batch of a fresh loader came after 42-250 ms (the most beside 2 GiB of
ballast: fork copies the page tables), of workers kept between slices after 7-17 ms, in this
process after 1.5 ms; a slice of 10 batches took 76-505 ms fresh against 24-36 ms kept, one of
100 batches 250-574 ms against 240-243 ms. So :class:`BatchLoader` keeps one DataLoader with
persistent workers whose ``batch_sampler`` is an :class:`IndexFeed`: each slice replaces the
feed's index lists and starts a new pass of the same workers (``iter`` on a persistent
DataLoader resets them, and drops the batches an abandoned pass had in flight). Without workers, or for a TensorDataset under the default
collate (indexed at once, faster than workers), batches are made in this process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from fdl.engine.data import TrainData, collate, fetch_batches, index_batches, index_lists


class IndexFeed:
    """The persistent DataLoader's ``batch_sampler``: the index lists of the current pass,
    handed out as the DataLoader asks for them (``prefetch_factor`` x workers ahead)."""

    def __init__(self) -> None:
        self._lists: deque[list[int]] = deque()

    def replace(self, batches: Sequence[torch.Tensor | Sequence[int]]) -> None:
        """The index lists of the next pass; what an abandoned pass left is dropped."""
        self._lists = deque(index_lists(batches))

    def __iter__(self) -> Iterator[list[int]]:
        lists = self._lists  # this pass's lists: a later replace() starts another pass
        while lists:
            yield lists.popleft()

    def __len__(self) -> int:
        return len(self._lists)


class BatchLoader:
    """The batches of ``data`` for every slice of a run; :meth:`close` stops its workers.

    One pass at a time: a slice's batches are fetched for the iterator :meth:`slice_batches`
    returns, and the next call ends that pass (its unread batches are dropped: the elastic rank
    stops early). The calibration pool's single batches (:meth:`collate`) are made in this
    process, so they never disturb a pass.
    """

    def __init__(self, data: TrainData) -> None:
        self.data = data
        self._feed = IndexFeed()
        self._loader: DataLoader | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def slice_batches(self, order: torch.Tensor, *, start: int, stop: int,
                      batch_size: int) -> Iterator[Any]:
        """Batches of the samples ``order[start:stop]``, in order; the workers start
        fetching them now."""
        return self.batches(index_batches(order, start=start, stop=stop, batch_size=batch_size))

    def batches(self, batches: Sequence[torch.Tensor | Sequence[int]]) -> Iterator[Any]:
        """The batches of the samples each of ``batches`` lists, in order."""
        if not self.data.uses_workers:
            return fetch_batches(self.data, batches)
        if self._loader is None:
            self._loader = self.data.loader(self._feed, persistent_workers=True)
        self._feed.replace(batches)
        return iter(self._loader)  # the same workers (started by the first), a new pass

    def collate(self, indices: torch.Tensor | Sequence[int]) -> Any:
        """One batch of the samples ``indices``, made in this process."""
        return collate(self.data, indices)

    def close(self) -> None:
        """Stop the workers (a later slice starts new ones): the DataLoader's iterator shuts
        them down when the last reference to it goes."""
        self._loader = None
