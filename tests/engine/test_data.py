"""The engine's sample stream: epoch orders, a rank's batches, device moves, eval shards."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from fdl.engine.data import batch_size_of, epoch_permutation, shard, slice_batches, to_device


class ListDataset(Dataset):
    """The same samples as a TensorDataset, but not one: takes the default_collate path."""

    def __init__(self, dataset: TensorDataset):
        self.samples = [dataset[i] for i in range(len(dataset))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


class DictDataset(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((2,), float(index)), "y": torch.tensor(index)}


def tensor_dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size * 3, dtype=torch.float32).view(size, 3),
                         torch.arange(size))


# ---------------------------------------------------------------------------------------------
# epoch_permutation


def test_epoch_permutation_is_randperm_seeded_with_seed_plus_epoch():
    for seed, epoch in [(0, 0), (42, 0), (42, 3), (7, 11)]:
        expected = torch.randperm(50, generator=torch.Generator().manual_seed(seed + epoch))
        assert torch.equal(epoch_permutation(seed=seed, epoch=epoch, size=50), expected)


def test_epoch_permutation_is_deterministic_and_a_permutation():
    first = epoch_permutation(seed=42, epoch=2, size=100)
    assert torch.equal(first, epoch_permutation(seed=42, epoch=2, size=100))
    assert torch.equal(first.sort().values, torch.arange(100))


def test_epoch_permutation_differs_across_epochs():
    orders = [epoch_permutation(seed=42, epoch=e, size=100) for e in range(4)]
    for i in range(len(orders)):
        for j in range(i + 1, len(orders)):
            assert not torch.equal(orders[i], orders[j]), (i, j)


# ---------------------------------------------------------------------------------------------
# slice_batches


@pytest.mark.parametrize(("start", "stop", "batch_size", "sizes"), [
    (0, 20, 5, [5, 5, 5, 5]),
    (3, 17, 5, [5, 5, 4]),
    (10, 11, 4, [1]),
    (0, 20, 64, [20]),
    (5, 5, 4, []),
])
def test_slice_batches_covers_exactly_the_slice_in_order(start, stop, batch_size, sizes):
    dataset = tensor_dataset(20)
    order = epoch_permutation(seed=1, epoch=0, size=20)
    batches = list(slice_batches(dataset, order, start=start, stop=stop, batch_size=batch_size))
    assert [len(labels) for _, labels in batches] == sizes
    seen = torch.cat([labels for _, labels in batches]) if batches else torch.empty(0)
    assert torch.equal(seen, order[start:stop].to(seen.dtype))
    for features, labels in batches:  # rows stay paired with their labels
        assert torch.equal(features, dataset.tensors[0][labels])


def test_tensor_dataset_fast_path_gives_the_same_tensors_as_default_collate():
    fast_dataset = tensor_dataset(23)
    slow_dataset = ListDataset(fast_dataset)
    order = epoch_permutation(seed=3, epoch=1, size=23)
    fast = list(slice_batches(fast_dataset, order, start=2, stop=21, batch_size=6))
    slow = list(slice_batches(slow_dataset, order, start=2, stop=21, batch_size=6))
    assert len(fast) == len(slow) == 4
    for fast_batch, slow_batch in zip(fast, slow, strict=True):
        assert len(fast_batch) == len(slow_batch) == 2
        for fast_tensor, slow_tensor in zip(fast_batch, slow_batch, strict=True):
            assert fast_tensor.dtype == slow_tensor.dtype
            assert torch.equal(fast_tensor, slow_tensor)


def test_slice_batches_collates_dict_samples():
    order = epoch_permutation(seed=0, epoch=0, size=10)
    batches = list(slice_batches(DictDataset(10), order, start=1, stop=8, batch_size=3))
    assert [batch["y"].tolist() for batch in batches] == [
        order[1:4].tolist(), order[4:7].tolist(), order[7:8].tolist()]
    for batch in batches:
        assert set(batch) == {"x", "y"}
        assert torch.equal(batch["x"], batch["y"].float().unsqueeze(1).expand(-1, 2))


# ---------------------------------------------------------------------------------------------
# to_device

Pair = namedtuple("Pair", ["inputs", "target"])


def test_to_device_moves_every_tensor_of_a_nested_batch_and_keeps_its_shape():
    meta = torch.device("meta")
    batch = {"pair": Pair(torch.ones(2), [torch.zeros(3), "label"]),
             "tuple": (torch.arange(2), 5), "list": [torch.ones(1), None]}
    moved = to_device(batch, meta)
    assert set(moved) == {"pair", "tuple", "list"}
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].inputs.device == meta and moved["pair"].inputs.shape == (2,)
    assert isinstance(moved["pair"].target, list)
    assert moved["pair"].target[0].device == meta and moved["pair"].target[1] == "label"
    assert type(moved["tuple"]) is tuple
    assert moved["tuple"][0].device == meta and moved["tuple"][1] == 5
    assert isinstance(moved["list"], list)
    assert moved["list"][0].device == meta and moved["list"][1] is None
    # the original batch is left alone
    assert batch["pair"].inputs.device.type == "cpu"


def test_to_device_on_the_same_device_keeps_values():
    batch = (torch.arange(4), {"y": torch.ones(2)})
    moved = to_device(batch, torch.device("cpu"))
    assert torch.equal(moved[0], batch[0]) and torch.equal(moved[1]["y"], batch[1]["y"])
    assert to_device("text", torch.device("cpu")) == "text"


# ---------------------------------------------------------------------------------------------
# shard


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("size", range(21))
def test_shard_covers_the_range_once_with_sizes_within_one(size, world_size):
    shards = [shard(size, rank=rank, world_size=world_size) for rank in range(world_size)]
    covered = [i for start, stop in shards for i in range(start, stop)]
    assert covered == list(range(size))  # contiguous, in rank order, each index once
    lengths = [stop - start for start, stop in shards]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the extra items go to the first ranks


# ---------------------------------------------------------------------------------------------
# batch_size_of


@pytest.mark.parametrize(("batch", "expected"), [
    (torch.zeros(7, 3), 7),
    (torch.tensor(2.5), 1),
    ((torch.zeros(4), torch.zeros(4)), 4),
    ([torch.zeros(5, 2), torch.zeros(5)], 5),
    ({"x": torch.zeros(6, 2), "y": torch.zeros(6)}, 6),
    (Pair(torch.zeros(3), torch.zeros(3)), 3),
    ([{"x": torch.zeros(2, 9)}], 2),
])
def test_batch_size_of_is_the_first_tensors_leading_dimension(batch, expected):
    assert batch_size_of(batch) == expected


def test_batch_size_of_a_collated_batch_whose_first_field_is_text():
    """default_collate leaves strings as lists; the size must come from the first tensor."""
    samples = [{"text": f"sample {i}", "label": torch.tensor(i)} for i in range(3)]
    assert batch_size_of(default_collate(samples)) == 3
    pairs = [(f"sample {i}", torch.tensor(i)) for i in range(3)]
    assert batch_size_of(default_collate(pairs)) == 3


@pytest.mark.parametrize("batch", [[], (), None, 3, {}])
def test_batch_size_of_something_without_a_tensor_is_a_type_error(batch):
    with pytest.raises(TypeError, match="cannot tell the batch size"):
        batch_size_of(batch)
