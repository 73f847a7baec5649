"""How `fdl run` ends, on real runs (2 gloo workers): what it says at the end of a run that never
used fdl's engine."""

from __future__ import annotations

from pathlib import Path

from helpers import run_fdl

SCRIPTS = Path(__file__).parent / "scripts"
TWO_CPU_WORKERS = ("--nproc-per-node", "2")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
GUARD_S = 120
UNREAD = "warning: the script did not train with fdl.Trainer"


# --- engine settings that were never read ------------------------------------------------------


def test_engine_settings_a_plain_ddp_script_never_reads_are_named_in_one_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "fdl.toml").write_text("epochs = 2\n")
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "ddp_train.py"), str(out),
                   cwd=tmp_path, env={**CPU_ONLY, "FDL_SEED": "3"}, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(UNREAD)]
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (f"{UNREAD}, so these settings were never read: policy (--policy), "
                        f"epochs ({tmp_path / 'fdl.toml'}), seed (FDL_SEED)")
    assert proc.stderr.splitlines()[-1] == lines[0], "said at the end of the run"


def test_a_trainer_script_reads_its_settings_and_nothing_is_said(tmp_path):
    release = tmp_path / "release"
    release.touch()  # watched_train.py trains straight through
    proc = run_fdl("run", *TWO_CPU_WORKERS, "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "watched_train.py"), str(release),
                   cwd=tmp_path, env=CPU_ONLY, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert "never read" not in proc.stderr, proc.stderr
    assert "fdl report: cadence on 2 worker(s)" in proc.stdout
