"""How a worker leaves once its script is done (fdl.launch.worker.freeze_for_exit): after a
script that ended well, what was garbage is finalized and the rest is frozen before Python's
teardown; after a script that failed, nothing changes. Each test runs the worker module as
``fdl run``'s agent does (``python -m fdl.launch.worker SCRIPT``), in a process of its own,
without a launcher (nothing here needs one), and reads what the script's ``atexit`` handler
and finalizer wrote (both live in a module of their own, ``probe``, so that neither keeps the
script's globals alive)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import atexit, gc, json

def report(path, what):
    with open(path, "a") as handle:
        handle.write(json.dumps(what) + "\\n")

def at_exit(path):
    report(path, {"at_exit_frozen": gc.get_freeze_count()})

class Cycle:
    # a finalizer only a collection can run: the object refers to itself
    def __init__(self, path):
        self.path, self.me = path, self
    def __del__(self):
        report(self.path, {"finalized": True})
"""

SCRIPT = """
import atexit, gc, sys
import probe

atexit.register(probe.at_exit, sys.argv[1])
kept = probe.Cycle(sys.argv[1])  # a global of the script: garbage once the script is done
probe.report(sys.argv[1], {"while_running_frozen": gc.get_freeze_count()})
"""


def run_worker(tmp_path: Path, ending: str) -> tuple[int, dict]:
    (tmp_path / "probe.py").write_text(PROBE)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + ending)
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "fdl.launch.worker", str(script), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    seen: dict = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        seen.update(json.loads(line))
    return proc.returncode, seen


@pytest.mark.parametrize("ending", ["", "sys.exit(0)\n", "sys.exit()\n"])
def test_a_script_that_ended_well_is_finalized_then_frozen(tmp_path, ending):
    code, seen = run_worker(tmp_path, ending)
    assert code == 0, seen
    assert seen["while_running_frozen"] == 0  # nothing is frozen under the script
    assert seen.get("finalized") is True, seen  # its garbage was collected first
    assert seen["at_exit_frozen"] > 0  # the rest was frozen before the teardown


@pytest.mark.parametrize("ending, code", [("sys.exit(3)\n", 3),
                                          ("raise RuntimeError('boom')\n", 1)])
def test_a_script_that_failed_exits_as_python_would(tmp_path, ending, code):
    returned, seen = run_worker(tmp_path, ending)
    assert returned == code, seen
    assert seen["at_exit_frozen"] == 0, seen
