"""fdl.console's info line and live-terminal check, which fdl run uses before its workers start
without importing rich (docs/run.md "Launch latency")."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from fdl import console


def test_info_writes_the_line_as_rich_would(capsys):
    """info() skips rich, and writes what rich writes of the same line: controls escaped,
    markup and emoji codes shown as typed."""
    message = "run directory /tmp/a[b]:smile:\rx\a\x1b[2J"
    console.info(message)
    from rich.console import Console

    expected = io.StringIO()
    Console(file=expected, highlight=False, soft_wrap=True, emoji=False).print(
        console.shown(message, lines=True), markup=False)
    assert capsys.readouterr().err == expected.getvalue() == \
        "run directory /tmp/a[b]:smile:\\rx\\x07\\x1b[2J\n"


@pytest.mark.parametrize(("env", "live"), [
    ({}, False), ({"FORCE_COLOR": "1"}, True), ({"TTY_COMPATIBLE": "1"}, True),
    ({"FORCE_COLOR": "1", "TERM": "dumb"}, False), ({"FORCE_COLOR": ""}, False),
])
def test_a_live_terminal_as_rich_sees_it(monkeypatch, env, live):
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert console.is_live_terminal() is live


def test_no_rich_import_to_say_no_terminal():
    code = ("import sys\nfrom fdl import console\n"
            "console.info('x')\n"
            "print(console.is_live_terminal(), 'rich' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, env={"PATH": "/usr/bin:/bin"})
    assert proc.stdout.split() == ["False", "False"]
    assert proc.stderr == "x\n"
