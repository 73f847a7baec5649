"""The child-process helper `fdl bench` and `fdl compare` run their cells with: output into the
log (and line by line to a callback), the exit code, and Ctrl-C handed on to the child."""

from __future__ import annotations

import sys

import pytest
from helpers import clean_env

from fdl.bench.child import log_tail, run_logged

CHILD = """
import signal, sys, time
def stop(*_):
    open(sys.argv[2], "w").write("stopped by SIGINT")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("one"); print("two", file=sys.stderr); print("three")
if "--wait" in sys.argv:
    time.sleep(120)
sys.exit(3)
"""


def test_output_goes_to_the_log_and_to_echo_in_order(tmp_path):
    lines: list[str] = []
    code = run_logged([sys.executable, "-c", CHILD], log=tmp_path / "cell.log", cwd=tmp_path,
                      env=clean_env(), echo=lines.append)
    assert code == 3
    assert lines == ["one", "two", "three"]  # unbuffered: stdout and stderr interleave as written
    assert (tmp_path / "cell.log").read_text() == "one\ntwo\nthree\n"
    assert log_tail(tmp_path / "cell.log", count=2) == ["two", "three"]


def test_without_echo_the_output_goes_to_the_log_only(tmp_path, capfd):
    code = run_logged([sys.executable, "-c", CHILD], log=tmp_path / "cell.log", cwd=tmp_path,
                      env=clean_env())
    assert code == 3 and sorted((tmp_path / "cell.log").read_text().split()) == [
        "one", "three", "two"]
    assert capfd.readouterr().out == ""


def test_ctrl_c_stops_the_child_first(tmp_path):
    def interrupt(line: str) -> None:
        if line == "three":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_logged([sys.executable, "-c", CHILD, "--wait", str(tmp_path / "marker")],
                   log=tmp_path / "cell.log", cwd=tmp_path, env=clean_env(), echo=interrupt)
    # the child got its own SIGINT and had exited by the time KeyboardInterrupt reached us
    assert (tmp_path / "marker").read_text() == "stopped by SIGINT"
    assert log_tail(tmp_path / "missing.log") == []
