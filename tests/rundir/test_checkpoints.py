"""Checkpoint files: atomic writes, verification against the manifest, pruning, and when one is
due. Single process (gather = [obj]); the multi-worker path runs in test_recovery_runs.py, and
corrupt, partial or hostile checkpoints (the fallback to the previous one) in
tests/faults/test_checkpoint_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_solo_checkpoint

from fdl.errors import UsageError
from fdl.rundir import checkpoints as ckpt
from fdl.rundir.checkpoints import CheckpointEvery, latest_checkpoint, load_rank_state
from fdl.settings import parse_checkpoint_every


def test_a_checkpoint_holds_every_file_with_its_hash(tmp_path):
    path = write_solo_checkpoint(tmp_path, round_index=3, value=1.5)
    assert path == tmp_path / "checkpoints" / "ckpt-r00000003"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.pt", "rank0.pt", "engine.json"}
    assert manifest["round"] == 3 and manifest["world_size"] == 1
    for name, entry in manifest["files"].items():
        assert ckpt.file_digest(path / name) == entry
    found, skipped = latest_checkpoint(tmp_path)
    assert found is not None and found.path == path and skipped == []
    model, rank_state = load_rank_state(found, rank=0)
    assert torch.equal(model["weight"], torch.full((4, 4), 1.5))
    assert rank_state["optimizer"] == {"step": 3}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # no staging left behind


def test_a_crash_while_writing_leaves_the_previous_checkpoint_alone(tmp_path, monkeypatch):
    first = write_solo_checkpoint(tmp_path, round_index=1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    real_save = torch.save

    def crash_on_model(obj, path, *args, **kwargs):
        if "model.pt" in Path(path).name:  # its temporary name, .model.pt.<random>.tmp
            Path(path).write_bytes(b"partial")
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crash_on_model)
    with pytest.raises(OSError, match="disk full"):
        write_solo_checkpoint(tmp_path, round_index=2)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "ckpt-r00000002").exists()
    found, skipped = latest_checkpoint(tmp_path)
    assert found.path == first and skipped == []
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    write_solo_checkpoint(tmp_path, round_index=3)  # clears the crashed staging directory
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_only_the_newest_two_are_kept(tmp_path):
    for round_index in (1, 2, 3, 4):
        write_solo_checkpoint(tmp_path, round_index=round_index)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["ckpt-r00000003", "ckpt-r00000004"]


def test_a_different_world_size_maps_rank_states_modulo(tmp_path):
    path = tmp_path / "checkpoints" / "ckpt-r00000001"
    path.mkdir(parents=True)
    torch.save({"w": torch.zeros(1)}, path / "model.pt")
    for rank in (0, 1):
        torch.save({"optimizer": {"rank": rank}}, path / f"rank{rank}.pt")
    found = ckpt.Checkpoint(path, {"world_size": 2})
    assert [load_rank_state(found, rank=r)[1]["optimizer"]["rank"] for r in range(3)] == [0, 1, 0]


def test_when_a_checkpoint_is_due():
    every_two = CheckpointEvery.parse("2")
    assert [every_two.due(epochs_done=e, elapsed_s=0) for e in (1, 2, 3, 4)] == \
        [False, True, False, True]
    ten_minutes = CheckpointEvery.parse("600s")
    assert not ten_minutes.due(epochs_done=1, elapsed_s=599.9)
    assert ten_minutes.due(epochs_done=1, elapsed_s=600.0)
    assert CheckpointEvery.parse(None) is None


@pytest.mark.parametrize(("text", "canonical"), [
    ("3", "3"), (2, "2"), ("10m", "600s"), ("90s", "90s"), ("1.5h", "5400s"), (" 2M ", "120s"),
])
def test_checkpoint_every_parses_epochs_and_times(text, canonical):
    assert parse_checkpoint_every(text) == canonical
    assert CheckpointEvery.parse(canonical) is not None


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "m", "10x", "", "0s", "inf", True])
def test_checkpoint_every_rejects_bad_values(bad):
    with pytest.raises(UsageError, match="checkpoint_every must be"):
        parse_checkpoint_every(bad)
