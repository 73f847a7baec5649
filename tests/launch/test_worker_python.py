"""``fdl run --worker-python``: a local worker under another environment's interpreter.

The second environment is a real venv made here (no pip) whose site reaches this checkout's
environment (a ``.pth`` that adds its site directory), as a venv per CUDA line would hold its
own wheel of the same torch release. A stand-in for an environment of another release carries
a torch distribution record of its own (``torch-2.99.0.dist-info``) ahead of the real one.
Nothing is mocked: real processes, gloo, the launcher's checks.
"""

from __future__ import annotations

import json
import site
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import assert_one_error, bare_venv, run_fdl, standin_torch, wait_until_gone

SCRIPT = Path(__file__).parent / "scripts" / "where_am_i.py"


def make_env(root: Path, *, torch_release: str | None = None) -> Path:
    """A venv at ``root`` that imports this environment's fdl and torch; its python."""
    python, purelib = bare_venv(root)
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()] or \
        [sysconfig.get_paths()["purelib"]]
    (purelib / "zz_parent.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    if torch_release is not None:  # its own torch record, found first
        info = purelib / f"torch-{torch_release}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\n"
                                       f"Version: {torch_release}\n")
    return python


@pytest.fixture(scope="module")
def second_env(tmp_path_factory) -> Path:
    return make_env(tmp_path_factory.mktemp("env") / "cu126")


