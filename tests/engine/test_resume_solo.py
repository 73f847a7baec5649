"""Resume equivalence, in-process and solo (no averaging, so the result is exact): a run resumed
from its epoch-1 checkpoint ends with exactly the model of the same run left alone: weights,
optimizer momentum, data order and the dropout RNG all continue where they stopped."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from common import make_data, train_step

import fdl
from fdl.rundir.checkpoints import latest_checkpoint


def trainer(epochs: int = 3, *, num_samples: int = 512,
            checkpoint_every: int | str = 1) -> fdl.Trainer:
    return fdl.Trainer(
        model=lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 2)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        train_step=train_step, train_data=make_data(num_samples, seed=1), batch_size=32,
        epochs=epochs, seed=3, checkpoint_every=checkpoint_every)


@pytest.fixture
def solo_env(monkeypatch, tmp_path):
    """A solo run (no launcher variables: conftest) with its run directory in tmp_path."""
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(solo_env, monkeypatch):
    full = trainer().fit()
    checkpoints = sorted((solo_env / "checkpoints").glob("ckpt-r*"))
    assert [json.loads((c / "engine.json").read_text())["epoch"] for c in checkpoints] == [1, 2]
    shutil.rmtree(checkpoints[-1])  # as if the run had died during epoch 2
    torch.manual_seed(12345)  # a new process would not share this one's RNG either

    monkeypatch.setenv("FDL_RESUME", "1")
    resumed = trainer().fit()
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]
    assert resumed.summary["resumed_from"] == checkpoints[0].name
    records = [json.loads(line) for line in (solo_env / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]


def test_a_time_interval_checkpoints_within_an_epoch_and_resumes_there_exactly(solo_env,
                                                                               monkeypatch):
    # With a 1 ms interval a checkpoint is due after every round, so the newest one is taken
    # within the last epoch (the last round of the run takes none: model.pt is the result). A
    # single worker's rounds are 200 steps: epochs of 512 steps have several.
    def run():
        return trainer(epochs=2, num_samples=16384, checkpoint_every="0.001s").fit()

    full = run()
    newest, _ = latest_checkpoint(solo_env)
    engine = newest.engine_state()
    assert engine["epoch"] == 1 and 0 < engine["position"] < 16384
    monkeypatch.setenv("FDL_RESUME", "1")
    resumed = run()
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    # the resumed epoch's loss includes the half trained before the checkpoint
    assert resumed.history[-1]["train_loss"] == full.history[-1]["train_loss"]
    assert resumed.summary["resumed_from"] == newest.name


def test_no_resume_without_being_asked(solo_env):
    trainer(epochs=2).fit()
    assert latest_checkpoint(solo_env)[0] is not None
    again = trainer(epochs=2).fit()  # FDL_RESUME unset, attempt 0: a fresh run in the same dir
    assert again.summary["resumed_from"] is None


def test_resuming_a_checkpoint_at_the_last_epoch_asks_for_more_epochs(solo_env, monkeypatch):
    trainer(epochs=3).fit()
    monkeypatch.setenv("FDL_RESUME", "1")
    with pytest.raises(fdl.errors.UsageError, match=r"at epoch 2 \(1024 samples\) and this run has 2 epochs"):
        trainer(epochs=2).fit()
