"""``fdl run --resume`` is planned from ``config.json`` alone: ``--dry-run`` shows what would run
without reading a checkpoint; a real run checks the checkpoints before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import assert_one_error, run_fdl


def _earlier_run(tmp_path: Path) -> Path:
    """A run directory as fdl run leaves it, but without any checkpoint."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('trained')\n")
    run_dir = project / "runs" / "first"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({
        "script": str(project / "train.py"), "args": ["--lr", "0.1"], "module": False,
        "settings": {"policy": {"value": "async", "source": "flag"},
                     "epochs": {"value": 7, "source": "file:/elsewhere/fdl.toml"},
                     "simulate_slowdown": {"value": [1, 2.5], "source": "flag"}}}))
    return run_dir


def test_dry_run_plans_a_resume_from_config_json_without_reading_checkpoints(tmp_path):
    run_dir = _earlier_run(tmp_path)
    proc = run_fdl("run", "--dry-run", "--json", "--resume", str(run_dir), cwd=run_dir.parents[1])
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert (spec["script"], spec["args"]) == (str(run_dir.parents[1] / "train.py"),
                                              ["--lr", "0.1"])
    assert spec["run_dir"] == str(run_dir)
    settings = spec["settings"]
    assert settings["policy"] == {"value": "async", "source": "flag"}  # a flag comes back
    assert settings["simulate_slowdown"] == {"value": [1.0, 2.5], "source": "flag"}
    assert settings["epochs"]["source"] == "default"  # a file value is the file's business
    assert spec["env"]["FDL_RESUME"] == "1"


def test_a_flag_given_again_wins_over_the_earlier_runs(tmp_path):
    run_dir = _earlier_run(tmp_path)
    proc = run_fdl("run", "--dry-run", "--json", "--resume", str(run_dir), "--policy", "sync",
                   cwd=run_dir.parents[1])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["settings"]["policy"] == {"value": "sync", "source": "flag"}


def test_a_real_resume_without_a_checkpoint_starts_nothing(tmp_path):
    run_dir = _earlier_run(tmp_path)
    before = sorted(p.name for p in run_dir.rglob("*"))
    proc = run_fdl("run", "--resume", str(run_dir), cwd=run_dir.parents[1])
    assert_one_error(proc, 2, "no usable checkpoint", "--checkpoint-every")
    assert "trained" not in proc.stdout
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_setting_entry_without_a_value_is_left_out_not_a_traceback(tmp_path):
    run_dir = _earlier_run(tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    config["settings"]["seed"] = {"source": "flag"}  # torn or edited by hand
    (run_dir / "config.json").write_text(json.dumps(config))
    proc = run_fdl("run", "--dry-run", "--json", "--resume", str(run_dir), cwd=run_dir.parents[1])
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(proc.stdout)["settings"]
    assert settings["seed"]["source"] == "default"
    assert settings["policy"] == {"value": "async", "source": "flag"}
