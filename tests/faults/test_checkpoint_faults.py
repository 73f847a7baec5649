"""Faults in the checkpoints fdl reads back: a file that runs code when unpickled, garbage that
matches its manifest, a truncated, altered or missing file, a missing or malformed manifest.
Each is skipped with a warning that names it, and the previous valid checkpoint is used.

The end-to-end tests share one real solo run (``fdl run``, one worker, 3 epochs, a checkpoint
after epochs 1 and 2) and resume a copy of it with ``fdl run --resume``; the rest call
fdl.rundir.checkpoints / fdl.engine.recovery in-process."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_solo_checkpoint
from helpers import run_fdl

from fdl.engine.recovery import find_resume_checkpoint
from fdl.errors import UsageError
from fdl.rundir import checkpoints as ckpt
from fdl.rundir.checkpoints import UnloadableFile, latest_checkpoint, load_rank_state
from fdl.rundir.timeline import read_events

SCRIPT = Path(__file__).parents[1] / "engine" / "scripts" / "recovery_train.py"


class RunsCode:
    """Unpickling this creates ``marker``: what an attacker's payload would do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace ``checkpoint/name`` with ``data`` and make the manifest match it."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def pickled(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def with_payload(path: Path, marker: Path) -> bytes:
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["extra"] = RunsCode(marker)
    return pickled(state)


@dataclass(frozen=True)
class Trained:
    run_dir: Path
    older: str  # the checkpoint taken after epoch 1
    newest: str  # after epoch 2 (the last epoch takes none: model.pt is the result)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Trained:
    base = tmp_path_factory.mktemp("trained")
    (base / "out").mkdir()
    result = run_fdl("run", "--run-dir", str(base / "run"), "--nproc-per-node", "1",
                     "--epochs", "3", "--checkpoint-every", "1", "--quiet-ranks", str(SCRIPT),
                     str(base / "out"), "256", cwd=base, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checkpoints = base / "run" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())  # ckpt-r<round>: in round order
    epochs = [json.loads((checkpoints / name / "engine.json").read_text())["epoch"]
              for name in names]
    assert epochs == [1, 2], names
    return Trained(base / "run", *names)


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(trained_run.run_dir, tmp_path / "run"))


def resume(run_dir: Path):
    result = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=run_dir.parent,
                     timeout=240)
    return result, result.stdout + result.stderr


def last_start(run_dir: Path) -> dict:
    return [e for e in read_events(run_dir, 0)
            if e["kind"] == "start"][-1]


def test_a_checkpoint_that_runs_code_when_loaded_is_refused_and_the_previous_used(
        trained_run, run_copy):
    older, newest_name = trained_run.older, trained_run.newest
    marker = run_copy.parent / "code-ran"
    newest = run_copy / "checkpoints" / newest_name
    plant(newest, "rank0.pt", with_payload(newest / "rank0.pt", marker))
    result, output = resume(run_copy)
    assert not marker.exists(), "unpickling a checkpoint ran code"
    assert result.returncode == 0, output[-3000:]
    assert f"checkpoint skipped: {newest_name}: rank0.pt" in output
    start = last_start(run_copy)
    assert start["resumed_from"] == older and start["epoch"] == 1
    assert any(line.startswith(f"{newest_name}: rank0.pt") for line in start["skipped"])


def test_a_garbage_model_file_that_matches_its_manifest_falls_back(trained_run, run_copy):
    older, newest = trained_run.older, trained_run.newest
    plant(run_copy / "checkpoints" / newest, "model.pt", bytes(range(256)) * 12)
    # a worker killed mid-line left half an event: the resumed run's events must survive it
    with (run_copy / "timeline" / "rank0.jsonl").open("a") as handle:
        handle.write('{"t": 1.0, "rank": 0, "kind": "rou')
    result, output = resume(run_copy)
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert f"checkpoint skipped: {newest}: model.pt" in output
    assert last_start(run_copy)["resumed_from"] == older
    assert json.loads((run_copy / "summary.json").read_text())["resumed_from"] == older