def test_a_worker_runs_under_its_own_interpreter_and_the_run_trains_to_the_end(tmp_path,
                                                                               second_env):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                   "--quiet-ranks", "--worker-python", f"1={second_env}", str(SCRIPT),
                   str(out), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[1]["prefix"] == str(second_env.parent.parent)
    assert ranks[0]["prefix"] == sys.prefix != ranks[1]["prefix"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # one model at the end
    assert ranks[0]["backend"] == "cpu"  # two environments: averaged through host memory
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["settings"]["backend"] == {"value": "cpu",
                                             "source": "--worker-python: several environments"}


def test_dry_run_shows_each_workers_interpreter_and_what_it_reported(tmp_path, second_env):
    (tmp_path / "train.py").write_text("")
    proc = run_fdl("run", "--dry-run", "--json", "--nproc-per-node", "2", "--worker-python",
                   f"1={second_env}", "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert [w["python"] for w in document["workers"]] == [sys.executable, str(second_env)]
    import torch

    from fdl.version import __version__

    assert document["interpreters"] == [{
        "local_rank": 1, "path": str(second_env), "fdl": __version__,
        "python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "torch": torch.__version__}]
    assert document["env"]["FDL_WORKER_PYTHON"] == json.dumps({"1": str(second_env)})
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_another_torch_release_is_refused_before_any_worker_starts(tmp_path):
    other = make_env(tmp_path / "env", torch_release="2.99.0+cu126")
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    proc = run_fdl("run", "--nproc-per-node", "2", "--worker-python", f"1={other}",
                   "train.py", cwd=tmp_path)
    import torch

    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        f"error: --worker-python: local rank 1 ({other}) has torch release 2.99.0, the "
        f"launcher's workers {torch.__version__.split('+')[0]}")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("value", "says"), [
    ("1", "'1' is not LOCAL_RANK=PATH"), ("x=/bin/sh", "'x=/bin/sh' is not LOCAL_RANK=PATH"),
    ("2=/bin/sh", "names local rank 2, and this node runs 2 worker(s)"),
    ("1=/bin/sh,1=/bin/sh", "names local rank 1 twice"),
    ("1=no/such/python", "is not an executable file"),
    ("1=/bin/true", "does not run as a Python interpreter")])
def test_a_bad_worker_python_is_one_usage_error(tmp_path, value, says):
    (tmp_path / "train.py").write_text("")
    proc = run_fdl("run", "--nproc-per-node", "2", "--worker-python", value, "train.py",
                   cwd=tmp_path)
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: --worker-python") and says in first, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_worker_python_path_with_a_newline_stays_on_one_error_line(tmp_path):
    """A raw newline in the path split the error line in two."""
    (tmp_path / "train.py").write_text("")
    odd = tmp_path / "bin\nsh"
    odd.write_text("#!/bin/sh\nexit 0\n")
    odd.chmod(0o755)
    proc = run_fdl("run", "--nproc-per-node", "2", "--worker-python", f"1={odd}", "train.py",
                   cwd=tmp_path)
    assert_one_error(proc, 2, "--worker-python: ", "bin\\nsh (local rank 1) does not run as a "
                                                  "Python interpreter")


def test_a_worker_python_that_never_answers_is_said_then_killed_with_what_it_started(
        tmp_path, monkeypatch, capsys):
    """60 s of silence, then "does not run as a Python interpreter", and the daemon it had
    started (holding its output open) left running. The waits are shortened here (the
    module's constants); the probe, its daemon and their session are real processes."""
    import fdl.launch.interpreters as interpreters
    from fdl.errors import UsageError

    monkeypatch.setattr(interpreters, "PROBE_QUIET_S", 0.2)
    monkeypatch.setattr(interpreters, "PROBE_TIMEOUT_S", 1.5)
    daemon = tmp_path / "daemon.pid"
    hung = tmp_path / "python"
    hung.write_text(f"#!/bin/sh\nsleep 1000 &\necho $! > {daemon}\nsleep 1000\n")
    hung.chmod(0o755)
    with pytest.raises(UsageError, match="does not run as a Python interpreter"):
        interpreters.probe_interpreter(1, str(hung))
    assert f"fdl run: waiting for {hung} (local rank 1) to say which Python, fdl and torch it " \
           f"runs (up to 1.5 s)" in capsys.readouterr().err
    wait_until_gone([int(daemon.read_text())], "the probe's daemon to be killed")


def make_cu128_standin(root: Path) -> Path:
    """A venv whose torch is a stand-in cu128 build (sm_75 to sm_120: no Pascal) and whose fdl
    is this checkout's: the boundary a CUDA wheel would be, on a host without one."""
    python, purelib = bare_venv(root)
    (purelib / "torch").mkdir()
    (purelib / "torch" / "__init__.py").write_text(
        standin_torch("2.13.0+cu128", archs="sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"))
    info = purelib / "torch-2.13.0+cu128.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cu128\n")
    (purelib / "checkout.pth").write_text(str(Path(__file__).resolve().parents[2]) + "\n")
    return python


def test_a_worker_whose_torch_has_no_kernel_for_its_gpu_is_refused_before_it_starts(tmp_path):
    """The surveyed RTX 5060 Ti + GTX 1060 (the GPUs are the boundary: FDL_GPU_SURVEY), both
    workers under a cu128 torch: it runs the 5060 Ti and has no kernel for the 1060."""
    standin = make_cu128_standin(tmp_path / "cu128")
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    env = {"FDL_GPU_SURVEY": str(Path(__file__).parents[1] / "fixtures" / "gpus" /
                                 "gtx1060_rtx5060ti.json")}
    flags = ("--worker-python", f"0={standin},1={standin}", "train.py")
    planned = run_fdl("run", "--dry-run", "--json", *flags, cwd=tmp_path, env=env)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["kernel_check"] == [
        f"local rank 1 (GPU 1 NVIDIA GeForce GTX 1060 6GB, sm_61): torch 2.13.0+cu128 under "
        f"{standin} cannot run on it (no kernel image for sm_61: the build has sm_75, sm_80, "
        "sm_86, sm_90, sm_100, sm_120 (a cubin runs only on its own major version, PTX only on "
        "newer GPUs))"]
    proc = run_fdl("run", *flags, cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith(
        "error: local rank 1 (GPU 1 NVIDIA GeForce GTX 1060 6GB, sm_61): torch 2.13.0+cu128")
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize("kind", ["garbage", "null", "fifo", "deep", "not python"])
def test_a_hostile_device_map_is_one_error_naming_it(tmp_path, kind):
    """$FLODL_HOME/envs/device-map.json as a clumsy user or an attacker leaves it: never a
    hang (a FIFO), a traceback (nesting) or a worker started under a non-path."""
    import os

    envs = tmp_path / "home" / "envs"
    envs.mkdir(parents=True)
    path = envs / "device-map.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text({"garbage": "{not json", "null": "null", "deep": "[" * 100_000,
                         "not python": json.dumps({"devices": {"index:0": {"python": 7}}})}[kind])
    (tmp_path / "train.py").write_text("")
    env = {"FDL_GPU_SURVEY": str(Path(__file__).parents[1] / "fixtures" / "gpus" /
                                 "gtx1060_rtx5060ti.json"), "FLODL_HOME": str(tmp_path / "home")}
    proc = run_fdl("run", "--dry-run", "train.py", cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[0].startswith(f"error: device map {path}: ")
