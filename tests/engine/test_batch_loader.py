"""BatchLoader: a slice's batches through DataLoader workers kept from one slice to the next."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading

import pytest
import torch
from test_data import Sequences, check_padded, pad_collate
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fdl.engine.batch_loader import DEPTH, BatchLoader, IndexFeed, TakenAhead
from fdl.engine.data import (
    TrainData,
    epoch_permutation,
    index_batches,
    index_lists,
    slice_batches,
)


class Pids(Dataset):
    """Sample i: (i, the pid of the process that fetched it)."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, os.getpid()])


def loader(num_workers: int = 2, dataset: Dataset | None = None) -> BatchLoader:
    return BatchLoader(TrainData.of(DataLoader(dataset or Pids(), batch_size=4,
                                               num_workers=num_workers)))


def samples(batches) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in batches]


def pids(batches) -> set[int]:
    return {int(pid) for batch in batches for pid in batch[:, 1]}


def test_the_same_workers_fetch_every_slice():
    order = epoch_permutation(seed=0, epoch=0, size=60)
    with loader() as batches:
        first = list(batches.slice_batches(order, start=0, stop=20, batch_size=4))
        second = list(batches.slice_batches(order, start=20, stop=45, batch_size=5))
    assert samples(first) == index_lists(index_batches(order, start=0, stop=20, batch_size=4))
    assert samples(second) == index_lists(index_batches(order, start=20, stop=45, batch_size=5))
    workers = pids(first)
    assert len(workers) == 2 and os.getpid() not in workers
    assert pids(second) == workers


def test_an_abandoned_slice_leaves_nothing_behind_for_the_next():
    """The elastic rank stops early: the batches its workers had prefetched are dropped."""
    order = torch.arange(60)
    with loader() as batches:
        stopped = batches.slice_batches(order, start=0, stop=40, batch_size=4)
        assert samples([next(stopped), next(stopped)]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        rest = list(batches.slice_batches(order, start=40, stop=50, batch_size=4))
        again = list(batches.slice_batches(order, start=50, stop=60, batch_size=4))
    assert samples(rest) == [[40, 41, 42, 43], [44, 45, 46, 47], [48, 49]]
    assert samples(again) == [[50, 51, 52, 53], [54, 55, 56, 57], [58, 59]]


def test_workers_collate_with_the_loaders_collate_fn():
    data = TrainData.of(DataLoader(Sequences(), batch_size=8, collate_fn=pad_collate,
                                   num_workers=2))
    order = epoch_permutation(seed=2, epoch=3, size=40)
    with BatchLoader(data) as batches:
        got = list(batches.slice_batches(order, start=5, stop=37, batch_size=7))
    check_padded(got, index_lists(index_batches(order, start=5, stop=37, batch_size=7)))


def test_the_pools_single_batches_are_made_in_this_process():
    with loader() as batches:
        batch = batches.collate(torch.tensor([7, 3]))
    assert batch.tolist() == [[7, os.getpid()], [3, os.getpid()]]


def test_without_workers_batches_are_made_in_this_process():
    before = len(multiprocessing.active_children())
    batches = loader(num_workers=0)
    got = list(batches.slice_batches(torch.arange(60), start=0, stop=8, batch_size=4))
    assert samples(got) == [[0, 1, 2, 3], [4, 5, 6, 7]] and pids(got) == {os.getpid()}
    assert len(batches) == 60
    tensors = TensorDataset(torch.arange(60).view(30, 2))  # indexed at once, no workers
    fast = loader(dataset=tensors)
    assert [b[0].tolist() for b in fast.slice_batches(torch.arange(30), start=0, stop=3,
                                                      batch_size=2)] == [[[0, 1], [2, 3]],
                                                                         [[4, 5]]]
    assert len(multiprocessing.active_children()) == before


def test_close_stops_the_workers_and_a_later_slice_starts_new_ones():
    before = len(multiprocessing.active_children())
    batches = loader()
    first = pids(batches.slice_batches(torch.arange(60), start=0, stop=8, batch_size=4))
    assert len(multiprocessing.active_children()) == before + 2
    batches.close()
    assert len(multiprocessing.active_children()) == before
    later = pids(batches.slice_batches(torch.arange(60), start=0, stop=8, batch_size=4))
    assert later.isdisjoint(first) and len(later) == 2
    batches.close()
    assert len(multiprocessing.active_children()) == before


def test_a_slice_without_a_batch_loader_starts_workers_for_that_slice_only():
    before = len(multiprocessing.active_children())
    data = TrainData.of(DataLoader(Pids(), batch_size=4, num_workers=2))
    got = list(slice_batches(data, torch.arange(60), start=10, stop=22, batch_size=4))
    assert samples(got) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    assert os.getpid() not in pids(got)
    assert len(multiprocessing.active_children()) == before


def test_the_feed_hands_out_one_pass_and_a_replace_starts_another():
    feed = IndexFeed()
    feed.replace([[1, 2], [3]])
    old = iter(feed)
    assert next(old) == [1, 2] and len(feed) == 1
    feed.replace([[9]])
    assert list(old) == [[3]]  # the old pass keeps its own lists
    assert list(feed) == [[9]] and list(feed) == []


class Reads(Dataset):
    """Sample i is i; every read is a line in ``log`` and an index on ``read`` (the workers'
    reads, in any process)."""

    def __init__(self, log):
        self.log, self.read = log, multiprocessing.get_context("fork").Queue()

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.log, "a") as log:
            log.write(f"{index}\n")
        self.read.put(index)
        return torch.tensor(index)


