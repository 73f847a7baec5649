"""Training data without ``len()``: shard files claimed through the process group's store, or
an ``IterableDataset``, as an endless stream of batches per rank.

    stream = ShardStream(sorted(glob("corpus/*.txt")), batch_size=32, seed=0,
                         rank=dist.get_rank(), world_size=dist.get_world_size())
    batch = stream.next_batch()   # 32 lines, across shard and epoch boundaries
    state = stream.state_dict()   # saved with the checkpoint, on every rank

**Claims.** Epoch ``e`` visits the shards in the order ``data.epoch_permutation`` draws from
(seed, e), the same on every rank. A rank that needs a shard takes the next one of that order
from an atomic counter in the group's store (``store.add(key, 1)``, one key per epoch); a count
past the end means every shard of the epoch is taken, and the rank goes on to epoch e+1. So
each shard is claimed exactly once per epoch across the ranks, a fast rank claims more of them,
and no rank waits at an epoch's end: a fast one may read epoch e+1 while a slow one finishes
its last shard of e. ``epoch`` is this rank's: the one it reads in. The stream never ends; a
budget in samples ends the run. Without a group and with ``world_size`` 1 the counter is local.
The keys hold the stream's ``name``: two fresh streams of one name in one group would share
their counters, so give each its own (``"train"``, ``"eval"``).

**Samples.** ``open_shard(item)`` gives a shard's samples in order: :func:`read_lines` by
default (a UTF-8 text file, one sample per line, without its line end); pass your own for
parquet, token ``.bin`` files and the like. A rank reads them in that order, or through a buffer
of ``shuffle_buffer`` samples shuffled with a generator seeded by (seed, epoch, shard). A batch
is ``collate_fn`` (``default_collate``) of ``batch_size`` samples, from one shard or several.

**Resume.** ``state_dict()`` is this rank's position: its epoch, the shards it claimed in it,
the one it is reading and how many of that one's samples it has read. ``load_state_dict`` on a
new stream (on every rank: they exchange their claims through the store) goes on from there:
each rank re-opens its current shard and skips what it had read; a shard any rank had claimed
in its epoch is not claimed again in that epoch (the epochs before the furthest rank's are all
taken); the others are claimed anew. Guaranteed: the samples read up to the states plus those
read after the resume hold every sample of every shard exactly once per epoch, provided that
(1) every rank's state was taken at one point of the run: no rank read between the first and
the last ``state_dict()`` (after a collective, where fdl checkpoints); (2) ``open_shard`` gives
the same samples in the same order each time; (3) the shards, seed and world size are the same.
Samples read after the states and before a crash are read again: the model that resumes from
that checkpoint never saw them. Skipping re-reads the current shard's head (a whole shard at
most).

**IterableDataset.** :class:`IterableStream` has the same ``next_batch``/``epoch``/state
interface: each rank iterates its own copy of the dataset, an epoch per pass (``set_epoch(e)``
is called first where the dataset has it). Each rank reads the whole stream unless the dataset
splits itself by ``torch.distributed.get_rank()`` (Hugging Face's ``split_dataset_by_node``);
its DataLoader-worker split (``get_worker_info``) is the dataset's own business, and a
``DataLoader(dataset, batch_size=None, num_workers=4)`` passed as the dataset reads in parallel.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.utils.data import default_collate

from fdl import readback
from fdl.engine.data import epoch_permutation
from fdl.engine.round_messages import group_store, restart_attempt
from fdl.errors import UsageError


def read_lines(path: Any) -> Iterator[str]:
    """The default ``open_shard``: a UTF-8 text file's lines, one sample each, without the line
    end (blank lines are samples too)."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            yield line[:-1] if line.endswith("\n") else line


