"""The child-process helper `fdl bench` and `fdl compare` run their cells with: output into the
log (and line by line to a callback), the exit code, Ctrl-C handed on to the child, and an
earlier attempt's run directory removed first, but never a directory that is not a run."""

from __future__ import annotations

import sys

import pytest
from helpers import clean_env

from fdl.errors import UsageError
from fdl.launch.child import log_tail, run_from_scratch, run_logged

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


def earlier_run(run_dir):
    """What an interrupted fdl run leaves: config.json as fdl run writes it, logs, a metric."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"fdl_version": "0.1.0"}')
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1}\n')


def test_from_scratch_removes_an_earlier_attempt_then_runs(tmp_path):
    run_dir = tmp_path / "out" / "runs" / "cell"
    earlier_run(run_dir)
    code = run_from_scratch([sys.executable, "-c", "print('ran')"], run_dir=run_dir,
                            log=tmp_path / "out" / "logs" / "cell.log", cwd=tmp_path,
                            env=clean_env())
    assert code == 0 and not run_dir.exists()
    assert (tmp_path / "out" / "logs" / "cell.log").read_text() == "ran\n"


@pytest.mark.parametrize("foreign", ["notes.txt", None], ids=["beside a run", "no run"])
def test_from_scratch_keeps_a_directory_that_is_not_a_run_and_starts_nothing(tmp_path, foreign):
    run_dir = tmp_path / "cell"
    if foreign:
        earlier_run(run_dir)
        (run_dir / foreign).write_text("mine\n")
    else:
        run_dir.mkdir()
        (run_dir / "mine.txt").write_text("mine\n")
    with pytest.raises(UsageError):
        run_from_scratch([sys.executable, "-c", "raise SystemExit(5)"], run_dir=run_dir,
                         log=tmp_path / "cell.log", cwd=tmp_path, env=clean_env())
    assert "mine\n" in [p.read_text() for p in run_dir.iterdir() if p.is_file()]
    assert not (tmp_path / "cell.log").exists()