def reads(log) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def read_ahead(batches: BatchLoader, dataset: Reads, foreseen: list[list[int]]) -> None:
    """fetch_ahead(foreseen), then wait until the workers have read the batches handed to them
    (prefetch_factor 2 x 2 workers: the first four), as they do while an average runs."""
    batches.fetch_ahead(foreseen)
    first = sorted(i for batch in foreseen[:4] for i in batch)
    assert sorted(dataset.read.get(timeout=60) for _ in first) == first  # a guard only


def test_a_pass_fetched_ahead_goes_on_where_it_foresaw_right(tmp_path):
    """The slice foreseen while the average ran and the slice planned after it begin alike: the
    pass goes on, and the batches the workers fetched meanwhile are not fetched again."""
    log = tmp_path / "reads"
    with loader(dataset=(dataset := Reads(log))) as batches:
        read_ahead(batches, dataset, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]])
        got = list(batches.batches([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12]]))
        went_on = batches.went_on
    assert [b.tolist() for b in got] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12]]
    assert went_on
    assert sorted(reads(log)) == list(range(13))  # each once


def test_a_pass_fetched_ahead_ends_where_a_shorter_slice_does(tmp_path):
    log = tmp_path / "reads"
    with loader(dataset=(dataset := Reads(log))) as batches:
        read_ahead(batches, dataset, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]])
        short = batches.batches([[0, 1], [2, 3]])
        got = [next(short).tolist(), next(short).tolist()]
        assert batches.went_on
        after = list(batches.batches([[20, 21], [22]]))
    assert got == [[0, 1], [2, 3]] and [b.tolist() for b in after] == [[20, 21], [22]]


def test_a_slice_foreseen_wrong_is_fetched_anew(tmp_path):
    """The average moved the split: the pass started ahead is dropped, the slice is right."""
    log = tmp_path / "reads"
    with loader(dataset=(dataset := Reads(log))) as batches:
        read_ahead(batches, dataset, [[30, 31], [32, 33], [34, 35], [36, 37], [38]])
        got = list(batches.batches([[32, 33], [34, 35], [36, 37], [38, 39]]))
        assert not batches.went_on
    assert [b.tolist() for b in got] == [[32, 33], [34, 35], [36, 37], [38, 39]]


def test_a_pass_that_ended_is_not_asked_to_go_on(tmp_path):
    """Foreseen shorter than the workers' reach: that pass ended, so a longer slice that
    begins alike gets a pass of its own, whole."""
    log = tmp_path / "reads"
    with loader(dataset=(dataset := Reads(log))) as batches:
        read_ahead(batches, dataset, [[0, 1], [2, 3]])
        got = list(batches.batches([[0, 1], [2, 3], [4, 5], [6]]))
        assert not batches.went_on
    assert [b.tolist() for b in got] == [[0, 1], [2, 3], [4, 5], [6]]


def test_without_workers_nothing_is_fetched_ahead(tmp_path):
    log = tmp_path / "reads"
    batches = loader(num_workers=0, dataset=Reads(log))
    batches.fetch_ahead([[0, 1]])
    assert reads(log) == []
    assert [b.tolist() for b in batches.batches([[0, 1]])] == [[0, 1]]
    assert not batches.went_on


def test_the_feed_goes_on_only_from_what_it_handed_out():
    feed = IndexFeed()
    feed.replace([[1], [2], [3]])
    handing = iter(feed)
    assert next(handing) == [1]
    assert not feed.go_on([[2], [3]])  # begins elsewhere
    assert feed.go_on([[1], [5], [6]])
    assert list(handing) == [[5], [6]]
    assert not feed.go_on([[1], [5], [6], [7]])  # the pass has ended
    assert feed.go_on([[1], [5]])  # ends within what it handed out


