"""El Che end to end: `fdl run` with 2 real gloo workers on loopback, one emulated 2.5x slower.

Checks the contracts: sync equals plain torch DDP; replicas are bitwise identical after every
blocking average and at the end; summary.json has every field; the launcher's flags beat the
script's values, which beat defaults. (The divergence guard acting on a real run:
test_divergence_run.py; the trainer's correctness fixes: test_trainer_fixes.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_fdl

from fdl.rundir.timeline import read_events

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def fdl_train(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> tuple[Path, Path]:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir(exist_ok=True)
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), *flags,
                   str(SCRIPTS / "elche_train.py"), str(out), *script_args, cwd=tmp_path,
                   env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fdl report:" in proc.stdout and "efficiency" in proc.stdout  # printed at the end
    return out, run_dir


def test_sync_equals_plain_torch_ddp(tmp_path):
    out, _ = fdl_train(tmp_path, "--policy", "sync")
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "ddp_reference.py"), str(ref)], capture_output=True,
                          text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = torch.load(out / "rank0.pt"), torch.load(ref / "rank0.pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6, rtol=0), name
    # and training moved them: the comparison is not between two untouched inits
    torch.manual_seed(7)
    sys.path.insert(0, str(SCRIPTS))
    from common import build_model

    init = build_model().state_dict()
    assert any(not torch.allclose(init[n], ours[n]) for n in ours)


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_replicas_are_bitwise_identical_after_every_average(tmp_path, policy):
    _, run_dir = fdl_train(tmp_path, "--policy", policy, "--simulate-slowdown", "1,2.5",
                           "--epochs", "6", script_args=("--batch-norm",),
                           env={"FDL_VERIFY_REPLICAS": "1"})
    events = [read_events(run_dir, r) for r in (0, 1)]
    checks = [[(e["round"], e["checksum"]) for e in ev if e["kind"] == "sync" and
               "checksum" in e] for ev in events]
    assert checks[0] == checks[1]
    # cadence checks every round; async blocks (and checks) at every epoch end
    assert len(checks[0]) >= 6  # at least one blocking average per epoch
    finals = [next(e["checksum"] for e in ev if e["kind"] == "final") for ev in events]
    assert finals[0] == finals[1]
    # the fast rank did more of the work
    rounds = [[e for e in ev if e["kind"] == "round"] for ev in events]
    steps = [sum(e["steps"] for e in r) for r in rounds]
    assert steps[0] > 1.5 * steps[1]


def test_sync_replicas_identical_including_batchnorm_buffers(tmp_path):
    out, _ = fdl_train(tmp_path, "--policy", "sync", script_args=("--batch-norm",))
    a, b = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_summary_has_every_contract_field_and_metrics(tmp_path):
    out, run_dir = fdl_train(tmp_path, "--policy", "async", "--simulate-slowdown", "1,2.5")
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("policy", "backend", "world_size", "devices", "emulated_slowdown", "epochs",
                "samples", "wall_s", "throughput", "sync", "idle_fraction", "eval",
                "final_loss"):
        assert key in summary, key
    assert summary["policy"] == "async" and summary["backend"] == "cpu"
    assert summary["world_size"] == 2 and len(summary["devices"]) == 2
    assert summary["emulated_slowdown"] == [1.0, 2.5]
    assert summary["samples"] == 2 * 1024
    assert set(summary["throughput"]) == {"samples_per_s", "per_rank_samples_per_s"}
    rates = summary["throughput"]["per_rank_samples_per_s"]
    assert rates[0] > rates[1]
    assert set(summary["sync"]) == {"rounds", "mean_ms", "overhead"}
    assert summary["sync"]["rounds"] >= 2
    assert 0.5 <= summary["eval"]["accuracy"] <= 1.0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    assert (run_dir / "model.pt").is_file()
    result = json.loads((out / "rank0.json").read_text())
    assert result["metrics"] == summary["eval"]
    assert len(result["history"]) == 2


def test_launcher_flag_beats_script_value_beats_default(tmp_path):
    _, run_dir = fdl_train(tmp_path, "--policy", "cadence", script_args=("--policy", "sync"))
    engine = json.loads((run_dir / "config.json").read_text())["engine"]
    assert engine["policy"] == {"value": "cadence", "source": "flag"}
    assert engine["seed"] == {"value": 7, "source": "script"}
    assert engine["backend"] == {"value": "auto", "source": "default"}
    assert engine["resolved_backend"] == "cpu"

