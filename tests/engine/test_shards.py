"""fdl.engine.shards in one process: the order a rank reads shard files in, batches across shard
and epoch boundaries, resume from every point, the shuffle buffer, IterableStream, the refusals;
and two ranks sharing an in-process store (torch's HashStore), the fast one taking three batches
for the slow one's one, resumed at every turn. ``test_shards_two_ranks.py`` runs the same
schedule on a real 2-process gloo group with these helpers."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from fdl.engine.data import epoch_permutation
from fdl.engine.shards import IterableStream, ShardStream, read_lines
from fdl.errors import UsageError

LENGTHS = (3, 5, 2, 6, 4, 7, 1)  # lines of each of the 7 shards: 28 in an epoch
BATCHES_PER_TURN = (3, 1)  # rank 0 is the fast one
EPOCHS = 2

Record = tuple[int, str]  # (epoch, line) of one sample


def write_shards(directory: Path, lengths: tuple[int, ...] = LENGTHS) -> list[Path]:
    """Text shards whose lines name themselves: ``s<shard>-l<line>``."""
    paths = []
    for shard, length in enumerate(lengths):
        path = directory / f"shard-{shard}.txt"
        path.write_text("".join(f"s{shard}-l{line}\n" for line in range(length)),
                        encoding="utf-8")
        paths.append(path)
    return paths


def shard_lines(shard: int, lengths: tuple[int, ...] = LENGTHS) -> list[str]:
    return [f"s{shard}-l{line}" for line in range(lengths[shard])]


class Tagged:
    """An ``open_shard`` that tags each line with the epoch its stream opened the shard in, so a
    test can tell which epoch each sample of a batch belongs to."""

    def __init__(self) -> None:
        self.stream: ShardStream | None = None

    def __call__(self, path: Path) -> list[Record]:
        return [(self.stream.epoch, line) for line in read_lines(path)]


def tagged_stream(paths: list[Path], *, rank: int = 0, world_size: int = 1, batch_size: int = 2,
                  **options: Any) -> ShardStream:
    opener = Tagged()
    opener.stream = ShardStream(paths, batch_size=batch_size, seed=0, rank=rank,
                                world_size=world_size, open_shard=opener, collate_fn=list,
                                **options)
    return opener.stream


def take_turn(stream: ShardStream, rank: int) -> list[Record]:
    return [sample for _ in range(BATCHES_PER_TURN[rank]) for sample in stream.next_batch()]


def assert_once_per_epoch(records: list[list[Record]], lengths: tuple[int, ...] = LENGTHS,
                          epochs: int = EPOCHS) -> None:
    """Every line of every shard read exactly once in each epoch, across the ranks, and each
    shard of an epoch by one rank only."""
    every_line = Counter(line for shard in range(len(lengths)) for line in shard_lines(shard))
    for epoch in range(epochs):
        seen = Counter(line for rank_records in records for e, line in rank_records if e == epoch)
        assert seen == every_line, f"epoch {epoch}"
        readers: dict[str, set[int]] = {}
        for rank, rank_records in enumerate(records):
            for e, line in rank_records:
                if e == epoch:
                    readers.setdefault(line.split("-")[0], set()).add(rank)
        assert all(len(ranks) == 1 for ranks in readers.values()), (epoch, readers)


def shards_read(records: list[Record], epochs: int = EPOCHS) -> int:
    return len({(e, line.split("-")[0]) for e, line in records if e < epochs})


# -- one rank, no group ------------------------------------------------------------------------

def test_one_rank_reads_each_epochs_shards_in_its_permutation_across_batches(tmp_path):
    paths = write_shards(tmp_path)
    stream = ShardStream([str(p) for p in paths], batch_size=4, seed=3, rank=0, world_size=1)
    per_epoch = sum(LENGTHS)  # 28: 7 batches of 4, which cut across shards
    batches = [stream.next_batch() for _ in range(2 * per_epoch // 4)]
    assert all(len(batch) == 4 for batch in batches)
    expected = [line for epoch in range(2)
                for shard in epoch_permutation(seed=3, epoch=epoch, size=7).tolist()
                for line in shard_lines(shard)]
    assert [line for batch in batches for line in batch] == expected
    assert (stream.epoch, stream.samples) == (1, 2 * per_epoch)
    assert stream.next_batch()[0] in {line for line in expected[:per_epoch]}
    assert stream.epoch == 2  # a budget in samples ends the run, not the data


def test_a_batch_runs_on_into_the_next_epoch(tmp_path):
    stream = tagged_stream(write_shards(tmp_path, (2, 3)), batch_size=4)
    first, second = stream.next_batch(), stream.next_batch()
    assert [e for e, _ in first] == [0, 0, 0, 0] and [e for e, _ in second] == [0, 1, 1, 1]


def test_every_resume_point_goes_on_with_the_next_line(tmp_path):
    paths = write_shards(tmp_path)
    for shuffle_buffer in (0, 3):
        whole = tagged_stream(paths, batch_size=1, shuffle_buffer=shuffle_buffer)
        reference = [whole.next_batch()[0] for _ in range(2 * sum(LENGTHS) + 5)]
        for cut in range(len(reference)):
            before = tagged_stream(paths, batch_size=1, shuffle_buffer=shuffle_buffer)
            head = [before.next_batch()[0] for _ in range(cut)]
            after = tagged_stream(paths, batch_size=1, shuffle_buffer=shuffle_buffer)
            after.load_state_dict(before.state_dict())
            tail = [after.next_batch()[0] for _ in range(len(reference) - cut)]
            assert head + tail == reference, (shuffle_buffer, cut)
            assert after.samples == len(reference)


def test_the_shuffle_buffer_mixes_a_shard_and_keeps_to_it(tmp_path):
    paths = write_shards(tmp_path, (40, 40))
    streams = [ShardStream(paths, batch_size=80, seed=0, rank=0, world_size=1,
                           shuffle_buffer=8) for _ in range(2)]
    epochs = [streams[0].next_batch(), streams[0].next_batch()]
    assert streams[1].next_batch() == epochs[0]  # seeded: the same order
    read = [{}, {}]  # per epoch: shard -> its lines in the order read
    for epoch, batch in enumerate(epochs):
        order = epoch_permutation(seed=0, epoch=epoch, size=2).tolist()
        for position, shard in enumerate(order):
            read[epoch][shard] = batch[40 * position:40 * (position + 1)]
    for shard in range(2):
        assert sorted(read[0][shard]) == sorted(shard_lines(shard, (40, 40)))
        assert read[0][shard] != shard_lines(shard, (40, 40))
        assert read[1][shard] != read[0][shard]  # another epoch, another shuffle


def test_any_items_with_their_own_open_shard_and_default_collate():
    shards = [torch.arange(0, 3), torch.arange(3, 5)]
    stream = ShardStream(shards, batch_size=5, seed=0, rank=0, world_size=1, open_shard=iter)
    batch = stream.next_batch()
    assert isinstance(batch, torch.Tensor) and sorted(batch.tolist()) == [0, 1, 2, 3, 4]


def test_empty_shards_are_passed_over_and_all_empty_is_an_error(tmp_path):
    paths = write_shards(tmp_path, (0, 2, 0))
    stream = ShardStream(paths, batch_size=4, seed=0, rank=0, world_size=1)
    assert sorted(stream.next_batch()) == ["s1-l0", "s1-l0", "s1-l1", "s1-l1"]
    empty = ShardStream(write_shards(tmp_path, (0, 0)), batch_size=1, seed=0, rank=0,
                        world_size=1)
    with pytest.raises(UsageError, match="all 2 shards gave no samples"):
        empty.next_batch()


def test_the_refusals(tmp_path):
    paths = write_shards(tmp_path, (2,))
    with pytest.raises(UsageError, match="no shards"):
        ShardStream([], batch_size=1, seed=0, rank=0, world_size=1)
    with pytest.raises(UsageError, match="batch_size must be >= 1"):
        ShardStream(paths, batch_size=0, seed=0, rank=0, world_size=1)
    with pytest.raises(UsageError, match="rank 2 is outside world_size 2"):
        ShardStream(paths, batch_size=1, seed=0, rank=2, world_size=2)
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match="there is no group"):
        ShardStream(paths, batch_size=1, seed=0, rank=0, world_size=2).next_batch()
    used = ShardStream(paths, batch_size=1, seed=0, rank=0, world_size=1)
    used.next_batch()
    with pytest.raises(UsageError, match="has read already"):
        used.load_state_dict(used.state_dict())
    other = ShardStream(paths, batch_size=1, seed=1, rank=0, world_size=1)
    with pytest.raises(UsageError, match="seed 0"):
        other.load_state_dict(used.state_dict())
    with pytest.raises(UsageError, match="lacks claimed"):
        ShardStream(paths, batch_size=1, seed=0, rank=0, world_size=1).load_state_dict(
            {"epoch": 0})


# -- two ranks in one process, through a HashStore ----------------------------------------------

def run_turns(streams: list[ShardStream], records: list[list[Record]], *,
              turns: int | None = None) -> None:
    """Turns of the schedule: rank 0 three batches, rank 1 one; ``turns`` of them, or until
    both ranks read the epoch after the last one checked."""
    done = 0
    while min(s.epoch for s in streams) < EPOCHS if turns is None else done < turns:
        for rank, stream in enumerate(streams):
            records[rank] += take_turn(stream, rank)
        done += 1


def two_ranks(paths: list[Path], store: Any) -> list[ShardStream]:
    return [tagged_stream(paths, rank=rank, world_size=2, store=store) for rank in range(2)]


def test_two_ranks_read_every_line_once_per_epoch_and_the_fast_one_more_shards(tmp_path):
    paths = write_shards(tmp_path)
    records: list[list[Record]] = [[], []]
    run_turns(two_ranks(paths, dist.HashStore()), records)
    assert_once_per_epoch(records)
    assert shards_read(records[0]) >= 2 * shards_read(records[1]) > 0  # it reads 3x the lines


def load_all(streams: list[ShardStream], states: list[dict[str, Any]]) -> None:
    """Every rank's load_state_dict at once (they wait for each other's claims)."""
    threads = [threading.Thread(target=stream.load_state_dict, args=(state,))
               for stream, state in zip(streams, states, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)


def test_two_ranks_resumed_at_any_turn_read_every_line_once_per_epoch(tmp_path):
    paths = write_shards(tmp_path)
    full: list[list[Record]] = [[], []]
    run_turns(two_ranks(paths, dist.HashStore()), full)
    apart = partial = 0
    num_turns = len(full[1]) // (2 * BATCHES_PER_TURN[1])  # batches of 2
    for cut in range(num_turns + 1):
        store = dist.HashStore()  # one store across the resume: the generation keeps apart
        records: list[list[Record]] = [[], []]
        streams = two_ranks(paths, store)
        run_turns(streams, records, turns=cut)
        states = [stream.state_dict() for stream in streams]
        run_turns(streams, [[], []], turns=2)  # read, then lost with the crash
        resumed = two_ranks(paths, store)
        load_all(resumed, states)
        run_turns(resumed, records)
        assert_once_per_epoch(records)
        apart += states[0]["epoch"] != states[1]["epoch"]
        partial += any(state["offset"] for state in states)
    assert apart and partial  # the cuts covered ranks in two epochs and half-read shards


# -- IterableStream ---------------------------------------------------------------------------

class Counting(IterableDataset):
    """0..size-1, shifted by 100 x the epoch given to set_epoch."""

    def __init__(self, size: int) -> None:
        self.size, self.epochs = size, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(100 * self.epochs[-1], 100 * self.epochs[-1] + self.size))


def test_an_iterable_dataset_is_read_again_each_epoch_and_resumes(tmp_path):
    dataset = Counting(5)
    stream = IterableStream(dataset, batch_size=3)
    batches = [stream.next_batch().tolist() for _ in range(4)]
    assert batches == [[0, 1, 2], [3, 4, 100], [101, 102, 103], [104, 200, 201]]
    assert (stream.epoch, stream.samples, dataset.epochs) == (2, 12, [0, 1, 2])
    state = stream.state_dict()
    resumed = IterableStream(Counting(5), batch_size=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch().tolist() == stream.next_batch().tolist() == [202, 203, 204]


def test_an_iterable_that_runs_once_is_an_error():
    stream = IterableStream((value for value in range(3)), batch_size=2, collate_fn=list)
    assert stream.next_batch() == [0, 1]
    with pytest.raises(UsageError, match="no samples in epoch 1"):
        stream.next_batch()
