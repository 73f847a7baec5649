"""TrainData.of: what fdl takes from a DataLoader given as the data, and what it refuses."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_collate

from fdl.engine.data import TrainData
from fdl.errors import UsageError


def dataset(size: int = 16) -> TensorDataset:
    return TensorDataset(torch.arange(size * 2, dtype=torch.float32).view(size, 2),
                         torch.arange(size))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class NoLength(Dataset):
    def __getitem__(self, index: int) -> int:
        return index


def collate_pairs(samples):
    return samples


def seed_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def refusal(data, name: str = "train_data") -> UsageError:
    with pytest.raises(UsageError) as caught:
        TrainData.of(data, name=name)
    assert caught.value.exit_code == 2
    assert "\n" not in caught.value.message
    return caught.value


def test_a_map_style_dataset_is_itself_with_the_defaults():
    data = dataset()
    assert TrainData.of(data) == TrainData(dataset=data, batch_size=None,
                                           collate_fn=default_collate, num_workers=0,
                                           pin_memory=False)
    assert len(TrainData.of(data)) == 16
    samples = [(i, i * i) for i in range(5)]  # a list of samples is a dataset too
    assert TrainData.of(samples).dataset is samples


def test_a_train_data_is_itself():
    data = TrainData(dataset=dataset(), batch_size=4)
    assert TrainData.of(data) is data


def test_a_dataloader_gives_what_it_holds_and_counts_samples_not_batches():
    data = dataset(16)
    loader = DataLoader(data, batch_size=8, shuffle=True, collate_fn=collate_pairs,
                        num_workers=2, pin_memory=True, worker_init_fn=seed_worker,
                        prefetch_factor=5, multiprocessing_context="fork", drop_last=True)
    got = TrainData.of(loader)
    assert len(loader) == 2 and len(got) == 16
    assert got.dataset is data and got.batch_size == 8 and got.collate_fn is collate_pairs
    assert (got.num_workers, got.pin_memory, got.worker_init_fn, got.prefetch_factor) == \
        (2, True, seed_worker, 5)
    assert got.multiprocessing_context is loader.multiprocessing_context is not None


def test_a_default_loader_keeps_default_collate_and_so_the_tensor_fast_path():
    got = TrainData.of(DataLoader(dataset(), batch_size=4, num_workers=2))
    assert got.collate_fn is default_collate and got.indexes_tensors and not got.uses_workers


@pytest.mark.parametrize("sampler", [
    lambda data: SequentialSampler(data),
    lambda data: RandomSampler(data),
    lambda data: BatchSampler(RandomSampler(data), batch_size=6, drop_last=False),
])
def test_the_default_samplers_are_replaced_silently(sampler):
    data = dataset()
    made = sampler(data)
    loader = DataLoader(data, batch_sampler=made) if isinstance(made, BatchSampler) \
        else DataLoader(data, batch_size=6, sampler=made)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = TrainData.of(loader)
    assert got.dataset is data and got.batch_size == 6


def test_a_distributed_sampler_is_replaced_with_a_warning():
    data = dataset()
    loader = DataLoader(data, batch_size=4,
                        sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.warns(UserWarning, match="train_data's DistributedSampler is not used"):
        got = TrainData.of(loader)
    assert got.dataset is data and got.batch_size == 4


@pytest.mark.parametrize(("sampler", "shown"), [
    (lambda data: WeightedRandomSampler([1.0] * len(data), num_samples=len(data)),
     "WeightedRandomSampler"),
    (lambda data: SubsetRandomSampler(range(4)), "SubsetRandomSampler"),
    (lambda data: RandomSampler(data, replacement=True), "RandomSampler"),
    (lambda data: RandomSampler(data, num_samples=5), "RandomSampler"),
    (lambda data: list(range(8)), "list"),
])
def test_a_sampler_that_picks_or_weights_samples_is_refused(sampler, shown):
    data = dataset()
    error = refusal(DataLoader(data, batch_size=4, sampler=sampler(data)))
    assert f"train_data is a DataLoader with sampler={shown}" in error.message
    assert "Subset" in error.hint


def test_a_batch_sampler_with_its_own_batches_is_refused():
    class ByLength(BatchSampler):
        def __iter__(self):
            yield from ([0, 1, 2], [3], [4, 5])

    error = refusal(DataLoader(dataset(), batch_sampler=ByLength(range(6), 3, False)))
    assert "batch_sampler=ByLength" in error.message and "collate_fn" in error.hint
    error = refusal(DataLoader(dataset(), batch_sampler=[[0, 1], [2]]))
    assert "batch_sampler=list" in error.message


def test_a_plain_batch_sampler_over_a_subset_is_refused_as_its_sampler():
    loader = DataLoader(dataset(), batch_sampler=BatchSampler([0, 1, 2, 3], 2, False))
    assert "sampler=list" in refusal(loader).message


def test_a_loader_without_batching_is_refused():
    error = refusal(DataLoader(dataset(), batch_size=None), name="eval_data")
    assert error.message.startswith("eval_data is a DataLoader with batch_size=None")


@pytest.mark.parametrize(("data", "start"), [
    (Stream(), "train_data is an IterableDataset (Stream)"),
    (DataLoader(Stream(), batch_size=2), "train_data.dataset is an IterableDataset (Stream)"),
    (DataLoader(NoLength(), batch_size=2), "train_data.dataset has type NoLength; fdl trains on"),
    (NoLength(), "train_data has type NoLength; fdl trains on a map-style dataset"),
    (iter([1, 2]), "train_data has type list_iterator"),
    (12, "train_data has type int"),
    ("abc", "train_data has type str"),
    ({"train": [1], "test": [2]}, "train_data is a mapping (dict of 2: 'train', 'test')"),
])
def test_anything_else_is_one_line_naming_what_is_accepted(data, start):
    error = refusal(data)
    assert error.message.startswith(start)
    text = error.message + (error.hint or "")
    assert "map-style dataset" in text or "pass one split" in text
