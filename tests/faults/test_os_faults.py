"""Ordinary OS failures, made for real, each one ``error:`` line and one ``hint:`` line with no
traceback: a read-only libtorch store under ``fdl libtorch activate|remove``, a read-only ``fdl
bench report`` directory, a script ``fdl compare`` may not read, a name longer than the
filesystem allows in ``fdl init``, and the safety net of ``fdl/cli/main.py`` for an OSError no
command names itself (its hint by errno; ``FDL_DEBUG=1`` shows the traceback). A failed ``fdl
libtorch download`` leaves no lock file behind.

Tests run as root here, and permission bits do not stop root: a read-only directory is a real
read-only bind mount (skipped, saying why, where mounting is not allowed), and an unreadable
script is read by fdl started without the capabilities that let root read anything
(``setpriv``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_error, clean_env, install_variant, libtorch_list, run_fdl
from typer.testing import CliRunner

from fdl.cli.main import app

LONG = "a" * 300  # longer than any common filesystem's 255 bytes per name


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


# ---- a read-only libtorch store ---------------------------------------------------------------

@pytest.mark.parametrize("command", [["activate", "2.12.0-cpu"], ["remove", "2.12.0-cpu"],
                                     ["remove", "2.13.0-cpu", "--force"]])
def test_a_read_only_store_is_one_line_and_stays_as_it_was(flodl_home, store, read_only,
                                                            command):
    for name in ("2.13.0-cpu", "2.12.0-cpu"):
        install_variant(store, name)
    store.activate("2.13.0-cpu")
    before = snapshot(store.root)
    read_only(store.root)
    proc = run_fdl("libtorch", *command, env={"FLODL_HOME": str(flodl_home)})
    assert_one_error(proc, 1, "cannot lock the libtorch store", f"{store.root / '.lock'}",
                     "Read-only file system", "mounted read-only")
    assert snapshot(store.root) == before
    assert libtorch_list({"FLODL_HOME": str(flodl_home)})["active"] == "precompiled/2.13.0-cpu"


# ---- a read-only fdl bench report directory ---------------------------------------------------

RECORD = {"model": "mlp", "mode": "solo@1x", "policy": "solo", "backend": "cpu", "seed": 0,
          "world_size": 1, "slowdown": [1.0], "eval": 0.9, "wall_s": 1.0, "samples_per_s": 10.0,
          "history": [{"epoch": 1, "train_loss": 0.5, "eval": 0.9}]}


def test_a_read_only_bench_report_directory_is_one_line(tmp_path, read_only):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(json.dumps(RECORD) + "\n")
    read_only(sweep)
    proc = run_fdl("bench", "report", str(sweep))
    assert_one_error(proc, 1, f"cannot write the report into {sweep}", "Read-only file system",
                     "mounted read-only")
    assert sorted(p.name for p in sweep.iterdir()) == ["results.jsonl"]


# ---- a script fdl compare may not read --------------------------------------------------------

@pytest.mark.parametrize("command", [["compare", "--out", "cmp"], ["run"]])
def test_a_script_fdl_cannot_read_is_refused_before_anything_starts(tmp_path, command):
    """fdl run's workers failed on it one by one, after the run directory was made."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to run fdl without root's read-anything "
                    "capabilities")
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    script.chmod(0)
    argv = [setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
            "fdl", command[0], str(script), *command[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=clean_env({"FLODL_HOME": str(tmp_path / "home")}))
    assert_one_error(proc, 2, "cannot read the script", f"{script}: Permission denied",
                     "check the ownership and permissions")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no cmp/, no runs/


# ---- a name longer than the filesystem allows -------------------------------------------------

@pytest.mark.parametrize(("path", "needles"), [
    (LONG, ["the project's name is 300 bytes long", "at most 236", "255 per name"]),
    (f"sub/{LONG}/demo", [f"the folder name {LONG[:24]}...", "at most 255"]),
], ids=["project-name", "folder-name"])
def test_fdl_init_refuses_a_name_longer_than_the_filesystem_allows(tmp_path, path, needles):
    proc = run_fdl("init", path, "--no-docker", cwd=tmp_path)
    assert_one_error(proc, 2, *needles, "pick a shorter name")
    assert list(tmp_path.iterdir()) == []


# ---- the safety net: an OSError no command names itself ---------------------------------------

def test_an_os_error_that_escapes_a_command_is_one_line_naming_the_path(tmp_path):
    script = tmp_path / f"{LONG}.py"
    proc = run_fdl("run", "--dry-run", str(script), env={"FLODL_HOME": str(tmp_path / "h")})
    assert_one_error(proc, 1, f"{script}: File name too long", "longer than the filesystem "
                     "allows")
    debug = run_fdl("run", "--dry-run", str(script),
                    env={"FLODL_HOME": str(tmp_path / "h"), "FDL_DEBUG": "1"})
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "OSError: [Errno 36] File name too long" in \
        debug.stderr
    assert debug.stderr.strip().splitlines()[-2].startswith("error: ")


@pytest.mark.parametrize(("code", "hint"), [
    (errno.EACCES, "permission denied: check the ownership and permissions"),
    (errno.EPERM, "not permitted there: check the ownership and permissions"),
    (errno.EROFS, "mounted read-only"),
    (errno.ENAMETOOLONG, "longer than the filesystem allows"),
    (errno.ENOSPC, "no space left"),
    (errno.EDQUOT, "disk quota"),
    (errno.EIO, "the operating system refused it"),
])
def test_the_safety_net_hints_by_errno(monkeypatch, tmp_path, code, hint):
    """Each errno's hint, through FdlGroup.main in process: the library call under ``fdl
    report`` raises what the OS would."""
    import fdl.rundir.report

    def refuse(run_dir: Path) -> None:
        raise OSError(code, os.strerror(code), str(run_dir / "summary.json"))

    monkeypatch.setattr(fdl.rundir.report, "run_report", refuse)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    error, shown_hint = result.stderr.splitlines()
    assert error == f"error: {tmp_path / 'summary.json'}: {os.strerror(code)}"
    assert shown_hint.startswith("hint: ") and hint in shown_hint


# ---- a failed download leaves no lock ---------------------------------------------------------

CPU_PATH = "cpu/libtorch-shared-with-deps-2.13.0%2Bcpu.zip"


@pytest.mark.parametrize("failure", ["not found", "checksum"])
def test_a_failed_download_leaves_no_lock_file(http_server, mirror_env, failure):
    args = ["libtorch", "download", "--cpu", "--version", "2.13.0"]
    if failure == "checksum":
        http_server.files[CPU_PATH] = b"not the archive"
        args += ["--sha256", "0" * 64]
    proc = run_fdl(*args, env=mirror_env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    root = Path(mirror_env["FLODL_HOME"]) / "libtorch"
    assert [p.name for p in (root / ".staging").iterdir()] == []
    assert [p for p in root.rglob("*") if p.name.endswith(".lock")] == []
    assert libtorch_list(mirror_env)["variants"] == []
