"""`fdl --help` and every `fdl <cmd> --help` stay light: no torch, httpx, pynvml, rich.progress."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "httpx", "pynvml", "rich.progress")

PROBE = """
import runpy, sys
sys.argv = ["fdl", *{args!r}]
code = 0
try:
    runpy.run_module("fdl", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = [m for m in {heavy!r} if m in sys.modules]
print("RESULT", code, ",".join(heavy) or "none")
"""


def _commands() -> list[str]:
    """Every command path, nested groups included: ["diagnose"], ["libtorch", "env"], ..."""
    from typer.main import get_command

    from fdl.cli.main import app

    def walk(group, prefix):
        for name, command in sorted(group.commands.items()):
            yield [*prefix, name]
            if hasattr(command, "commands"):
                yield from walk(command, [*prefix, name])

    return list(walk(get_command(app), []))


def _probe(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(args=args, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, proc.stdout + proc.stderr
    return lines[-1]


def test_there_are_commands_to_check():
    commands = _commands()
    assert ["diagnose"] in commands and ["libtorch", "download"] in commands


@pytest.mark.parametrize("args", [["--help"], ["--version"],
                                  *[[*path, "--help"] for path in _commands()]])
def test_help_loads_no_heavy_module(args):
    assert _probe(args) == "RESULT 0 none"


def test_version_prints_the_package_version():
    import fdl

    proc = subprocess.run([sys.executable, "-m", "fdl", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout == f"fdl {fdl.__version__}\n"


def test_import_fdl_is_cheap():
    proc = subprocess.run([sys.executable, "-c", "import sys, fdl; print([m for m in "
                           f"{HEAVY!r} if m in sys.modules])"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]"
