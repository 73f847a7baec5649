"""The torch wheel probe: real interpreters with and without torch, fakes for the failures."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fdl.system.torchenv import TorchInfo, parse_probe_output, probe_torch

DONE = {
    "installed": True,
    "stage": "done",
    "path": "/venv/lib/python3.12/site-packages/torch",
    "version": "2.9.1+cu130",
    "cuda_version": "13.0",
    "hip_version": None,
    "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
    "nccl_version": "2.27.7",
    "gloo_available": True,
    "nccl_available": True,
    "cuda_available": True,
    "device_count": 2,
}


def fake_python(tmp_path: Path, body: str, name: str = "python") -> str:
    """An 'interpreter' for probe_torch: a shell script that receives ``-c <probe>``."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(scope="module")
def venv_torch() -> tuple[TorchInfo, bool]:
    imported_before = "torch" in sys.modules
    return probe_torch(), imported_before


def test_probe_reads_the_cpu_wheel_of_this_venv(venv_torch: tuple[TorchInfo, bool]) -> None:
    info, _ = venv_torch
    assert info.error is None
    assert info.installed is True
    assert info.python == sys.executable
    assert info.version is not None and info.version.startswith("2.")
    assert info.cuda_version is None
    assert info.arch_list == ()
    assert info.gloo_available is True
    assert (info.nccl_available, info.cuda_available, info.device_count) == (False, False, 0)
    assert info.path is not None and Path(info.path, "__init__.py").is_file()


def test_probe_does_not_import_torch_in_the_calling_process() -> None:
    # A fresh interpreter, since other tests in this session may import torch themselves.
    code = ("import sys; from fdl.system.torchenv import probe_torch; info = probe_torch(); "
            "print(info.installed, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.split() == ["True", "False"]


def test_python_without_torch_is_a_normal_state(tmp_path: Path) -> None:
    # -I -S: the real interpreter without site-packages, so torch cannot be found.
    python = fake_python(tmp_path, f'exec "{sys.executable}" -I -S "$@"\n')
    assert probe_torch(python=python) == TorchInfo(installed=False, python=python)


def test_torch_that_fails_to_import_is_installed_with_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "site/torch").mkdir(parents=True)
    (tmp_path / "site/torch/__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    info = probe_torch(python=fake_python(tmp_path, f'exec "{sys.executable}" -S "$@"\n'))
    assert info.installed is True
    assert (
        info.error
        == "import torch failed: ImportError: libcudart.so.12: cannot open shared object file"
    )
    assert info.path == str(tmp_path / "site/torch")


def test_minimal_torch_without_cuda_or_distributed_still_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "site/torch").mkdir(parents=True)
    (tmp_path / "site/torch/__init__.py").write_text(
        "import types\n__version__ = '2.99.0+odd'\nversion = types.SimpleNamespace(cuda='12.8')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    info = probe_torch(python=fake_python(tmp_path, f'exec "{sys.executable}" -S "$@"\n'))
    assert info == TorchInfo(
        installed=True,
        python=info.python,
        version="2.99.0+odd",
        cuda_version="12.8",
        path=str(tmp_path / "site/torch"),
    )


def test_probe_that_hangs_is_killed_and_reported(tmp_path: Path) -> None:
    # Not `exec`: the sleeping grandchild holds the pipes open, so the whole session must die.
    info = probe_torch(python=fake_python(tmp_path, "sleep 30\n"), timeout_s=1)
    assert info.installed is False
    assert info.error == "the torch probe did not finish within 1 s"


def test_probe_that_hangs_importing_torch_says_torch_is_there(tmp_path: Path) -> None:
    line = json.dumps({"installed": True, "stage": "import", "path": "/x/torch"})
    info = probe_torch(python=fake_python(tmp_path, f"echo '{line}'\nsleep 30\n"), timeout_s=1)
    assert (info.installed, info.path) == (True, "/x/torch")
    assert info.error == "the torch probe did not finish within 1 s while importing torch"


def test_probe_that_crashes_importing_torch_names_the_signal(tmp_path: Path) -> None:
    line = json.dumps({"installed": True, "stage": "import", "path": "/x/torch"})
    body = f"echo '{line}'\necho 'Fatal Python error: Segmentation fault' >&2\nkill -SEGV $$\n"
    info = probe_torch(python=fake_python(tmp_path, body))
    assert info.installed is True
    assert info.error == (
        "the torch probe was killed by SIGSEGV while importing torch: "
        "Fatal Python error: Segmentation fault"
    )


def test_missing_interpreter_is_reported(tmp_path: Path) -> None:
    info = probe_torch(python=str(tmp_path / "python9"))
    assert info.installed is False
    assert info.error is not None and info.error.startswith(f"cannot run {tmp_path / 'python9'}")


def test_parse_probe_output_reads_the_last_record() -> None:
    text = "\n".join(
        [
            "some import-time chatter",
            json.dumps({"installed": True, "stage": "import", "path": DONE["path"]}),
            "{not json",
            json.dumps(DONE),
            "[W Module.cpp] trailing warning",
        ]
    )
    info = parse_probe_output(text, python="/venv/bin/python")
    assert info == TorchInfo(
        installed=True,
        python="/venv/bin/python",
        version="2.9.1+cu130",
        cuda_version="13.0",
        arch_list=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"),
        nccl_version="2.27.7",
        gloo_available=True,
        nccl_available=True,
        cuda_available=True,
        device_count=2,
        path="/venv/lib/python3.12/site-packages/torch",
    )


def test_parse_probe_output_not_installed() -> None:
    assert parse_probe_output('{"installed": false}\n', python="py") == TorchInfo(False, "py")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "the torch probe printed no result"),
        ('{"other": 1}\nTraceback (most recent call last):\n', "the torch probe printed no result"),
        (
            '{"installed": true, "stage": "import", "path": "/t"}\n',
            "the torch probe stopped while importing torch",
        ),
        (
            '{"installed": true, "stage": "import", "error": "import torch failed: OSError: x"}\n',
            "import torch failed: OSError: x",
        ),
    ],
)
def test_parse_probe_output_failures(text: str, error: str) -> None:
    assert parse_probe_output(text, python="py").error == error


