"""The engine's sample stream: epoch orders, a rank's batches (collated as the user's DataLoader
would), device moves, batch sizes."""

from __future__ import annotations

from collections import UserDict, namedtuple
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from fdl.engine.data import (
    TrainData,
    batch_size_of,
    collate,
    epoch_permutation,
    index_batches,
    index_lists,
    slice_batches,
    to_device,
)


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


class Sequences(Dataset):
    """Sample i: a sequence of (i % 5) + 1 values all equal to i, and label i."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full(((index % 5) + 1,), float(index)), index


def pad_collate(samples: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Dynamic padding: each batch padded to its own longest sequence."""
    lengths = torch.tensor([len(sequence) for sequence, _ in samples])
    padded = torch.zeros(len(samples), int(lengths.max()))
    for row, (sequence, _) in enumerate(samples):
        padded[row, :len(sequence)] = sequence
    return {"input": padded, "lengths": lengths,
            "label": torch.tensor([label for _, label in samples])}


def check_padded(batches: list[dict[str, torch.Tensor]], expected: list[list[int]]) -> None:
    assert [batch["label"].tolist() for batch in batches] == expected
    for batch in batches:
        labels = batch["label"]
        assert batch["lengths"].tolist() == [(i % 5) + 1 for i in labels.tolist()]
        assert batch["input"].shape == (len(labels), int(batch["lengths"].max()))
        for row, length in zip(batch["input"], batch["lengths"].tolist(), strict=True):
            assert torch.equal(row[:length], torch.full((length,), float(row[0])))
            assert not row[length:].any()
        assert torch.equal(batch["input"][:, 0], labels.float())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_slice_batches_collates_with_the_loaders_collate_fn(num_workers):
    data = TrainData.of(DataLoader(Sequences(), batch_size=8, collate_fn=pad_collate,
                                   num_workers=num_workers))
    order = epoch_permutation(seed=5, epoch=0, size=40)
    batches = list(slice_batches(data, order, start=3, stop=30, batch_size=6))
    check_padded(batches, index_lists(index_batches(order, start=3, stop=30, batch_size=6)))


def test_a_tensor_dataset_with_its_own_collate_fn_is_collated_by_it():
    dataset = tensor_dataset(10)
    data = TrainData(dataset=dataset, collate_fn=lambda samples: len(samples))
    assert not data.indexes_tensors
    assert collate(data, torch.tensor([1, 4, 7])) == 3
    assert TrainData(dataset=dataset).indexes_tensors


def test_collate_fetches_through_getitems_when_the_dataset_has_it():
    """HuggingFace datasets fetch a batch at once; DataLoader's workers call __getitems__."""

    class Batched(ListDataset):
        def __init__(self, dataset: TensorDataset):
            super().__init__(dataset)
            self.calls: list[list[int]] = []

        def __getitems__(self, indices: list[int]):
            self.calls.append(indices)
            return [self.samples[i] for i in indices]

    dataset = Batched(tensor_dataset(9))
    features, labels = collate(dataset, torch.tensor([8, 0, 3]))
    assert dataset.calls == [[8, 0, 3]]
    assert labels.tolist() == [8, 0, 3]
    assert torch.equal(features, dataset.samples[0][0].new_tensor(
        [dataset.samples[i][0].tolist() for i in (8, 0, 3)]))


def test_index_batches_cuts_the_slice_of_the_order():
    order = torch.tensor([5, 3, 9, 1, 0, 2, 8])
    batches = index_batches(order, start=1, stop=6, batch_size=2)
    assert all(b.untyped_storage().data_ptr() == order.untyped_storage().data_ptr()
               for b in batches)  # views of the order: no copy, no list
    assert index_lists(batches) == [[3, 9], [1, 0], [2]]
    assert index_batches(order, start=4, stop=4, batch_size=2) == []
    assert index_lists([range(2), (5, 1)]) == [[0, 1], [5, 1]]


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


class Encoding(UserDict):
    """What HuggingFace's BatchEncoding is: a UserDict that moves itself with .to()."""

    def to(self, device: torch.device) -> Encoding:
        self.data = {key: value.to(device) for key, value in self.data.items()}
        self.moved_to = device
        return self


class ReadOnly(Mapping):
    def __init__(self, **values):
        self.values_ = values

    def __getitem__(self, key):
        return self.values_[key]

    def __iter__(self):
        return iter(self.values_)

    def __len__(self) -> int:
        return len(self.values_)


@dataclass
class Inputs:
    ids: torch.Tensor
    mask: torch.Tensor
    name: str = "inputs"
    numel: int = field(init=False, default=0)


def test_to_device_lets_a_mapping_with_to_move_itself():
    meta = torch.device("meta")
    moved = to_device({"enc": Encoding(ids=torch.ones(2, 3), mask=torch.ones(2, 3))}, meta)
    assert isinstance(moved["enc"], Encoding) and moved["enc"].moved_to == meta
    assert moved["enc"]["ids"].device == meta and moved["enc"]["mask"].device == meta


def test_to_device_moves_the_values_of_any_mapping():
    moved = to_device(ReadOnly(x=torch.ones(2), label="a"), torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["label"] == "a"


def test_to_device_copies_a_dataclass_with_its_fields_moved():
    batch = Inputs(ids=torch.ones(4, 2), mask=torch.zeros(4, 2), name="b")
    moved = to_device(batch, torch.device("meta"))
    assert isinstance(moved, Inputs) and moved is not batch
    assert moved.ids.device.type == "meta" and moved.mask.device.type == "meta"
    assert moved.name == "b" and batch.ids.device.type == "cpu"


# ---------------------------------------------------------------------------------------------
# batch_size_of


@pytest.mark.parametrize(("batch", "expected"), [
    (torch.zeros(7, 3), 7),
    (torch.tensor(2.5), 1),
    ((torch.zeros(4), torch.zeros(4)), 4),
    ([torch.zeros(5, 2), torch.zeros(5)], 5),
    ({"x": torch.zeros(6, 2), "y": torch.zeros(6)}, 6),
    (Pair(torch.zeros(3), torch.zeros(3)), 3),
    (Encoding(ids=torch.zeros(8, 5)), 8),
    (ReadOnly(text=["a", "b"], y=torch.zeros(2)), 2),
    (Inputs(ids=torch.zeros(6, 1), mask=torch.zeros(6, 1)), 6),
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
