"""A rank's batches: what the round loop trains on, from whatever the script gave
``run.batches``.

* A map-style dataset (fdl.engine.data.TrainData): epoch ``e`` visits it in the order drawn
  from ``seed + e``; a round's plan gives the rank positions ``[start, stop)`` of that order,
  cut into steps of ``accumulate`` batches. The batches are made in this process or by the
  loader's workers, kept from round to round (fdl.engine.batch_loader), which may start on the
  next slice before it is asked for (:meth:`Feed.foresee`); on CUDA each batch's copy to the
  device is issued one batch ahead on a side stream (fdl.engine.h2d).
* Data without ``len()`` (fdl.engine.shards): a stream's next batches, counted, not indexed.

A step's samples are a list of ``accumulate`` index tensors (a stream's: their count), an
empty list where fewer samples than batches are left (an epoch's last few).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fdl.engine.batch_loader import BatchLoader
from fdl.engine.data import TrainData, epoch_permutation
from fdl.engine.h2d import DeviceCopies

#: a step's samples: its batches' indices into the dataset, or a stream's count
StepSamples = list[torch.Tensor] | int


@dataclass(eq=False)
class Feed:
    """This rank's batches (see the module docstring)."""

    loader: BatchLoader | None  # a map-style dataset's batches (None: a stream)
    stream: Any  # data without len() (fdl.engine.shards), or None
    batch_size: int
    accumulate: int  # batches per optimizer step
    seed: int
    copies: DeviceCopies | None = None  # CUDA: batches copied one ahead on a side stream
    _orders: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, data: TrainData | None, stream: Any, *, device: torch.device, batch_size: int,
           accumulate: int, seed: int) -> Feed:
        return cls(BatchLoader(data) if data is not None else None, stream, batch_size,
                   accumulate, seed,
                   DeviceCopies.for_device(device) if stream is None else None)

    @property
    def step_size(self) -> int:
        """The samples of one step, the plan's unit: ``accumulate`` batches."""
        return self.batch_size * self.accumulate

    @property
    def data(self) -> TrainData | None:
        return self.loader.data if self.loader is not None else None

    @property
    def uses_workers(self) -> bool:
        return self.loader is not None and self.loader.data.uses_workers

    @property
    def went_on(self) -> bool:
        """The last slice's batches came from the pass started ahead (:meth:`foresee`)."""
        return self.loader is not None and self.loader.went_on

    def epoch_length(self) -> int:
        """An epoch's length for the live progress: the dataset's samples (1 for a stream)."""
        return len(self.loader) if self.loader is not None else 1

    def order(self, epoch: int) -> torch.Tensor | None:
        """Epoch ``epoch``'s order of the dataset (None for a stream)."""
        if self.loader is None:
            return None
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(seed=self.seed, epoch=epoch,
                                                     size=len(self.loader))}
        return self._orders[epoch]

    def step_samples(self, order: torch.Tensor | None, low: int, high: int) -> StepSamples:
        """A step's samples, positions ``[low, high)``: their indices in the epoch's order,
        split into the step's ``accumulate`` batches (as evenly as they go; none when there are
        fewer samples than batches: an epoch's last few), or, for a stream, how many."""
        if order is None:
            return high - low
        indices = order[low:high]
        return list(indices.tensor_split(self.accumulate)) \
            if len(indices) >= self.accumulate else []

    def steps(self, epoch: int, start: int, stop: int) -> list[StepSamples]:
        """The steps of positions ``[start, stop)`` of epoch ``epoch``."""
        order = self.order(epoch)
        return [self.step_samples(order, low, min(low + self.step_size, stop))
                for low in range(start, stop, self.step_size)]

    def fetcher(self, steps: list[StepSamples]) -> Callable[[], Any]:
        """The next batch of ``steps``, each call: a stream's next batch, or the steps'
        batches in order, fetched ahead by the loader's workers when it has them."""
        if self.loader is None:
            return self.stream.next_batch
        batches = self.loader.batches([chunk for step in steps if not isinstance(step, int)
                                       for chunk in step])
        return self._ahead(lambda: next(batches), steps)

    def one_fetcher(self, samples: StepSamples) -> Callable[[], Any]:
        """A step of a shared pool, made in this process (the calibration pool's batches come
        one at a time; a drained pool's, without loader workers)."""
        if self.loader is None:
            return self.stream.next_batch
        loader = self.loader
        chunks = iter(samples if not isinstance(samples, int) else [])
        return self._ahead(lambda: loader.collate(next(chunks)), [samples])

    def foresee(self, epoch: int, start: int, stop: int) -> None:
        """Hand the loader's workers positions ``[start, stop)`` of epoch ``epoch``, the next
        slice as foreseen, so they fetch its first batches before it is asked for (nothing
        without workers; a wrong foresight costs the batches fetched, never a wrong batch)."""
        if not self.uses_workers:
            return
        assert self.loader is not None
        self.loader.fetch_ahead([batch for step in self.steps(epoch, start, stop)
                                 if not isinstance(step, int) for batch in step])

    def _ahead(self, fetch: Callable[[], Any], steps: list[StepSamples]) -> Callable[[], Any]:
        """On CUDA, ``fetch`` with each batch's copy to the device issued one batch ahead on a
        side stream (fdl.engine.h2d); CPU batches as they come."""
        if self.copies is None:
            return fetch
        return self.copies.ahead(fetch, sum(len(s) for s in steps if not isinstance(s, int)))

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
