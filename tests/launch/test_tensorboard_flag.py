"""``--tensorboard [DIR]``: a setting whose flag may come without a value, before or after
SCRIPT; its value reaches the workers as FDL_TENSORBOARD; a missing tensorboard package is a usage
error before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_error, run_fdl

from fdl.errors import UsageError
from fdl.launch.request import split_script_args
from fdl.settings import fill_bare_flags, parse_tensorboard


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hello from the worker')\n")
    return tmp_path


@pytest.mark.parametrize(("argv", "filled"), [
    (["--tensorboard", "train.py"], ["--tensorboard", "on", "train.py"]),
    (["--tensorboard", "--policy", "sync", "train.py"],
     ["--tensorboard", "on", "--policy", "sync", "train.py"]),
    (["train.py", "--tensorboard"], ["train.py", "--tensorboard", "on"]),
    (["--tensorboard", "tb", "train.py"], ["--tensorboard", "tb", "train.py"]),
    (["--tensorboard=tb", "train.py"], ["--tensorboard=tb", "train.py"]),
    (["train.py", "--", "--tensorboard"], ["train.py", "--", "--tensorboard"]),  # the script's
    (["--policy", "sync", "train.py"], ["--policy", "sync", "train.py"]),
])
def test_fill_bare_flags(argv: list[str], filled: list[str]) -> None:
    assert fill_bare_flags(argv) == filled


def test_after_the_script_a_bare_flag_is_claimed_as_on() -> None:
    assert split_script_args(("--tensorboard",)) == ({"tensorboard": "on"}, ())
    assert split_script_args(("--tensorboard", "--lr", "0.1")) == \
        ({"tensorboard": "on"}, ("--lr", "0.1"))
    assert split_script_args(("--tensorboard", "logs/tb")) == ({"tensorboard": "logs/tb"}, ())


def test_parse_tensorboard(tmp_path: Path) -> None:
    assert parse_tensorboard(None) is None and parse_tensorboard("off") is None
    assert parse_tensorboard("ON") == "on" and parse_tensorboard(True) == "on"
    assert parse_tensorboard("runs/tb") == "runs/tb"
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(UsageError, match="takes a directory"):
        parse_tensorboard(str(script))


@pytest.mark.parametrize(("args", "value"), [
    (["--tensorboard", "train.py"], "on"),
    (["train.py", "--tensorboard"], "on"),
    (["--tensorboard", "tb", "train.py"], "tb"),
    (["train.py", "--tensorboard=off"], None),
])
def test_dry_run_resolves_it_and_passes_it_to_the_workers(project: Path, args: list[str],
                                                          value: str | None) -> None:
    proc = run_fdl("run", "--dry-run", "--json", *args, cwd=project)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["settings"]["tensorboard"]["value"] == value
    assert spec["env"].get("FDL_TENSORBOARD") == (value or "off")  # off beats a script's on
    assert spec["script"].endswith("train.py") and spec["args"] == []


def test_fdl_toml_sets_it(project: Path) -> None:
    (project / "fdl.toml").write_text('tensorboard = "logs/tb"\n')
    spec = json.loads(run_fdl("run", "--dry-run", "--json", "train.py", cwd=project).stdout)
    assert spec["settings"]["tensorboard"]["value"] == "logs/tb"
    assert spec["settings"]["tensorboard"]["source"].startswith("file:")


@pytest.mark.parametrize("value", ["5", "2.5", "[1]", "{ dir = 1 }"])
def test_fdl_toml_s_value_that_is_not_text_is_refused(project: Path, value: str) -> None:
    """`tensorboard = 5` wrote TensorBoard files into ./5: a number is not a directory."""
    (project / "fdl.toml").write_text(f"tensorboard = {value}\n")
    proc = run_fdl("run", "--dry-run", "train.py", cwd=project)
    assert_one_error(proc, 2, "tensorboard takes on, off or a directory as text", "quoted")


def test_without_the_tensorboard_package_nothing_starts(project: Path) -> None:
    # The one boundary faked: a tensorboard that cannot be imported, via a module finder that
    # refuses it in the fdl process (sitecustomize on PYTHONPATH).
    shim = project / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class NoTensorboard(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorboard' or name.startswith('tensorboard.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoTensorboard())\n")
    proc = run_fdl("run", "--tensorboard", "train.py", cwd=project,
                   env={"PYTHONPATH": str(shim)})
    assert_one_error(proc, 2, "tensorboard package", "fdl[tensorboard]")
    assert "hello from the worker" not in proc.stdout
    assert not (project / "runs").exists()
