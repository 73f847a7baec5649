"""Outside text with terminal escapes in it, printed by the real commands: a GPU name in the
survey, a policy, a metric name, an anchor reason, a device, a variant's version and a key of
its variant.json, a script's file name and arguments, a run directory's name. Each holds every
payload below: an OSC title change, a clear-screen, a C1 control (U+009B, a one-byte CSI) and a
right-to-left override.

Each command runs once, in process (typer's runner through ``FdlGroup.main``, as ``fdl`` runs
it), on files made for it here; each payload is then its own case: nothing in stdout or stderr
is a character a terminal acts on (a C0 or C1 control other than the newline, DEL, a
bidirectional control), and the payload is there escaped (``\\x1b]0;pwned\\x07``), visible.
``--json`` keeps the exact value and is strict JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, install_variant
from typer.testing import CliRunner

from fdl import console
from fdl.cli.main import app
from fdl.compare.render import render_markdown, tables
from fdl.libtorch.store import Store

PAYLOADS = {"osc-title": "\x1b]0;pwned\x07", "clear-screen": "\x1b[2J", "c1-csi": "\x9b31m",
            "rtl-override": "\u202e"}
HOSTILE = "x" + "|".join(PAYLOADS.values()) + "|y"
# What no output may hold: every control a terminal acts on (the newline is fdl's own).
DANGEROUS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                       "\u2066-\u2069\u2028\u2029]")

SUMMARY = {"policy": f"cadence{HOSTILE}", "backend": "cpu", "world_size": 1,
           "devices": [f"cpu{HOSTILE}"], "emulated_slowdown": None, "epochs": 1, "samples": 40,
           "wall_s": 1.0, "throughput": {"samples_per_s": 40.0, "per_rank_samples_per_s": [40.0]},
           "sync": {"rounds": 1, "mean_ms": 1.0, "overhead": 0.01}, "idle_fraction": [0.0],
           "eval": {f"accuracy{HOSTILE}": 0.9}, "final_loss": 0.25,
           "anchor_history": [[0, 0, f"slowest{HOSTILE}"]]}
EVENTS = [{"t": 100.0, "kind": "start", "attempt": 0},
          {"t": 101.0, "kind": "round", "round": 0, "steps": 4, "samples": 40, "compute_s": 0.5,
           "data_s": 0.1},
          {"t": 101.5, "kind": "sync", "round": 0, "wait_s": 0.1}, {"t": 102.0, "kind": "final"}]


def hostile_survey(folder: Path) -> Path:
    path = folder / "survey.json"
    path.write_text(json.dumps({"driver_version": "570.86.15", "cuda_driver_version": "12.8",
                                "gpus": [{"name": f"RTX {HOSTILE}", "compute_capability": "8.9",
                                          "memory_mib": 24564}]}))
    return path


def hostile_run(folder: Path) -> Path:
    """A finished run of one rank, in a directory whose name holds the payloads."""
    run = folder / f"run{HOSTILE}"
    (run / "timeline").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "config.json").write_text(json.dumps({"engine": {"batch_size": {"value": 10}}}))
    (run / "timeline" / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    return run


def hostile_store(folder: Path) -> Path:
    """FLODL_HOME with one variant whose variant.json holds the payloads (version, a key)."""
    home = folder / "home"
    install_variant(Store(home / "libtorch"), "2.13.0-cpu",
                    **{"version": f"2.13.0{HOSTILE}", f"note{HOSTILE}": HOSTILE})
    return home


def hostile_script(folder: Path) -> Path:
    script = folder / f"train{HOSTILE}.py"
    script.write_text("print('hello')\n")
    return script


def _survey_scene(*args: str) -> Callable[[Path], tuple[list[str], dict[str, str]]]:
    return lambda folder: (list(args), {"FDL_GPU_SURVEY": str(hostile_survey(folder))})


def _script_scene(command: str, *, survey: bool) -> Callable[[Path], tuple[list[str],
                                                                      dict[str, str]]]:
    """``fdl COMMAND --dry-run`` of a script whose name and argument hold the payloads; on the
    hostile survey, or on a host without GPUs (fdl compare refuses a GPU this torch lacks)."""
    return lambda folder: ([command, "--dry-run", str(hostile_script(folder)), "--",
                            f"--name={HOSTILE}"],
                           {"FDL_GPU_SURVEY": str(hostile_survey(folder) if survey
                                                  else GPU_FIXTURES / "none.json")})


# command -> (what it is given, its exit code)
SCENES: dict[str, tuple[Callable[[Path], tuple[list[str], dict[str, str]]], int]] = {
    "diagnose": (_survey_scene("diagnose"), 0),
    "setup --dry-run": (_survey_scene("setup", "--dry-run"), 0),
    "run --dry-run": (_script_scene("run", survey=True), 0),
    "compare --dry-run": (_script_scene("compare", survey=False), 0),
    "report": (lambda folder: (["report", str(hostile_run(folder))], {}), 0),
    "report, no such run": (lambda folder: (["report", str(folder / f"gone{HOSTILE}")], {}), 2),
    "libtorch list": (lambda folder: (["libtorch", "list"],
                                      {"FLODL_HOME": str(hostile_store(folder))}), 0),
    "libtorch info": (lambda folder: (["libtorch", "info", "2.13.0-cpu"],
                                      {"FLODL_HOME": str(hostile_store(folder))}), 0),
}


def invoke(args: list[str], env: dict[str, str], *, cwd: Path) -> tuple[int, str]:
    """``fdl ARGS`` in this process: its exit code and what it wrote (stdout, then stderr)."""
    import os

    before = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, args, env={"NO_COLOR": "1", "COLUMNS": "200",
                                                    "FLODL_HOME": str(cwd / "home"), **env})
    finally:
        os.chdir(before)
    return result.exit_code, result.stdout + result.stderr


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> Callable[[str], tuple[int, str]]:
    """What each command printed, run once per module on its own hostile files."""
    seen: dict[str, tuple[int, str]] = {}

    def run(command: str) -> tuple[int, str]:
        if command not in seen:
            folder = tmp_path_factory.mktemp("hostile")
            args, env = SCENES[command][0](folder)
            seen[command] = invoke(args, env, cwd=folder)
        return seen[command]

    return run


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("command", SCENES)
def test_outside_text_reaches_the_terminal_escaped(printed, command, payload):
    code, text = printed(command)
    assert code == SCENES[command][1], text
    assert "Traceback" not in text, text
    found = sorted({hex(ord(c)) for c in DANGEROUS.findall(text)})
    assert not found, f"raw controls {found} in the output of fdl {command}:\n{text!r}"
    assert console.shown(payload) in text, (console.shown(payload), text)


def test_report_json_keeps_the_exact_values_as_strict_json(tmp_path):
    code, text = invoke(["report", "--json", str(hostile_run(tmp_path))], {}, cwd=tmp_path)
    assert code == 0, text
    document = json.loads(text, parse_constant=_refuse)
    assert document["policy"] == SUMMARY["policy"]
    assert list(document["eval"]) == list(SUMMARY["eval"])
    assert not DANGEROUS.search(text)  # json writes each control as \uXXXX


def _refuse(constant: str) -> None:
    raise AssertionError(f"not strict JSON: {constant}")


def test_print_json_writes_nan_and_infinity_as_null(capsys):
    console.print_json({"a": float("nan"), "b": [float("inf"), 1.5, (2, float("-inf"))],
                        "c": {"d": float("nan")}, "e": HOSTILE})
    document = json.loads(capsys.readouterr().out, parse_constant=_refuse)
    assert document == {"a": None, "b": [None, 1.5, [2, None]], "c": {"d": None}, "e": HOSTILE}


COMPARE_ROW = {"policy": f"cadence{HOSTILE}", "runs": 1, "failed": 0, "speedup_vs_sync": 1.5,
               "measurement_error": f"negative wall time{HOSTILE}",
               "samples_per_s": {"median": 40.0, "runs": 1},
               "idle_fraction": None, "sync_overhead": None, "time_to_sync_loss_s": None,
               "reached_sync_loss": 0, "final_loss": {"median": 0.25, "runs": 1},
               "eval": {f"accuracy{HOSTILE}": {"median": 0.9, "runs": 1}}}
COMPARE = {"script": f"train{HOSTILE}.py", "args": [f"--name={HOSTILE}"], "options": {},
           "seeds": [0], "epochs": 1, "sync_loss_target": None, "rows": [COMPARE_ROW],
           "machine": {"cpu_model": "cpu", "logical_cores": 2, "torch": "2.13.0",
                       "gpus": [{"name": f"RTX {HOSTILE}"}]},
           "recommendation": {"basis": "speed", "text": f"use cadence{HOSTILE}",
                              "notes": [f"note{HOSTILE}"]},
           "cells": [{"status": "failed", "name": "cadence-seed0",
                      "failure": f"exited{HOSTILE}\nsecond line"}]}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_compare_tables_and_compare_md_show_a_metric_and_a_policy_escaped(capsys, payload):
    """What fdl compare prints of its document (the tables, as fdl/cli/compare.py prints them)
    and compare.md: a hostile metric name, policy, GPU name or failure is escaped in both."""
    for title, columns, rows in tables(COMPARE):
        console.print_table(columns, rows, title=f"{title}: {COMPARE['script']}")
    printed = capsys.readouterr().out
    markdown = render_markdown(COMPARE, plot=False)
    for text in (printed, markdown):
        assert not DANGEROUS.search(text), repr(text)
        assert console.shown(payload) in text
    assert "exited" in markdown and "\\nsecond line" in markdown  # one list item, one line


def test_every_console_function_escapes_what_it_is_given(capsys, monkeypatch):
    """The boundary itself: whatever a command passes to fdl.console, in a message, a heading,
    a table, a key/value line or a progress description, reaches no terminal raw (markup and
    emoji codes are shown as typed too). (The status spinner draws only on a terminal.)"""
    monkeypatch.setenv("COLUMNS", "200")
    text = f"{HOSTILE} [red]markup[/red] :smile:"
    console.out(f"two\nlines {text}")
    console.info(text)
    console.warn(text)
    console.error(text, hint=text)
    console.rule(text)
    console.print_table([text], [[text]], title=text)
    console.print_pairs([(text, text)], wrap=True)
    with console.progress(unit="items") as bar:
        bar.update(bar.add_task(text, total=1), completed=1)
    with console.status(text):
        pass
    out, err = capsys.readouterr()
    for stream in (out, err):
        assert not DANGEROUS.search(stream), repr(stream)
        assert "[red]markup[/red] :smile:" in stream
    # out, rule, table title, header and cell, key and value; info, warn, error, hint, progress
    assert out.count(console.shown(HOSTILE)) == 7 and err.count(console.shown(HOSTILE)) == 5
    assert "two\nlines " in out  # a message keeps fdl's own line breaks


def test_bench_report_shows_a_hostile_model_and_mode_escaped(tmp_path):
    """fdl bench report on a results.jsonl whose model and mode hold the payloads: neither the
    terminal (matplotlib's missing-glyph warnings quoted the labels raw) nor report.md may
    hold a control character."""
    from helpers import run_fdl

    record = {"model": f"mlp{HOSTILE}", "mode": f"solo@1x{HOSTILE}", "policy": "solo",
              "backend": "cpu", "seed": 0, "world_size": 1, "slowdown": [1.0], "eval": 0.9,
              "wall_s": 1.0, "samples_per_s": 10.0,
              "history": [{"epoch": 1, "train_loss": 0.5, "eval": 0.9}]}
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")
    proc = run_fdl("bench", "report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report.md").read_text()
    for text in (proc.stdout + proc.stderr, report):
        assert not DANGEROUS.search(text), repr(text)
    assert console.shown(HOSTILE) in report
