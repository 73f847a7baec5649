"""scripts/demo's `fdl run` command, taken from the script itself and run as it is (smaller: the
example's --hidden and --train-samples are given again at the end) in a fresh directory, twice:
the first run on a fresh clone, where runs/ does not exist yet, and a second one on the
checkout that ran it before. The demo is one of the README's two commands; CI does not run it
whole (minutes), so this holds the part that has broken before: the run directory."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from helpers import run_fdl

ROOT = Path(__file__).resolve().parent.parent


def demo_run_args() -> list[str]:
    """The words after `fdl` of scripts/demo's `fdl run` command (with its continuations)."""
    lines = (ROOT / "scripts" / "demo").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fdl run "))
    command = ""
    for line in lines[start:]:
        command += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(command)
    assert words[:2] == ["fdl", "run"], words
    return words[1:]


def test_the_demo_run_works_on_a_fresh_clone_and_again(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    args = [*demo_run_args(), "--hidden", "64", "--train-samples", "1024"]
    summary_path = tmp_path / "runs" / "demo-async" / "summary.json"
    written = []
    for attempt in ("fresh", "again"):
        proc = run_fdl(*args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=300)
        assert proc.returncode == 0, f"{attempt}: {proc.stderr[-2000:]}"
        summary = json.loads(summary_path.read_text())
        assert (summary["policy"], summary["world_size"], summary["emulated_slowdown"]) == (
            "async", 2, [1.0, 2.5]), summary
        written.append(summary_path.stat().st_mtime_ns)
    assert written[1] > written[0]  # the second run replaced the first
