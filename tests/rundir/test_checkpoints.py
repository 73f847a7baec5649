"""Checkpoint files: atomic writes, verification against the manifest, pruning, and when one is
due. Single process (gather = [obj]); the multi-worker path runs in test_recovery_runs.py, and
corrupt, partial or hostile checkpoints (the fallback to the previous one) in
tests/faults/test_checkpoint_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from checkpoint_helpers import write_solo_checkpoint
from helpers import GUARD_S, clean_env

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


def test_a_full_disk_while_writing_leaves_the_previous_checkpoint_alone(tmp_path):
    """A real full disk: the next checkpoint is written in a child whose file-size limit
    (RLIMIT_FSIZE) is 64 KiB, so its rank file fits and its 256 KiB model does not. The write
    fails as on a full disk; torch.save reports it as a RuntimeError, not an OSError (the
    patched torch.save this test once used raised OSError)."""
    first = write_solo_checkpoint(tmp_path, round_index=1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from fdl.rundir import checkpoints as ckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            ckpt.write_checkpoint(Path({str(tmp_path)!r}), round_index=2, rank=0, world_size=1,
                                  model_state={{"weight": torch.zeros(256, 256)}},
                                  rank_state={{"optimizer": {{"step": 2}}}},
                                  engine_state={{"epoch": 2, "history": []}},
                                  gather=lambda obj: [obj])
        except Exception as exc:  # torch.save: RuntimeError ("iostream error"), not OSError
            sys.exit(f"write failed: {{type(exc).__name__}}: {{exc}}")
        sys.exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=GUARD_S, env=clean_env())
    assert proc.returncode == 1 and "write failed: " in proc.stderr, proc.stderr
    # It got as far as the model: the rank file is staged, the model's partial file removed.
    staging = tmp_path / "checkpoints" / ".tmp-ckpt-r00000002"
    assert sorted(p.name for p in staging.iterdir()) == ["rank0.pt"]
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


def test_a_link_planted_where_a_checkpoint_goes_is_replaced_never_its_target(tmp_path):
    """A link named like the next checkpoint (planted, or a pruned one's name) is removed
    itself; the folder it points at keeps what it holds, and the checkpoint lands."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("mine")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-r00000003").symlink_to(victim)
    path = write_solo_checkpoint(tmp_path, round_index=3, value=1.5)
    assert not path.is_symlink() and (path / "manifest.json").is_file()
    assert (victim / "thesis.tex").read_text() == "mine"
    assert sorted(p.name for p in victim.iterdir()) == ["thesis.tex"]


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