class LocalCounter:
    """A store's atomic ``add`` for one process: the claims without a process group."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self._counts[key] = self._counts.get(key, 0) + amount
        return self._counts[key]


@dataclass
class ShardClaims:
    """Shard indices claimed through ``store``'s atomic counter ``key<epoch>``: the count a
    claim returns picks the next free shard in the epoch's permutation. After a resume, the
    epochs before ``resumed_epoch`` have no free shard and ``resumed_taken`` are not free in it."""

    num_shards: int
    seed: int
    store: Any  # anything with add(key, amount) -> int: the group's store, a LocalCounter
    key: str
    resumed_epoch: int = 0
    resumed_taken: frozenset[int] = frozenset()
    _free: tuple[int, list[int]] = field(default_factory=lambda: (-1, []), init=False,
                                         repr=False)  # (epoch, its free shards): one cached

    def claim(self, epoch: int) -> int | None:
        """The next shard of ``epoch`` for this rank, or None: every one is taken."""
        free = self.free(epoch)
        if not free:  # a resumed epoch already claimed out: no need to ask the store
            return None
        count = int(self.store.add(f"{self.key}{epoch}", 1))
        return free[count - 1] if count <= len(free) else None

    def free(self, epoch: int) -> list[int]:
        if self._free[0] != epoch:
            taken = (frozenset(range(self.num_shards)) if epoch < self.resumed_epoch
                     else self.resumed_taken if epoch == self.resumed_epoch else frozenset())
            order = epoch_permutation(seed=self.seed, epoch=epoch, size=self.num_shards).tolist()
            self._free = (epoch, [shard for shard in order if shard not in taken])
        return self._free[1]


@dataclass
class StreamPosition:
    """A rank's place in its shard stream: what ``state_dict`` saves. ``generation`` counts the
    resumes, so a resumed stream's counters never meet the ones its states were read from."""

    epoch: int = 0
    claimed: list[int] = field(default_factory=list)  # this rank's shards of ``epoch``, in order
    shard: int | None = None  # the one being read (the last claimed); None: between shards
    offset: int = 0  # samples of ``shard`` read
    samples: int = 0  # samples read in all
    generation: int = 0
    num_shards: int = 0
    seed: int = 0
    world_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StreamPosition:
        missing = sorted(set(cls.__dataclass_fields__) - set(state))
        if missing:
            raise UsageError(f"a shard stream's state lacks {', '.join(missing)}",
                             hint="pass what ShardStream.state_dict() returned")
        return cls(**{name: state[name] for name in cls.__dataclass_fields__})


