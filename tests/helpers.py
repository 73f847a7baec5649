"""Test helpers: run the real `fdl` entry point in a subprocess with a clean environment, start a
process that is ended with everything it started however the test ends, check the one-error-line
contract, read the libtorch store through the CLI, wait on a condition with a guard, locate
fixtures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from fdl.settings import is_launcher_variable

FIXTURES = Path(__file__).parent / "fixtures"
GPU_FIXTURES = FIXTURES / "gpus"
GUARD_S = 120  # how long a wait may take before the test fails as hung: never a measurement


def run_fdl(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m fdl ARGS`` as a user would run it; returns the completed process."""
    return subprocess.run([sys.executable, "-m", "fdl", *args], capture_output=True, text=True,
                          env=clean_env(env), cwd=cwd, timeout=timeout, input=input)


@contextmanager
def started(argv: list[str], **popen_kwargs) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(argv, **popen_kwargs)`` in a session of its own, for a test that talks
    to a running process. On the way out, passed or failed, the process, its process group and
    every descendant it has then (torch's workers run in sessions of their own) are SIGKILLed
    and reaped, and its pipes closed: a failing test leaves nothing running. A test that wants a
    gentler end (SIGINT, a release file) does that inside the block and waits there."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
    try:
        yield proc
    finally:
        end_process_tree(proc)


def end_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (started with ``start_new_session``), its process group and its
    descendants, reap it and close its pipes. Harmless when all of them have exited."""
    family: list[psutil.Process] = []
    if proc.poll() is None:  # not reaped yet, so its pid is still its own
        with suppress(psutil.Error):
            family = psutil.Process(proc.pid).children(recursive=True)
    with suppress(ProcessLookupError, PermissionError):  # the group outlives a reaped leader
        os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        with suppress(psutil.Error):
            child.kill()
    proc.wait(timeout=GUARD_S)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[str]:
    """Each process's output; any still running at ``deadline`` is killed (its code is then
    negative), so a hang on one node shows what every node said instead of a bare timeout.
    SIGTERM lets each agent stop its own workers."""
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.terminate()
            out, _ = proc.communicate(timeout=60)
        outputs.append(out)
    return outputs


def libtorch_list(env: dict[str, str]) -> dict:
    """What ``fdl libtorch list --json`` says of the store of ``env``'s FLODL_HOME, parsed: the
    store as a user sees it, not as the test's own Store object reads it. Fails the test if
    the command fails."""
    proc = run_fdl("libtorch", "list", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, plus ``extra``, for a subprocess: without the launcher's
    variables (``fdl.settings.is_launcher_variable``: fdl's, torchelastic's, torchrun's), Slurm's
    or OMP_NUM_THREADS, so that neither the shell that started pytest nor an ``fdl run`` around
    it changes what the subprocess does; without colour, and wide, so output compares as text."""
    base = {name: value for name, value in os.environ.items()
            if not (is_launcher_variable(name) or name.startswith("SLURM_")
                    or name == "OMP_NUM_THREADS")}
    return {**base, "NO_COLOR": "1", "COLUMNS": "200", **(extra or {})}


def assert_one_error(proc: subprocess.CompletedProcess, code: int, *needles: str,
                     alone: bool = True) -> str:
    """fdl's contract for a failure: exit ``code``, exactly one ``error:`` line followed by one
    ``hint:`` line on stderr, no traceback, and each of ``needles`` in those two lines.
    ``alone``: nothing else on stderr (pass False where progress lines may come first).
    Returns the two lines."""
    assert proc.returncode == code, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    hints = [i for i, line in enumerate(lines) if line.startswith("hint: ")]
    assert len(errors) == 1 and hints == [errors[0] + 1], proc.stderr
    if alone:
        assert len(lines) == 2, proc.stderr
    text = lines[errors[0]] + "\n" + lines[hints[0]]
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def wait_until(predicate: Callable[[], object], what: str, *,
               proc: subprocess.Popen | None = None, timeout: float = GUARD_S) -> None:
    """Return once ``predicate()`` holds; fail if ``proc`` (the process expected to make it
    hold) exits first, or after ``timeout``, a guard against a hung test, not a measurement."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode} first")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout} s")
        time.sleep(0.02)


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1 in ``folder``, made with openssl (the test skips
    without it): what a test's TLS server presents and its client trusts."""
    import pytest

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test server's certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at this moment (the OS's pick, never a fixed one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(pids: Iterable[int], what: str = "orphan workers to exit") -> None:
    """Return once none of ``pids`` runs; fail, naming the survivors, after the guard."""
    pids = list(pids)
    try:
        wait_until(lambda: not any(alive(pid) for pid in pids), what, timeout=60)
    except AssertionError:
        raise AssertionError(f"{what}: still running: {[p for p in pids if alive(p)]}") from None


STANDIN_TORCH = '''"""A stand-in torch {version} build: what fdl's probes read of a real one, nothing more."""
__version__ = "{version}"


class _C:
    @staticmethod
    def _cuda_getArchFlags():
        return "{archs}"


class version:
    cuda, hip = "{cuda}", None


class cuda:
    device_count = is_available = staticmethod(lambda: 0)
    nccl = type("nccl", (), {{"version": staticmethod(lambda: {nccl})}})


class distributed:
    is_available = is_nccl_available = is_gloo_available = staticmethod(lambda: {nccl_on})
'''


def standin_torch(version: str, *, archs: str, nccl: tuple[int, ...] | None = None) -> str:
    """The source of a stand-in CUDA torch (``2.11.0+cu128``): the boundary a CUDA wheel is, on
    a host without one. ``nccl``: what ``torch.cuda.nccl.version()`` reports (None: no
    torch.distributed)."""
    variant = version.split("+")[1]
    return STANDIN_TORCH.format(version=version, archs=archs,
                                cuda=f"{variant[2:-1]}.{variant[-1]}", nccl=nccl,
                                nccl_on=nccl is not None)


def bare_venv(root: Path) -> tuple[Path, Path]:
    """A venv without pip at ``root``: its python and its site-packages folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True, timeout=120)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    return python, Path(purelib)


def install_variant(store: Any, name: str, *, kind: str = "precompiled", **meta: Any) -> None:
    """A variant installed in ``store`` (an fdl.libtorch.store.Store) as fdl installs one: an
    empty libtorch tree and a variant.json of ``meta`` over a CPU 2.13.0 with no archs."""
    tree = store.staging() / f"tree-{name}"
    for part in ("lib", "include"):
        (tree / "libtorch" / part).mkdir(parents=True)
    store.install(kind=kind, name=name, tree=tree,
                  meta={"version": "2.13.0", "cuda": None, "archs": [], **meta})


def earlier_run(run_dir: Path) -> dict[str, str]:
    """A run directory as `fdl run` leaves it (without workers); returns its files and their
    contents."""
    (run_dir / "logs").mkdir(parents=True)
    files = {"config.json": json.dumps({"fdl_version": "0", "script": "train.py"}),
             "logs/rank0.log": "the earlier run\n", "metrics.jsonl": '{"epoch": 1}\n'}
    for name, text in files.items():
        (run_dir / name).write_text(text)
    return files


def without_module(monkeypatch: Any, prefix: str) -> None:
    """Make every import of ``prefix`` (and its submodules) in this process fail as an absent
    module's does, until the test ends: a machine without an optional extra."""
    import builtins

    real_import = builtins.__import__

    def blocked(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == prefix or name.startswith(prefix + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
