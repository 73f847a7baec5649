"""`fdl compare` takes fdl run's options before SCRIPT as well as after it (a torchrun user puts
launcher options first): the words moved (fdl.cli.compare.hoist_run_options, pure), and the
plan a real `fdl compare --dry-run --json` prints either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_error, run_fdl

from fdl.cli.compare import hoist_run_options

SCRIPT = Path(__file__).parent.parent / "engine" / "scripts" / "compare_train.py"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--simulate-slowdown", "1,2.5", "train.py", "--lr", "0.1"],
     ["train.py", "--simulate-slowdown", "1,2.5", "--lr", "0.1"]),
    (["--epochs", "2", "--quiet-ranks", "--batch-size=32", "train.py"],  # own options stay
     ["--epochs", "2", "train.py", "--quiet-ranks", "--batch-size=32"]),
    (["--tensorboard", "train.py"], ["train.py", "--tensorboard"]),  # bare: no value taken
    (["--tensorboard", "tb", "train.py"], ["train.py", "--tensorboard", "tb"]),
    (["train.py", "--simulate-slowdown", "1,2.5"], ["train.py", "--simulate-slowdown", "1,2.5"]),
    (["--frobnicate", "train.py"], ["--frobnicate", "train.py"]),  # unknown: the parser refuses
    (["-m", "pkg.train"], ["-m", "pkg.train"]),  # no -m in fdl compare: left to refuse
    (["--simulate-slowdown", "1,2.5"], ["--simulate-slowdown", "1,2.5"]),  # no SCRIPT
    (["--", "--simulate-slowdown", "1"], ["--", "--simulate-slowdown", "1"]),
], ids=["a setting", "own options stay", "bare tensorboard", "tensorboard dir", "already after",
        "unknown", "module", "no script", "after --"])
def test_run_options_before_script_move_after_it(argv, expected):
    assert hoist_run_options(argv) == expected


def _planned_argv(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["cells_planned"][0]["argv"]


def test_the_plan_is_the_same_with_the_options_before_or_after_script(tmp_path):
    before = run_fdl("compare", "--simulate-slowdown", "1,2.5", "--nproc-per-node", "2",
                     str(SCRIPT), "--out", "cmp", "--dry-run", "--json", cwd=tmp_path)
    after = run_fdl("compare", str(SCRIPT), "--simulate-slowdown", "1,2.5",
                    "--nproc-per-node", "2", "--out", "cmp", "--dry-run", "--json", cwd=tmp_path)
    argv = _planned_argv(before)
    assert argv == _planned_argv(after)
    assert argv[argv.index("--simulate-slowdown") + 1] == "1,2.5"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert not (tmp_path / "cmp").exists()  # a dry run writes nothing


def test_a_run_option_fdl_compare_sets_is_refused_before_script_too(tmp_path):
    proc = run_fdl("compare", "--policy", "async", str(SCRIPT), "--out", "cmp", cwd=tmp_path)
    assert_one_error(proc, 2, "--policy is fdl compare's to set")
    assert not (tmp_path / "cmp").exists()


def test_the_options_it_keeps_in_place_are_fdl_compares_own():
    import typer

    from fdl.cli import compare
    from fdl.cli.main import app

    command = typer.main.get_command(app).commands["compare"]
    options = [p for p in command.params if p.param_type_name == "option"]
    valued = {flag for p in options if not p.is_flag for flag in p.opts}
    flags = {flag for p in options if p.is_flag for flag in p.opts}
    assert set(compare._OWN_VALUED) == valued
    assert set(compare._OWN_FLAGS) == flags | {"-h", "--help"}
