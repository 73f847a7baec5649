"""Loader options for a plain dataset (run.batches / fdl.Trainer): worker processes, a
collate_fn, pinned batches on CUDA, prefetch; a bad value is one UsageError before training.
The runs are real (solo, in-process, with real loader processes); the CUDA default is checked
on a ``torch.device("cuda")`` object, which needs no GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    get_worker_info,
)

import fdl
from fdl.engine.data import MAX_PREFETCH, MAX_WORKERS, TrainData
from fdl.errors import UsageError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class Recorded(Dataset):
    """64 samples of 4 features; each sample says which process fetched it (0: the
    training process, else a loader worker's pid)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        worker = get_worker_info()
        return torch.full((4,), float(index)), index % 2, os.getpid() if worker else 0


def tagging_collate(samples):
    features, labels, pids = zip(*samples, strict=True)
    return torch.stack(features), torch.tensor(labels), torch.tensor(pids), "tagged"


@pytest.fixture
def solo(monkeypatch, tmp_path):
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))


def train(**options):
    """Two epochs of a tiny model over Recorded; returns each batch's (pids, tag)."""
    seen = []

    def step(model, batch):
        features, labels, pids, tag = batch
        seen.append((pids.tolist(), tag))
        return F.cross_entropy(model(features), labels)

    fdl.Trainer(model=lambda: nn.Linear(4, 2),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                train_step=step, train_data=Recorded(), batch_size=8, epochs=2,
                collate_fn=tagging_collate, **options).fit()
    return seen


def test_workers_fetch_every_batch_with_the_scripts_collate(solo):
    seen = train(num_workers=2, prefetch=3)
    assert len(seen) == 2 * 64 // 8 and all(tag == "tagged" for _, tag in seen)
    pids = {pid for batch, _ in seen for pid in batch}
    assert 0 not in pids  # not one sample made by the training process
    assert 1 <= len(pids) <= 2  # the same two workers for the whole run (kept between rounds)


def test_without_workers_the_training_process_makes_the_batches(solo):
    seen = train()
    assert {pid for batch, _ in seen for pid in batch} == {0}


def test_pinned_by_default_on_cuda_only_and_the_scripts_word_wins():
    data = TrainData.of(TensorDataset(torch.zeros(8, 2)))
    assert data.with_options(device=CUDA).pin_memory is True
    assert data.with_options(device=CPU).pin_memory is False
    assert data.with_options(device=CUDA, pin_memory=False).pin_memory is False
    loader = TrainData.of(DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4,
                                     pin_memory=True))
    assert loader.with_options(device=CPU).pin_memory is True  # the DataLoader's stands


def test_options_win_over_a_dataloaders():
    loader = TrainData.of(DataLoader(Recorded(), batch_size=4, num_workers=1,
                                     prefetch_factor=2))
    changed = loader.with_options(device=CPU, num_workers=3, prefetch=5,
                                  collate_fn=tagging_collate)
    assert (changed.num_workers, changed.prefetch_factor, changed.collate_fn) == (
        3, 5, tagging_collate)
    assert changed.batch_size == 4  # what the options do not name stays the DataLoader's


@pytest.mark.parametrize(("options", "message"), [
    ({"num_workers": -1}, "num_workers must be a whole number in"),
    ({"num_workers": MAX_WORKERS + 1}, "num_workers must be a whole number in"),
    ({"num_workers": 1.5}, "num_workers must be a whole number in"),
    ({"num_workers": True}, "num_workers must be a whole number in"),
    ({"collate_fn": "stack"}, "collate_fn must be a function"),
    ({"pin_memory": "yes"}, "pin_memory must be True or False"),
    ({"num_workers": 1, "prefetch": 0}, "prefetch must be a whole number in"),
    ({"num_workers": 1, "prefetch": MAX_PREFETCH + 1}, "prefetch must be a whole number in"),
    ({"prefetch": 2}, "prefetch needs loader workers"),
])
def test_a_bad_option_is_one_usage_error(options, message):
    with pytest.raises(UsageError, match=message):
        TrainData.of(Recorded()).with_options(device=CPU, **options)


def test_a_bad_option_stops_the_trainer_before_any_step(solo):
    with pytest.raises(UsageError, match="num_workers must be"):
        train(num_workers=-3)


class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(4), 0


def test_streaming_data_refuses_loader_options(solo):
    run = fdl.init()
    model = nn.Linear(4, 2)
    with pytest.raises(UsageError, match=r"loader options \(num_workers\) are for a map-style"):
        next(iter(run.batches(Endless(), model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                          lr=0.1),
                              max_steps=2, num_workers=2)))
    run.abandon()