def test_every_checkpoint_refused_stops_an_explicit_resume(trained_run, tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(trained_run.run_dir, tmp_path / "run"))
    marker = tmp_path / "code-ran"
    for name in (trained_run.older, trained_run.newest):
        path = run_dir / "checkpoints" / name
        plant(path, "rank0.pt", with_payload(path / "rank0.pt", marker))
    env = {"FDL_RESUME": "1"}
    with pytest.raises(UsageError, match=rf"no usable checkpoint .*{trained_run.older}: rank0\.pt"):
        find_resume_checkpoint(run_dir, rank=0, world_size=1, env=env)
    # after a crash (no explicit --resume) the restarted group starts afresh, with the warnings
    found, skipped = find_resume_checkpoint(run_dir, rank=0, world_size=1,
                                            env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert found is None and len(skipped) == 2
    assert not marker.exists()


def engine_with(path: Path, **changes) -> bytes:
    return json.dumps({**json.loads(path.read_text()), **changes}).encode()


def rank_state_with(path: Path, **changes) -> bytes:
    return pickled({**torch.load(path, weights_only=True), **changes})


def rank_state_field(path: Path, **changes) -> dict:
    """The RankState saved in ``path`` with ``changes``."""
    return {**torch.load(path, weights_only=True)["rank_state"], **changes}


@pytest.mark.parametrize(("name", "content", "why"), [
    ("engine.json", lambda p: b'{"epoch": "two"}', "the plan state has no 'round_index'"),
    ("engine.json", lambda p: b"[1, 2]", "the plan state is a list, not an object"),
    ("engine.json", lambda p: engine_with(p, world_size=3), "describes 3 ranks"),
    ("engine.json", lambda p: engine_with(p, position=-5),
     "'position' is -5, expected an integer >= 0"),
    ("rank0.pt", lambda p: pickled([1, 2]), "rank0.pt holds a list"),
    ("rank0.pt", lambda p: rank_state_with(p, rank_state=[0, 0.0]), "'rank_state' is [0, 0.0]"),
    ("rank0.pt", lambda p: rank_state_with(p, rank_state={"guard_streak": 0}),
     "rank_state does not load"),
    ("rank0.pt", lambda p: rank_state_with(p, rank_state=rank_state_field(p, step_count="9")),
     "rank_state does not load"),
    ("rank0.pt", lambda p: rank_state_with(p, rng={"torch": torch.zeros(3), "python": None}),
     "not torch's RNG state"),
    ("model.pt", lambda p: pickled(torch.zeros(2)), "model.pt holds a Tensor"),
], ids=["engine-fields", "engine-list", "engine-world", "engine-range", "rank-list",
        "rank-field", "rank-state-v1", "rank-state-type", "rank-rng", "model-tensor"])
def test_a_checkpoint_file_that_loads_but_holds_the_wrong_thing_is_skipped(
        trained_run, tmp_path, name, content, why):
    run_dir = Path(shutil.copytree(trained_run.run_dir, tmp_path / "run"))
    newest = run_dir / "checkpoints" / trained_run.newest
    plant(newest, name, content(newest / name))
    found, skipped = find_resume_checkpoint(run_dir, rank=0, world_size=1,
                                            env={"FDL_RESUME": "1"})
    assert found is not None and found.name == trained_run.older
    assert len(skipped) == 1 and skipped[0].startswith(f"{trained_run.newest}: {name}")
    assert why in skipped[0]


def test_loading_a_rank_state_never_unpickles_code(tmp_path):
    marker = tmp_path / "code-ran"
    path = write_solo_checkpoint(tmp_path, round_index=1)
    (path / "rank0.pt").write_bytes(pickled({"optimizer": RunsCode(marker)}))
    with pytest.raises(UnloadableFile, match=r"rank0\.pt does not load"):
        load_rank_state(ckpt.Checkpoint(path, {"world_size": 1}), rank=0)
    assert not marker.exists()


# --- in-process: what latest_checkpoint (the launcher's check, hashes only) refuses ---------


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    write_solo_checkpoint(tmp_path, round_index=1)
    newest = write_solo_checkpoint(tmp_path, round_index=2)
    data = bytearray((newest / "model.pt").read_bytes())
    data[-10] ^= 0xFF  # same size, different content
    (newest / "model.pt").write_bytes(bytes(data))
    found, skipped = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "ckpt-r00000001"
    assert skipped == ["ckpt-r00000002: model.pt does not match its SHA-256 in the manifest"]


def test_a_truncated_or_missing_file_is_detected(tmp_path):
    write_solo_checkpoint(tmp_path, round_index=1)
    newest = write_solo_checkpoint(tmp_path, round_index=2)
    size = (newest / "rank0.pt").stat().st_size
    with (newest / "rank0.pt").open("r+b") as handle:
        handle.truncate(size // 2)
    found, skipped = latest_checkpoint(tmp_path)
    assert found.name == "ckpt-r00000001"
    assert skipped == [f"ckpt-r00000002: rank0.pt has {size // 2} bytes, the manifest says {size}"]
    (newest / "rank0.pt").unlink()
    assert latest_checkpoint(tmp_path)[1] == ["ckpt-r00000002: rank0.pt is missing"]


def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path):
    write_solo_checkpoint(tmp_path, round_index=1)
    partial = tmp_path / "checkpoints" / "ckpt-r00000009"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"half")
    found, skipped = latest_checkpoint(tmp_path)
    assert found.name == "ckpt-r00000001"
    assert skipped == ["ckpt-r00000009: no manifest (the write did not finish)"]


