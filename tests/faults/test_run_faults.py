"""`fdl run` given bad input: one `error:` line and a `hint:`, exit 2, no worker started and
nothing written (no run directory).

Every case is a real `fdl run` subprocess that fails before any worker starts. The script and
the module a case names would write MARKER if they ever ran, so a missing MARKER proves that
nothing was started."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers import assert_one_error, earlier_run, free_port, run_fdl

WORKER = "open('MARKER', 'w').write('a worker ran')\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(WORKER)
    return tmp_path


def assert_refused(project: Path, proc, *needles: str) -> None:
    """Exit 2, `error:` then `hint:`, no traceback, nothing started, nothing written."""
    error = assert_one_error(proc, 2).splitlines()[0]
    for needle in needles:
        assert needle in error, (needle, error)
    assert not (project / "MARKER").exists(), "a worker ran"
    assert not (project / "runs").exists(), "a run directory was created"


def fdl_run(project: Path, *args: str, timeout: float = 60):
    return run_fdl("run", *args, cwd=project, timeout=timeout)


# --- rendezvous flags --------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_master_port_out_of_range(project, port):
    assert_refused(project, fdl_run(project, "--master-port", port, "train.py"),
                   "--master-port", port)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:notaport", "127.0.0.1:70000", ":29400",
                                      "127.0.0.1:"])
def test_malformed_rdzv_endpoint(project, endpoint):
    proc = fdl_run(project, "--nnodes", "2", "--rdzv-endpoint", endpoint, "train.py")
    assert_refused(project, proc, "--rdzv-endpoint", repr(endpoint))


def test_unresolvable_rdzv_host_fails_instead_of_waiting(project):
    # The subprocess timeout is the guard: before the fix it waited for the rendezvous's 900 s.
    proc = fdl_run(project, "--nnodes", "2", "--rdzv-endpoint", "nosuchhost.invalid:29400",
                   "train.py", timeout=90)
    assert_refused(project, proc, "nosuchhost.invalid")


@pytest.mark.parametrize("rank", ["5", "2", "-1"])
@pytest.mark.parametrize("where", ["--rdzv-endpoint", "--master-addr"])
def test_static_node_rank_outside_the_nodes(project, rank, where):
    endpoint = (["--rdzv-endpoint", f"127.0.0.1:{free_port()}"] if where == "--rdzv-endpoint"
                else ["--master-addr", "127.0.0.1", "--master-port", str(free_port())])
    proc = fdl_run(project, "--rdzv-backend", "static", "--node-rank", rank, "--nnodes", "2",
                   *endpoint, "train.py", timeout=90)  # a guard: today it waits for node 5
    assert_refused(project, proc, "--node-rank", rank)


def test_static_rendezvous_needs_a_fixed_node_count(project):
    proc = fdl_run(project, "--rdzv-backend", "static", "--node-rank", "0", "--nnodes", "1:2",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "train.py")
    assert_refused(project, proc, "--nnodes", "1:2")


def test_master_addr_without_master_port_is_not_ignored(project):
    assert_refused(project, fdl_run(project, "--master-addr", "10.0.0.1", "train.py"),
                   "--master-addr")


@pytest.mark.parametrize("extra", [["--nnodes", "2"], ["--rdzv-endpoint", "127.0.0.1:29400"]])
def test_standalone_conflicts_are_not_ignored(project, extra):
    assert_refused(project, fdl_run(project, "--standalone", *extra, "train.py"), "--standalone")


def test_ipv6_master_port_in_use_is_named(project):
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = fdl_run(project, "--master-addr", "::1", "--master-port", str(port), "train.py")
    assert_refused(project, proc, f"--master-port {port} is already in use on ::1")


# --- the script ----------------------------------------------------------------------------------


def test_missing_module(project):
    assert_refused(project, fdl_run(project, "-m", "no_such_module"), "no_such_module")


def test_missing_submodule_of_a_local_package(project):
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text(WORKER)  # must not run either
    assert_refused(project, fdl_run(project, "-m", "pkg.missing"), "pkg.missing")


def test_package_without_main(project):
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    assert_refused(project, fdl_run(project, "-m", "pkg"), "pkg.__main__")


def test_json_without_dry_run(project):
    assert_refused(project, fdl_run(project, "--json", "train.py"), "--json")


# --- config files --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "needles"), [
    ("tool = 'x'\n", ["pyproject.toml", "tool", "'x'"]),
    ("[tool]\nfdl = 3\n", ["pyproject.toml", "tool.fdl", "3"]),
])
def test_pyproject_tool_tables_of_the_wrong_type(project, text, needles):
    (project / "pyproject.toml").write_text(text)
    assert_refused(project, fdl_run(project, "train.py"), *needles)


@pytest.mark.parametrize("name", ["fdl.toml", "pyproject.toml"])
def test_config_file_that_is_a_directory(project, name):
    (project / name).mkdir()
    assert_refused(project, fdl_run(project, "train.py"), name, "not a file")


# --- the run directory ---------------------------------------------------------------------------


def assert_unchanged(run_dir: Path, files: dict[str, str]) -> None:
    found = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    assert found == set(files)
    for name, text in files.items():
        assert (run_dir / name).read_text() == text


def test_run_dir_holding_a_run_is_refused(project):
    run_dir = project / "runs" / "one"
    files = earlier_run(run_dir)
    proc = fdl_run(project, "--run-dir", "runs/one", "train.py")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: run directory {run_dir} holds an earlier run")
    assert "--overwrite-run-dir" in proc.stderr and "--resume" in proc.stderr
    assert not (project / "MARKER").exists()
    assert_unchanged(run_dir, files)


@pytest.mark.parametrize("flags", [[], ["--overwrite-run-dir"]])
def test_run_dir_that_is_not_a_run_is_never_used_or_replaced(project, flags):
    home = project / "home"
    (home / ".ssh").mkdir(parents=True)
    files = {".ssh/id_ed25519": "secret", "notes.txt": "mine", "config.json": "{}"}
    for name, text in files.items():
        (home / name).write_text(text)
    proc = fdl_run(project, "--run-dir", str(home), *flags, "train.py")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: run directory {home} is not empty")
    assert not (project / "MARKER").exists()
    assert_unchanged(home, files)


def test_overwrite_refuses_a_run_dir_with_files_fdl_did_not_write(project):
    run_dir = project / "runs" / "one"
    files = earlier_run(run_dir)
    (run_dir / "thesis.tex").write_text("not fdl's")
    files["thesis.tex"] = "not fdl's"
    proc = fdl_run(project, "--run-dir", str(run_dir), "--overwrite-run-dir", "train.py")
    assert proc.returncode == 2, proc.stderr
    assert "thesis.tex" in proc.stderr.splitlines()[0]
    assert not (project / "MARKER").exists()
    assert_unchanged(run_dir, files)


def test_overwrite_and_resume_together(project):
    run_dir = project / "runs" / "one"
    files = earlier_run(run_dir)
    proc = fdl_run(project, "--resume", str(run_dir), "--overwrite-run-dir")
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert "--overwrite-run-dir" in first and "--resume" in first
    assert_unchanged(run_dir, files)


def test_overwrite_replaces_the_live_snapshot_and_tensorboard_events_too(tmp_path):
    from fdl.rundir.layout import check_run_dir, prepare_run_dir

    run_dir = tmp_path / "one"
    earlier_run(run_dir)
    (run_dir / "progress.json").write_text('{"schema": 1}')
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\0")
    check_run_dir(run_dir, use="overwrite")
    prepare_run_dir(run_dir, spec={}, fdl_version="1", use="overwrite")
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "logs"]


def test_overwrite_of_a_run_dir_that_does_not_exist_yet_creates_it(tmp_path):
    from fdl.rundir.layout import check_run_dir, prepare_run_dir

    run_dir = tmp_path / "runs" / "first"  # neither it nor its parent exists (a fresh clone)
    check_run_dir(run_dir, use="overwrite")
    prepare_run_dir(run_dir, spec={}, fdl_version="1", use="overwrite")
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "logs"]
