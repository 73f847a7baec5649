"""Where fdl writes: never through a symbolic link planted there, and a directory it cannot write
refused before anything starts.

Each case plants a real link in a real run, compare or bench directory, pointing at a "victim"
file or directory of the user's; after the command the victim's bytes are unchanged and the
command said one `error:` line (exit 2), or, where fdl owns the name (``--overwrite-run-dir``),
removed the link itself. The resume cases share one real solo run (``fdl run``, one gloo CPU
worker, a checkpoint after epoch 1) and resume a copy of it; the rest fail before any worker
starts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_error, clean_env, earlier_run, run_fdl

from fdl.errors import UsageError
from fdl.files import JsonlAppender, append_jsonl, open_for_writing, write_atomic

RECOVERY = Path(__file__).parents[1] / "engine" / "scripts" / "recovery_train.py"
WORKER = "open('MARKER', 'w').write('a worker ran')\n"
VICTIM = b"the user's file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


def plant(link: Path, target: Path) -> None:
    """``link`` (replacing what is there) made a symbolic link to ``target``."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


# --- the one way to write: fdl.files ------------------------------------------------------------


@pytest.mark.parametrize("write", [
    lambda path: open_for_writing(path).write(b"x"),
    lambda path: open_for_writing(path, append=True, encoding="utf-8").write("x"),
    lambda path: JsonlAppender(path),
    lambda path: append_jsonl(path, {"kind": "start"}),
], ids=["truncate", "append-text", "appender", "append_jsonl"])
def test_a_planted_link_is_refused_and_its_target_untouched(tmp_path, victim, write):
    link = tmp_path / "rank0.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UsageError) as caught:
        write(link)
    assert caught.value.message == (f"{link} is a symbolic link; fdl does not write its files "
                                    "through a link")
    assert victim.read_bytes() == VICTIM


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rank0.log"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="is not a regular file"):
        open_for_writing(fifo)  # a blocking open would wait here for a reader forever


def test_an_appender_adds_a_newline_after_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"epoch": 1}\n{"epo')
    append_jsonl(path, {"epoch": 2})
    assert path.read_bytes() == b'{"epoch": 1}\n{"epo\n{"epoch": 2}\n'


def test_an_atomic_write_replaces_a_link_not_its_target(tmp_path, victim):
    link = tmp_path / "summary.json"
    link.symlink_to(victim)
    write_atomic(link, "{}\n")
    assert not link.is_symlink() and link.read_text() == "{}\n"
    assert victim.read_bytes() == VICTIM


# --- fdl run: the run directory ------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(WORKER)
    return tmp_path


@pytest.mark.parametrize("flags", [[], ["--overwrite-run-dir"], ["--dry-run"],
                                   ["--dry-run", "--overwrite-run-dir"]])
def test_a_run_dir_that_is_a_link_is_refused(project, flags):
    target = project / "elsewhere"
    files = earlier_run(target) if "--overwrite-run-dir" in flags else {}
    target.mkdir(exist_ok=True)
    link = project / "runs" / "one"
    plant(link, target)
    proc = run_fdl("run", "--run-dir", str(link), *flags, "train.py", cwd=project)
    assert_one_error(proc, 2, f"run directory {link} is a symbolic link", str(target))
    assert not (project / "MARKER").exists()
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) \
        == sorted(files)
    for name, text in files.items():
        assert (target / name).read_text() == text


def test_dry_run_refuses_a_run_dir_that_holds_a_run_as_the_run_would(project):
    run_dir = project / "runs" / "one"
    files = earlier_run(run_dir)
    proc = run_fdl("run", "--dry-run", "--run-dir", str(run_dir), "train.py", cwd=project)
    assert_one_error(proc, 2, f"run directory {run_dir} holds an earlier run")
    assert {name: (run_dir / name).read_text() for name in files} == files


