"""GPU / NCCL layer (opt-in): skipped without CUDA (`pytest -m gpu tests/engine/test_gpu.py`).
The one-GPU tests ran on an H100 with torch 2.11+cu130 (2026-11-23); the two-GPU ones have not
run yet (no machine with two GPUs was available)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_fdl

from fdl.engine.timeline import read_events

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCRIPTS = Path(__file__).parent / "scripts"


def train(tmp_path: Path, nproc: int, *flags: str) -> Path:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *flags,
                   str(SCRIPTS / "elche_train.py"), str(out), "--batch-norm", cwd=tmp_path,
                   env={"FDL_VERIFY_REPLICAS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_one_gpu_trains_with_nccl(tmp_path, policy):
    run_dir = train(tmp_path, 1, "--policy", policy, "--backend", "nccl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["devices"][0].startswith("cuda:0")
    assert summary["eval"]["accuracy"] > 0.6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("policy", "backend"), [("cadence", "nccl"), ("async", "nccl"),
                                                 ("cadence", "cpu"), ("sync", "nccl")])
def test_two_gpus_replicas_identical(tmp_path, policy, backend):
    run_dir = train(tmp_path, 2, "--policy", policy, "--backend", backend,
                    "--simulate-slowdown", "1,2.5")
    events = [read_events(run_dir / "timeline" / f"rank{r}.jsonl") for r in (0, 1)]
    finals = [next(e["checksum"] for e in ev if e["kind"] == "final") for ev in events]
    assert finals[0] == finals[1]
    checks = [[e["checksum"] for e in ev if e["kind"] == "sync" and "checksum" in e]
              for ev in events]
    assert checks[0] == checks[1]


def test_a_cuda_run_resumes_from_its_checkpoint_loaded_as_data(tmp_path):
    """Checkpoints of a CUDA run (CUDA RNG state, optimizer state of CUDA tensors) load with
    weights_only=True, and `fdl run --resume` continues the run on the GPU."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    script = str(SCRIPTS / "recovery_train.py")
    first = run_fdl("run", "--nproc-per-node", "1", "--backend", "nccl", "--epochs", "2",
                    "--checkpoint-every", "1", "--run-dir", str(run_dir), script, str(out),
                    "2048", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    rank_state = torch.load(next((run_dir / "checkpoints").glob("ckpt-r*")) / "rank0.pt",
                            weights_only=True)
    assert rank_state["rng"]["cuda"].dtype == torch.uint8
    again = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads((out / "rank0.json").read_text())
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    assert result["summary"]["resumed_from"].startswith("ckpt-r")