class ShardStream:
    """This rank's endless stream of batches from ``shards`` (see the module's manual)."""

    def __init__(self, shards: Sequence[Any], *, batch_size: int, seed: int, rank: int,
                 world_size: int, open_shard: Callable[[Any], Iterable[Any]] = read_lines,
                 collate_fn: Callable[[list[Any]], Any] | None = None, store: Any = None,
                 name: str = "train", shuffle_buffer: int = 0) -> None:
        _check_counts(batch_size=batch_size, shuffle_buffer=shuffle_buffer)
        if not shards:
            raise UsageError("ShardStream got no shards", hint="pass a list of shard paths")
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is outside world_size {world_size}")
        self.shards, self.batch_size, self.rank = list(shards), batch_size, rank
        self.open_shard, self.collate_fn = open_shard, collate_fn or default_collate
        self.shuffle_buffer, self.name, self._store = shuffle_buffer, name, store
        self.position = StreamPosition(num_shards=len(shards), seed=seed, world_size=world_size)
        self._claims: ShardClaims | None = None  # the store is looked up on first use
        self._reader: Iterator[Any] | None = None
        self._empty: set[int] = set()  # shards that gave nothing since this rank's last sample

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def samples(self) -> int:
        return self.position.samples

    def next_batch(self) -> Any:
        """The next ``batch_size`` samples, collated."""
        return self.collate_fn([self._next_sample() for _ in range(self.batch_size)])

    def state_dict(self) -> dict[str, Any]:
        return self.position.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (this rank's ``state_dict()``); every rank must call it."""
        saved = StreamPosition.from_dict(state)
        here = self.position
        if here.samples or here.claimed:
            raise UsageError("load_state_dict on a shard stream that has read already",
                             hint="load the state into a new ShardStream")
        mine = (here.num_shards, here.seed, here.world_size)
        if (saved.num_shards, saved.seed, saved.world_size) != mine:
            raise UsageError(f"the stream's state is of {saved.num_shards} shards, seed "
                             f"{saved.seed}, world size {saved.world_size}; this stream has "
                             f"{mine[0]}, {mine[1]}, {mine[2]}")
        self.position = saved
        saved.generation += 1
        ranks = self._exchange({"epoch": saved.epoch, "claimed": saved.claimed})
        furthest = max(other["epoch"] for other in ranks)
        taken = {shard for other in ranks if other["epoch"] == furthest
                 for shard in other["claimed"]}
        self._claims = ShardClaims(saved.num_shards, saved.seed, self._resolve_store(),
                                   self._key(), furthest, frozenset(taken))

    def _next_sample(self) -> Any:
        while True:
            if self._reader is None:
                self._reader = self._open_reader()
            try:
                sample = next(self._reader)
            except StopIteration:
                self._finish_shard()
                continue
            self.position.offset += 1
            self.position.samples += 1
            self._empty.clear()
            return sample

    def _open_reader(self) -> Iterator[Any]:
        """The current shard's reader past what was read (after a resume), else the next
        claimed shard's, moving on to the next epoch when this one has none left."""
        position = self.position
        if position.shard is None:
            claims = self._open_claims()
            while (shard := claims.claim(position.epoch)) is None:
                position.epoch, position.claimed = position.epoch + 1, []
            position.claimed.append(shard)
            position.shard, position.offset = shard, 0
        samples = iter(self.open_shard(self.shards[position.shard]))
        if self.shuffle_buffer:
            generator = random.Random(f"{position.seed}/{position.epoch}/{position.shard}")
            samples = shuffled(samples, size=self.shuffle_buffer, generator=generator)
        return itertools.islice(samples, position.offset, None)

    def _finish_shard(self) -> None:
        position = self.position
        if position.offset == 0:
            self._empty.add(position.shard)
            if len(self._empty) == position.num_shards:
                raise UsageError(f"all {position.num_shards} shards gave no samples",
                                 hint="check the shard paths and open_shard")
        self._reader, position.shard, position.offset = None, None, 0

    def _open_claims(self) -> ShardClaims:
        if self._claims is None:
            self._claims = ShardClaims(self.position.num_shards, self.position.seed,
                                       self._resolve_store(), self._key())
        return self._claims

    def _key(self) -> str:
        return f"fdl/shards/{restart_attempt()}/{self.name}/{self.position.generation}/"

    def _resolve_store(self) -> Any:
        if self._store is None:
            self._store = group_store()
        if self._store is None:
            if self.position.world_size > 1:
                raise UsageError(f"a ShardStream of {self.position.world_size} ranks claims "
                                 "shards through the process group's store, and there is no "
                                 "group", hint="read the stream after the group is joined, "
                                               "or pass store=")
            self._store = LocalCounter()
        return self._store

    def _exchange(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``mine``, through the store (keys of the new generation)."""
        world_size = self.position.world_size
        if world_size == 1:
            return [mine]
        key = f"{self._key()}resume/"
        store = self._resolve_store()
        store.set(f"{key}{self.rank}", json.dumps(mine))
        # read as every file fdl reads back (depth and number limits): the store is open to
        # whoever reaches its port (docs/security.md)
        return [readback.parse_json(store.get(f"{key}{rank}")) for rank in range(world_size)]


class IterableStream:
    """Batches from an iterable dataset, re-iterated for each epoch, with ShardStream's
    interface (see the module's manual for how ranks share it)."""

    def __init__(self, dataset: Iterable[Any], *, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        _check_counts(batch_size=batch_size, shuffle_buffer=0)
        self.dataset, self.batch_size = dataset, batch_size
        self.collate_fn = collate_fn or default_collate
        self.epoch = self.offset = self.samples = 0  # offset: samples of this epoch read
        self._reader: Iterator[Any] | None = None

    def next_batch(self) -> Any:
        """The next ``batch_size`` samples, collated."""
        return self.collate_fn([self._next_sample() for _ in range(self.batch_size)])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on from ``state``: the epoch is iterated again and its first ``offset`` samples
        skipped (the same ones, if the dataset yields the same order for that epoch)."""
        self.epoch, self.offset, self.samples = state["epoch"], state["offset"], state["samples"]
        self._reader = None

    def _next_sample(self) -> Any:
        for _ in range(2):  # this epoch's rest, else the next epoch's first
            if self._reader is None:
                if hasattr(self.dataset, "set_epoch"):
                    self.dataset.set_epoch(self.epoch)
                self._reader = itertools.islice(iter(self.dataset), self.offset, None)
            for sample in self._reader:
                self.offset += 1
                self.samples += 1
                return sample
            self._reader, self.epoch, self.offset = None, self.epoch + 1, 0
        raise UsageError(f"the dataset gave no samples in epoch {self.epoch - 1}",
                         hint="pass a dataset that can be iterated again (a generator "
                              "runs once)")


def shuffled(samples: Iterable[Any], *, size: int, generator: random.Random) -> Iterator[Any]:
    """``samples`` through a shuffle buffer of ``size``: each yields a random one held, and
    the rest come out shuffled at the end; the same generator state, the same order."""
    held: list[Any] = []
    for sample in samples:
        if len(held) < size:
            held.append(sample)
            continue
        index = generator.randrange(size)
        yield held[index]
        held[index] = sample
    generator.shuffle(held)
    yield from held


def _check_counts(*, batch_size: int, shuffle_buffer: int) -> None:
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size!r}")
    if shuffle_buffer < 0:
        raise UsageError(f"shuffle_buffer must be >= 0, got {shuffle_buffer!r}")