class Recorded:
    """A pass's source: yields ``items`` (an Exception among them is raised there), noting
    the thread that takes each and how many batches the taker held ready at the time."""

    def __init__(self, items: list) -> None:
        self.items = iter(items)
        self.taker: TakenAhead | None = None
        self.threads: list[str] = []
        self.held: list[int] = []
        self.took = threading.Semaphore(0)

    def __iter__(self):
        return self

    def __next__(self):
        self.threads.append(threading.current_thread().name)
        assert self.taker is not None
        self.held.append(len(self.taker._ready))
        item = next(self.items)
        self.took.release()
        if isinstance(item, Exception):
            raise item
        return item


def taken(items: list) -> tuple[TakenAhead, Recorded]:
    source = Recorded(items)
    source.taker = TakenAhead(source)
    return source.taker, source


def test_a_pass_is_taken_off_the_step_s_thread_in_order_and_at_most_depth_ahead():
    ahead, source = taken(list(range(10)))
    assert source.threads == []  # nothing taken before the first batch is asked for
    assert next(ahead) == 0
    for _ in range(1 + DEPTH):  # the first, and DEPTH more while the step would compute
        assert source.took.acquire(timeout=60)  # a guard only
    assert list(ahead) == list(range(1, 10))
    ahead.stop()
    assert set(source.threads) == {"fdl-batches"}
    assert max(source.held) < DEPTH  # never a batch taken with DEPTH already waiting


def test_what_the_data_loader_raises_reaches_the_step_after_the_batches_before_it():
    ahead, _ = taken([0, 1, ValueError("sample 7 is torn"), 3])
    assert [next(ahead), next(ahead)] == [0, 1]
    with pytest.raises(ValueError, match="sample 7 is torn"):
        next(ahead)
    with pytest.raises(StopIteration):  # and the pass is over
        next(ahead)


def test_a_pass_left_early_stops_its_thread():
    """The elastic rank stops early: the thread waiting with DEPTH batches ready ends."""
    ahead, source = taken(list(range(100)))
    next(ahead)
    for _ in range(1 + DEPTH):
        assert source.took.acquire(timeout=60)  # a guard only
    ahead.stop()
    assert taking() == 0
    assert len(source.threads) == 1 + DEPTH


def test_a_new_pass_stops_the_last_one_s_thread_before_it_uses_the_loader():
    order = torch.arange(60)
    with loader() as batches:
        left = batches.slice_batches(order, start=0, stop=40, batch_size=4)
        next(left)
        assert taking() == 1
        again = batches.slice_batches(order, start=40, stop=48, batch_size=4)
        assert taking() == 0  # stopped; the new pass's starts at its first batch
        assert samples(again) == [[40, 41, 42, 43], [44, 45, 46, 47]]
        next(batches.slice_batches(order, start=0, stop=40, batch_size=4))
    assert taking() == 0  # close stopped it


def taking() -> int:
    """The threads taking a pass's batches now."""
    return [thread.name for thread in threading.enumerate()].count("fdl-batches")


class Stuck(Dataset):
    """Samples 0-3 come at once; any later one only once ``gate`` is set (a worker alive
    but stuck in the user's ``__getitem__``)."""

    def __init__(self) -> None:
        self.gate = multiprocessing.Event()

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> torch.Tensor:
        if index >= 4:
            self.gate.wait()
        return torch.tensor([index, os.getpid()])


def test_close_does_not_wait_for_ever_on_a_worker_that_never_answers(capfd):
    before = len(multiprocessing.active_children())
    dataset = Stuck()
    batches = BatchLoader(TrainData.of(DataLoader(dataset, batch_size=4, num_workers=1)))
    try:
        first = next(batches.slice_batches(torch.arange(60), start=0, stop=40, batch_size=4))
        assert first[:, 0].tolist() == [0, 1, 2, 3]
        closing = threading.Thread(target=batches.close, kwargs={"wait_s": 0.2})
        closing.start()
        closing.join(timeout=60)  # a guard only: unbounded, close waits for the gate
        assert not closing.is_alive()
        assert taking() == 1  # the thread is left to its batch
        said = " ".join(capfd.readouterr().err.split())  # one line, however it was wrapped
        assert said.startswith("warning: a DataLoader worker has not answered for 0.2 s")
    finally:
        dataset.gate.set()
    for thread in threading.enumerate():  # given its batch, the thread sees it was stopped
        if thread.name == "fdl-batches":
            thread.join(timeout=60)  # a guard only
    assert taking() == 0
    gc.collect()  # the DataLoader's iterator, the thread's last, shuts its worker down
    assert len(multiprocessing.active_children()) == before