def test_parse_probe_output_tolerates_ill_typed_fields() -> None:
    record = {**DONE, "device_count": "2", "gloo_available": "yes", "arch_list": None}
    info = parse_probe_output(json.dumps(record), python="py")
    assert (info.device_count, info.gloo_available, info.arch_list) == (0, False, ())
    assert info.error is None


def test_probe_asks_peer_access_of_each_gpu_pair_both_ways(tmp_path: Path) -> None:
    """The real probe and torch, with torch.cuda's device count and peer answers replaced
    before the probe imports torch (the CUDA boundary: this host has no GPU). GPU 1 cannot
    reach GPU 2's memory: the pair lacks P2P though 2 reaches 1."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        "torch.cuda.device_count = lambda: 3\n"
        "torch.cuda.can_device_access_peer = lambda i, j: (i, j) != (1, 2)\n")
    info = probe_torch(python=fake_python(
        tmp_path, f'PYTHONPATH="{site}" exec "{sys.executable}" "$@"\n'))
    assert info.error is None and info.device_count == 3
    assert info.peer_access == ((0, 1, True), (0, 2, True), (1, 2, False))


def test_parse_probe_output_keeps_only_well_formed_peer_pairs() -> None:
    record = {**DONE, "peer_access": [[0, 1, False], [0, "1", True], [1, 2], "x", [-1, 2, True]]}
    assert parse_probe_output(json.dumps(record), python="py").peer_access == ((0, 1, False),)
    assert parse_probe_output(json.dumps({**DONE, "peer_access": {"0": 1}}),
                              python="py").peer_access == ()


def test_peer_access_is_asked_only_when_wanted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in torch with two GPUs (the CUDA boundary): the full probe asks each pair for
    peer access (CUDA initialised on every GPU); ``peers=False`` (fdl run's check of the build)
    does not ask."""
    (tmp_path / "site/torch").mkdir(parents=True)
    (tmp_path / "site/torch/__init__.py").write_text(
        "import types\n__version__ = '2.13.0+cu128'\nversion = types.SimpleNamespace(cuda='12.8')\n"
        "cuda = types.SimpleNamespace(device_count=lambda: 2,\n"
        "                             can_device_access_peer=lambda i, j: False)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    python = fake_python(tmp_path, f'exec "{sys.executable}" -S "$@"\n')
    assert probe_torch(python=python).peer_access == ((0, 1, False),)
    assert probe_torch(python=python, peers=False).peer_access == ()
