"""A rank's batches for the whole run, through DataLoader workers that outlive each round.

A round's slice is known only when the round is planned, and is 10-100 batches. A DataLoader
started per slice pays its workers' start in every round, and on a small host that start (fork
copies the page tables of a process that grew with the model and data) can cost more than a
short slice's own batches (docs/elche.md "Data loading" has ``scripts/bench_batch_loader.py``'s
figures). So :class:`BatchLoader` keeps one DataLoader with persistent workers whose
``batch_sampler`` is an :class:`IndexFeed`: each slice replaces the feed's index lists and
starts a new pass of the same workers (``iter`` on a persistent DataLoader resets them, and
drops the batches an abandoned pass had in flight). Without workers, or for a TensorDataset
under the default collate (indexed at once, faster than workers), batches are made in this
process.

**The next round's first batches come while the average runs.** The round loop hands the
loader the slice it foresees for the next round (:meth:`BatchLoader.fetch_ahead`) before the
boundary's average, and the workers fetch its first batches (``prefetch_factor`` x workers of
them) meanwhile. The real slice is known only after the average; when it begins with the lists
the workers were given, the pass goes on with the real slice's rest (:meth:`IndexFeed.go_on`):
nothing is fetched twice. When it does not (the average moved the split), the pass is dropped
and a new one starts, as without the foresight.

**A batch is taken from the DataLoader off the step's thread.** Taking a batch from a
DataLoader's workers (its unpickling, the tensors rebuilt from shared memory) costs the thread
that takes it a share of a short step, booked as data wait on every step even when the workers
are far ahead. So a pass is taken by a thread of its own (:class:`TakenAhead`), up to
:data:`DEPTH` batches ahead of the step, while the step computes (the step's kernels, a GPU's
wait, the emulation's sleep release the GIL); the step waits only when the workers are really
behind (docs/elche.md "Data loading": ``scripts/bench-loader`` and ``scripts/bench-fetch``). The
thread starts when the pass's first batch is asked for, so a pass started ahead is not run
through while the average runs (its lists stay the DataLoader's prefetch, which ``go_on``
extends); a new pass first stops the running one's thread, so the DataLoader's one iterator is
never used by two threads at once. Only ``next`` runs on the thread: ``iter`` (which starts the
workers and sets the DataLoader's signal handler) and every CUDA call stay on the step's. With
``pin_memory`` (CUDA) the DataLoader's own pin thread unpickles and pins, and this thread takes
the pinned batch from it.
"""

from __future__ import annotations

import threading
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
        self._handed: list[list[int]] = []  # what this pass handed out so far
        self._ended = False  # this pass found no list left: it has ended

    def replace(self, batches: Sequence[torch.Tensor | Sequence[int]]) -> None:
        """The index lists of the next pass; what an abandoned pass left is dropped."""
        self._lists, self._handed, self._ended = deque(index_lists(batches)), [], False

    def go_on(self, batches: Sequence[torch.Tensor | Sequence[int]]) -> bool:
        """The pass under way goes on as ``batches``' pass would, if what it handed out so far
        is where they begin (or they end within it): the lists it has not handed out become the
        rest of ``batches``'. False, changing nothing, when they begin elsewhere, or when they
        go on beyond a pass that has ended."""
        wanted = index_lists(batches)
        handed = self._handed
        common = min(len(handed), len(wanted))
        rest = wanted[len(handed):]
        if handed[:common] != wanted[:common] or (rest and self._ended):
            return False
        self._lists.clear()  # the same deque: the pass's generator reads it
        self._lists.extend(rest)
        return True

    def __iter__(self) -> Iterator[list[int]]:
        lists, handed = self._lists, self._handed  # a later replace() starts another pass
        while lists:
            handed.append(lists.popleft())
            yield handed[-1]
        if lists is self._lists:
            self._ended = True

    def __len__(self) -> int:
        return len(self._lists)


DEPTH = 2  # batches a pass's thread takes ahead of the step
CLOSE_WAIT_S = 5.0  # BatchLoader.close's wait for a batch being taken: the DataLoader's status
# check interval, after which it would have noticed a dead worker


