"""Agreement before training (fdl.engine.agreement): ranks that run different settings, data
or models stop together with one line naming the field, the rank and both values; ranks that
agree train (every other 2-worker test of the suite). Real `fdl run`s with 2 gloo workers; the
pure comparison and the data fingerprint in-process."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import run_fdl
from torch.utils.data import Dataset, TensorDataset

from fdl.engine.agreement import data_facts, first_difference
from fdl.engine.data import TrainData

SCRIPT = Path(__file__).parent / "scripts" / "disagree_train.py"


@pytest.mark.parametrize(("what", "field"), [
    ("data", "data fingerprint"), ("epochs", "settings"), ("model", "model")])
def test_ranks_that_differ_stop_together_naming_what(tmp_path, what, field):
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                   str(SCRIPT), what, cwd=tmp_path, timeout=240)
    assert proc.returncode != 0, proc.stdout[-2000:]
    said = proc.stdout + proc.stderr
    assert "rank 1 (node 0, " in said and f"differ in {field}: " in said, said[-3000:]
    assert f"trained {what}" not in said


def test_the_first_difference_is_named_with_both_values():
    same = {"torch release": "2.13.0", "settings": "{}"}
    assert first_difference([("node 0, a", same), ("node 1, b", dict(same))]) is None
    assert first_difference([("node 0, a", same), ("node 1, b",
                                                   {**same, "torch release": "2.11.0"})]) == \
        "rank 1 (node 1, b) and rank 0 (node 0, a) differ in torch release: 2.11.0 against 2.13.0"


class Augmented(Dataset):
    """Random noise added per item by torch's, Python's generators: a random augmentation."""

    def __init__(self, base: torch.Tensor):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.base[index] + torch.rand(()) + random.random()


def test_the_data_fingerprint_sees_the_samples_not_the_augmentation():
    model = torch.nn.Linear(4, 2)
    base = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    first = data_facts(TrainData.of(Augmented(base)), model, seed=5)
    torch.manual_seed(123)
    expected_next = torch.rand(())  # the caller's generator, as it was
    torch.manual_seed(123)
    again = data_facts(TrainData.of(Augmented(base)), model, seed=5)
    assert torch.rand(()) == expected_next
    assert first == again
    assert data_facts(TrainData.of(Augmented(base + 1)), model, seed=5)["data fingerprint"] != \
        first["data fingerprint"]
    tensors = data_facts(TrainData.of(TensorDataset(base, base.sum(1))), model, seed=5)
    assert tensors["train samples"] == "64"
