"""`fdl init` as a user runs it: output, exit codes, and nothing left behind on an error."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, run_fdl

import fdl
from fdl.version import __version__

RTX4090 = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "rtx4090.json")}
NO_GPU = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")}
WHEEL = f"fdl-{__version__}-py3-none-any.whl"


def listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_init_writes_the_project_and_says_what_next(tmp_path):
    proc = run_fdl("init", "demo", "--template", "cnn", cwd=tmp_path, env=RTX4090)
    assert proc.returncode == 0, proc.stderr
    assert listing(tmp_path / "demo") == [
        ".dockerignore", ".gitignore", "Dockerfile", "Makefile", "README.md", "fdl.toml", "pyproject.toml", "tests", "tests/test_train.py", "train.py", "wheels", f"wheels/{WHEEL}"]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"created demo (cnn template) in {tmp_path / 'demo'}"
    assert lines[2] == (f"  fdl: wheels/{WHEEL}, this fdl {__version__} packed from "
                        f"{Path(fdl.__file__).resolve().parent} (`make install` installs it)")
    assert lines[3] == ("  Dockerfile: torch 2.14.0+cu126 on nvidia/cuda:12.6.3-runtime-ubuntu22.04"
                        " (covers every GPU here: NVIDIA GeForce RTX 4090 (sm_89))")
    assert lines[-3:] == ["next:", "  cd demo",
                          "  fdl run train.py --policy async   # or: python train.py (solo)"]
    assert "index-url" not in proc.stdout and proc.stderr == ""


def test_no_docker_skips_the_docker_files(tmp_path):
    proc = run_fdl("init", "demo", "--no-docker", cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr
    assert "Dockerfile" not in proc.stdout
    files = listing(tmp_path / "demo")
    assert "Dockerfile" not in files and ".dockerignore" not in files
    assert "docker" not in (tmp_path / "demo" / "Makefile").read_text()


def test_a_path_names_the_project_by_its_last_part(tmp_path):
    proc = run_fdl("init", str(tmp_path / "code" / "my-model"), "--template", "gpt",
                   cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr
    pyproject = (tmp_path / "code" / "my-model" / "pyproject.toml").read_text()
    assert 'name = "my-model"' in pyproject


@pytest.mark.parametrize(("args", "message"), [
    (["1demo"], "error: invalid project name '1demo': use letters, digits, '-' and '_', "
                "starting with a letter"),
    (["my model"], "error: invalid project name 'my model'"),
    (["torch"], "error: invalid project name 'torch': the project depends on a package"),
    (["demo", "--template", "rnn"], "error: unknown template 'rnn'"),
])
def test_bad_input_is_exit_2_and_writes_nothing(tmp_path, args, message):
    proc = run_fdl("init", *args, cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith(message)
    assert proc.stderr.splitlines()[1].startswith("hint: ")
    assert "Traceback" not in proc.stderr and listing(tmp_path) == []


def test_a_non_empty_folder_needs_force_and_force_works(tmp_path):
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "notes.txt").write_text("mine")
    (demo / "train.py").write_text("old")
    proc = run_fdl("init", "demo", cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {demo} already exists and is not empty",
        "hint: pick another name, or pass --force to overwrite the files that fdl init writes "
        "(other files are kept)"]
    assert listing(tmp_path) == ["demo", "demo/notes.txt", "demo/train.py"]

    proc = run_fdl("init", "demo", "--force", "--no-docker", cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr
    assert "  replaced: train.py" in proc.stdout.splitlines()
    assert (demo / "notes.txt").read_text() == "mine"
    assert "fdl.Trainer(" in (demo / "train.py").read_text()
    assert listing(tmp_path)[:1] == ["demo"] and len(listing(tmp_path)) == 12


def test_a_path_under_a_regular_file_is_exit_2_and_writes_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    proc = run_fdl("init", "notes.txt/demo", cwd=tmp_path, env=NO_GPU)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        f"error: cannot create the project at {tmp_path / 'notes.txt' / 'demo'}: "
        f"{tmp_path / 'notes.txt'} is a file, not a folder")
    assert listing(tmp_path) == ["notes.txt"]


def test_an_unreadable_gpu_survey_is_reported_and_writes_nothing(tmp_path):
    bad = tmp_path / "survey.json"
    bad.write_text("{not json")
    proc = run_fdl("init", "demo", cwd=tmp_path, env={"FDL_GPU_SURVEY": str(bad)})
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert listing(tmp_path) == ["survey.json"]