@pytest.mark.parametrize(("change", "why"), [
    (lambda m, older: m.update(files=["model.pt"]), "unreadable manifest"),
    (lambda m, older: m["files"].update({"model.pt": "abc"}), "unreadable manifest"),
    (lambda m, older: m.update(world_size=0), "world_size"),
    (lambda m, older: m.update(world_size=1e9), "world_size"),
    (lambda m, older: m["files"].pop("rank0.pt"), "rank0.pt"),
    # a name reaching into the older checkpoint, with that file's true digest
    (lambda m, older: m["files"].update({"../ckpt-r00000001/model.pt": older}), "outside"),
], ids=["files-list", "entry-str", "world-0", "world-1e9", "no-rank0", "outside"])
def test_a_malformed_manifest_is_skipped_with_the_reason(tmp_path, change, why):
    older = write_solo_checkpoint(tmp_path, round_index=1)
    newest = write_solo_checkpoint(tmp_path, round_index=2)
    manifest = json.loads((newest / "manifest.json").read_text())
    change(manifest, ckpt.file_digest(older / "model.pt"))
    (newest / "manifest.json").write_text(json.dumps(manifest))
    found, skipped = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "ckpt-r00000001"
    assert len(skipped) == 1 and skipped[0].startswith("ckpt-r00000002: ")
    assert why in skipped[0]


def solo_trainer(*, hidden: int):
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import fdl

    features = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(features, (features[:, 0] > 0).long())
    return fdl.Trainer(
        model=lambda: nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 2)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        train_step=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        train_data=data, batch_size=32, epochs=2, seed=3, checkpoint_every=1)


def test_resuming_with_another_model_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    solo_trainer(hidden=16).fit()  # leaves the epoch-1 checkpoint
    monkeypatch.setenv("FDL_RESUME", "1")
    with pytest.raises(UsageError, match="its model or optimizer does not fit this run's") as \
            refused:
        solo_trainer(hidden=32).fit()
    # torch's first line ends at a colon: what does not fit is on the lines after it
    assert "size mismatch for 0.weight" in refused.value.message
    assert "\n" not in refused.value.message
