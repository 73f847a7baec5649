"""Errors are one `error:` line plus a `hint:`, no traceback, with the documented exit codes."""

from __future__ import annotations

import pytest
from helpers import run_fdl


def test_unknown_command_is_a_usage_error():
    proc = run_fdl("frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ")
    assert "hint: see `fdl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_option_is_a_usage_error_naming_the_option():
    proc = run_fdl("diagnose", "--frob")
    assert proc.returncode == 2
    assert "--frob" in proc.stderr.splitlines()[0]
    assert "hint: see `fdl diagnose --help`" in proc.stderr


def test_fdl_error_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "survey.json"
    bad.write_text("{not json")
    proc = run_fdl("diagnose", env={"FDL_GPU_SURVEY": str(bad)})
    assert proc.returncode == 1
    first, *rest = proc.stderr.strip().splitlines()
    assert first.startswith("error: ") and str(bad) in first
    assert any(line.startswith("hint: ") for line in rest)
    assert "Traceback" not in proc.stderr


def test_fdl_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "survey.json"
    bad.write_text("{not json")
    proc = run_fdl("diagnose", env={"FDL_GPU_SURVEY": str(bad), "FDL_DEBUG": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert "error: " in proc.stderr


@pytest.mark.parametrize(("args", "usage"), [((), "Usage: fdl [OPTIONS] COMMAND"),
                                            (("libtorch",), "Usage: fdl libtorch [OPTIONS]")])
def test_no_arguments_shows_help_not_an_error(args, usage):
    proc = run_fdl(*args)
    assert proc.returncode == 2  # click's convention for a group called without a command
    assert proc.stderr.startswith(usage)
    assert "Commands:" in proc.stderr
    assert "error:" not in proc.stderr and "hint:" not in proc.stderr