def test_overwrite_removes_a_planted_link_never_its_target(tmp_path, victim):
    from fdl.rundir.layout import check_run_dir, prepare_run_dir

    run_dir = tmp_path / "one"
    earlier_run(run_dir)
    victim_dir = tmp_path / "thesis"
    (victim_dir / "chapter").mkdir(parents=True)
    (victim_dir / "chapter" / "one.tex").write_bytes(VICTIM)
    plant(run_dir / "logs" / "rank0.log", victim)
    plant(run_dir / "metrics.jsonl", victim)
    plant(run_dir / "checkpoints", victim_dir)
    plant(run_dir / ".fdl-overwriting", victim)  # not a claim fdl writes: removed, not read
    check_run_dir(run_dir, use="overwrite")
    prepare_run_dir(run_dir, spec={}, fdl_version="1", use="overwrite")
    assert sorted(p.name for p in run_dir.iterdir()) == [".fdl-overwriting", "config.json",
                                                         "logs"]
    assert victim.read_bytes() == VICTIM
    assert (victim_dir / "chapter" / "one.tex").read_bytes() == VICTIM


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished solo run with a checkpoint after epoch 1: what --resume continues."""
    base = tmp_path_factory.mktemp("trained")
    (base / "out").mkdir()
    proc = run_fdl("run", "--run-dir", str(base / "run"), "--nproc-per-node", "1", "--epochs",
                   "2", "--checkpoint-every", "1", "--quiet-ranks", str(RECOVERY),
                   str(base / "out"), "64", cwd=base, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return base / "run"


@pytest.mark.parametrize("name", ["logs/rank0.log", "timeline/rank0.jsonl"])
def test_resume_refuses_a_link_planted_where_it_writes(trained_run, tmp_path, victim, name):
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run"))
    plant(run_dir / name, victim)
    proc = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=tmp_path, timeout=240)
    assert_one_error(proc, 2, f"holds {name}, a symbolic link")
    assert victim.read_bytes() == VICTIM
    assert "epoch 3/3" not in proc.stdout, "the run went on"


@pytest.mark.parametrize(("name", "make", "what"), [
    ("metrics.jsonl", Path.mkdir, "not a regular file"),
    ("logs/rank0.log", os.mkfifo, "not a regular file"),
    ("timeline", Path.touch, "not a folder"),
], ids=["metrics-a-folder", "log-a-fifo", "timeline-a-file"])
def test_resume_refuses_what_fdl_did_not_write_where_it_writes(trained_run, tmp_path, name,
                                                               make, what):
    """A folder where fdl replaces a file failed inside the workers (IsADirectoryError), after
    training had started; a FIFO where it appends would block the writer."""
    run_dir = Path(shutil.copytree(trained_run, tmp_path / "run"))
    path = run_dir / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    make(path)
    proc = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=tmp_path, timeout=240)
    assert_one_error(proc, 2, f"holds {name}, {what}")
    assert "epoch 3/3" not in proc.stdout, "the run went on"


# --- --tensorboard DIR, checked before any worker starts -------------------------------------


@pytest.mark.parametrize(("directory", "problem"), [
    ("/dev/null", "is not a directory"),
    ("{file}/tb", "is under the file {file}"),
    ("/proc/tb", "is in /proc"),
    ("t" * 300, "cannot be used: File name too long"),
], ids=["dev-null", "under-a-file", "proc", "name-too-long"])
@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "run"])
def test_a_tensorboard_dir_fdl_cannot_write_is_refused_before_any_worker(project, directory,
                                                                        problem, dry_run):
    a_file = project / "notes.txt"
    a_file.write_text("mine")
    directory, problem = (text.format(file=a_file) for text in (directory, problem))
    proc = run_fdl("run", *dry_run, "--tensorboard", directory, "train.py", cwd=project)
    assert_one_error(proc, 2, "tensorboard takes a directory", problem)
    assert not (project / "MARKER").exists(), "a worker ran"
    assert not (project / "runs").exists(), "a run directory was created"


def test_a_read_only_tensorboard_dir_is_refused(project, read_only):
    (project / "ro").mkdir()
    folder = read_only(project / "ro")
    proc = run_fdl("run", "--tensorboard", str(folder / "tb"), "train.py", cwd=project)
    assert_one_error(proc, 2, "tensorboard takes a directory", "is not writable")
    assert not (project / "runs").exists()


# --- fdl compare and fdl bench: the cells ------------------------------------------------------


def compare_out(project: Path) -> list:
    """The cells of ``fdl compare train.py --policies sync --seed 3 --out cmp``, whose plan.json
    (what its first invocation writes) is made in ``project/cmp``."""
    from fdl.compare.plan import CompareRequest, prepare_compare
    from fdl.compare.run import PLAN_FILE, SCHEMA

    plan = prepare_compare(CompareRequest("train.py", flags={"seed": "3"}, policies=("sync",),
                                          out=Path("cmp")), cwd=project, env=clean_env())
    plan.out.mkdir()
    (plan.out / PLAN_FILE).write_text(json.dumps({"schema": SCHEMA, **plan.to_dict()}))
    return list(plan.cells)


COMPARE = ["compare", "train.py", "--policies", "sync", "--seed", "3", "--out", "cmp"]


@pytest.mark.parametrize("what", ["log", "run_dir"])
def test_compare_refuses_a_cell_that_is_a_link(project, victim, what, monkeypatch):
    monkeypatch.chdir(project)
    cells = compare_out(project)
    victim_dir = project / "thesis"
    victim_dir.mkdir()
    (victim_dir / "config.json").write_bytes(VICTIM)
    link = getattr(cells[0], what)
    plant(link, victim if what == "log" else victim_dir)
    proc = run_fdl(*COMPARE, cwd=project, timeout=240)
    assert_one_error(proc, 2, f"{link} is a symbolic link")
    assert victim.read_bytes() == VICTIM
    assert (victim_dir / "config.json").read_bytes() == VICTIM
    assert not (project / "MARKER").exists(), "a cell ran"


@pytest.mark.parametrize("command", [["compare", "train.py"], ["bench", "--model", "mlp"]])
@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "run"])
def test_an_out_dir_under_a_file_is_refused_before_anything(project, command, dry_run):
    (project / "notes.txt").write_text("mine")
    proc = run_fdl(*command, *dry_run, "--out", "notes.txt/cmp", cwd=project)
    assert_one_error(proc, 2, "--out", f"is under the file {project / 'notes.txt'}")
    assert not (project / "MARKER").exists(), "a cell ran"


def test_bench_refuses_a_cell_that_is_a_link_before_writing(tmp_path, victim):
    from fdl.bench.cells import Cell
    from fdl.bench.sweep import cell_paths, run_sweep

    cell = Cell("mlp", "digits", "solo@1x", "solo", None, 0, 1, (1.0,), 1)
    out = tmp_path / "sweep"
    run_dir, log = cell_paths(cell, out_dir=out)
    plant(log, victim)
    with pytest.raises(UsageError, match="symbolic link"):
        run_sweep([cell], out_dir=out, data_dir=tmp_path / "data", args={}, machine={})
    assert victim.read_bytes() == VICTIM
    assert sorted(p.name for p in out.iterdir()) == ["runs"], "sweep.json was written"
    assert not run_dir.exists(), "a cell ran"