class TakenAhead:
    """The batches of one pass of ``source`` (the DataLoader's iterator), taken by a thread of
    their own, at most :data:`DEPTH` ahead of the caller; the thread starts at the first
    ``next``. What the DataLoader raises is raised by the ``next`` that reaches it.
    :meth:`stop` ends the thread (after the batch it is taking, if any) and waits for it."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._ready: deque[tuple[str, Any]] = deque()  # ("batch" | "end" | "error", value)
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def __iter__(self) -> TakenAhead:
        return self

    def __next__(self) -> Any:
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._take, name="fdl-batches",
                                                daemon=True)
                self._thread.start()
            while not self._ready and not self._stopped:
                self._cond.wait()
            if not self._ready:
                raise StopIteration
            kind, value = self._ready[0]
            if kind == "batch":
                self._ready.popleft()
                self._cond.notify_all()
            elif kind == "error":  # raised once; the end stays, so every later next ends
                self._ready[0] = ("end", None)
        if kind == "error":
            raise value
        if kind == "end":
            raise StopIteration
        return value

    def _take(self) -> None:
        item: tuple[str, Any] = ("end", None)
        try:
            while True:
                with self._cond:
                    while len(self._ready) >= DEPTH and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                try:
                    batch = next(self._source)
                except StopIteration:
                    return
                with self._cond:
                    self._ready.append(("batch", batch))
                    self._cond.notify_all()
        except BaseException as exc:  # the caller's next raises it
            item = ("error", exc)
        finally:
            with self._cond:
                self._ready.append(item)
                self._cond.notify_all()

    def stop(self, *, wait_s: float | None = None) -> bool:
        """End the thread and wait for it, at most ``wait_s`` seconds (None: as long as the
        batch it is taking takes). False when it is still taking one: a worker that never
        answers."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(wait_s)
            return not self._thread.is_alive()
        return True


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
        self._ahead: TakenAhead | None = None  # the pass fetch_ahead started
        self._pass: TakenAhead | None = None  # the latest pass (its thread may run)
        self.went_on = False  # the last batches() call went on with the pass started ahead

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
        """The batches of the samples each of ``batches`` lists, in order: from the pass
        :meth:`fetch_ahead` started where it foresaw them, else from a new pass."""
        if not self.data.uses_workers:
            return fetch_batches(self.data, batches)
        ahead, self._ahead = self._ahead, None
        self.went_on = ahead is not None and self._feed.go_on(batches)
        if self.went_on:  # not taken from yet: its thread has not started
            assert ahead is not None
            return ahead
        self._stop_pass()  # the DataLoader's iterator is one: never two threads in it
        if self._loader is None:
            self._loader = self.data.loader(self._feed, persistent_workers=True)
        self._feed.replace(batches)
        # the same workers (started by the first), a new pass
        self._pass = TakenAhead(iter(self._loader))
        return self._pass

    def fetch_ahead(self, batches: Sequence[torch.Tensor | Sequence[int]]) -> None:
        """Start fetching ``batches``, the next slice as foreseen, before it is asked for: the
        next :meth:`batches` goes on with this pass where it begins as they do. Nothing
        without workers (batches made in this process are made when asked for)."""
        if self.data.uses_workers and len(batches):
            self._ahead = self.batches(batches)

    def collate(self, indices: torch.Tensor | Sequence[int]) -> Any:
        """One batch of the samples ``indices``, made in this process."""
        return collate(self.data, indices)

    def _stop_pass(self) -> None:
        if self._pass is not None:
            self._pass.stop()
            self._pass = None

    def close(self, *, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the pass's thread and the workers (a later slice starts new ones): the
        DataLoader's iterator shuts them down when the last reference to it goes. The thread
        is waited for at most ``wait_s``: a worker stuck in the user's dataset (alive, never
        answering) must not hold the run's end; the thread, a daemon, is left to it with one
        line on stderr. Between passes the wait stays unbounded: two threads must never take
        from the DataLoader's one iterator."""
        if self._pass is not None and not self._pass.stop(wait_s=wait_s):
            from fdl import console

            console.warn(f"a DataLoader worker has not answered for {wait_s:g} s; the run ends "
                         "without the batch it is making (is the dataset's __getitem__ stuck?)")
        self._pass = None
        self._loader = self._ahead = None
