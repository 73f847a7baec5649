"""The installed torch wheel, probed in a child interpreter so fdl never imports torch itself.

``probe_torch()`` runs ``<python> -c <probe>``; the probe prints one JSON line per stage
(``{"installed": false}`` when torch cannot be found, a line before ``import torch`` and a
final one with the facts) and ``parse_probe_output`` reads the last. So a probe that hangs or
crashes while importing torch still tells us torch is there, and ``TorchInfo.error`` says what
went wrong.

Reading ``TorchInfo``: check ``error`` first (the probe failed; ``installed`` is then what was
learnt before it failed), then ``installed`` (False: torch is simply not installed, a normal
state). ``arch_list`` is the list the wheel was compiled for even when no GPU is usable (it is
read from the build flags, where ``torch.cuda.get_arch_list()`` answers ``[]`` without a GPU).

The child runs quietly and cheaply: warnings off, PYTORCH_NVML_BASED_CUDA_CHECK=1 so that
``torch.cuda.is_available()`` asks NVML instead of creating a CUDA context, and without the
current directory on ``sys.path`` (a pytorch checkout there would shadow the installed wheel).

Example::

    >>> probe_torch()
    TorchInfo(installed=True, python='/venv/bin/python', version='2.13.0+cpu', cuda_version=None,
              ..., gloo_available=True, ...)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any

_PROBE = r"""
import json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
import importlib.util

def emit(**fields):
    print(json.dumps(fields), flush=True)

def get(read, default=None):
    try:
        value = read()
    except Exception:
        return default
    return default if value is None else value

spec = get(lambda: importlib.util.find_spec("torch"))
if spec is None:
    emit(installed=False)
    sys.exit(0)
path = os.path.dirname(spec.origin) if spec.origin else None
emit(installed=True, stage="import", path=path)
try:
    import torch
except Exception as exc:
    emit(installed=True, stage="import", path=path,
         error=f"import torch failed: {type(exc).__name__}: {exc}")
    sys.exit(0)

# The build's own arch list: torch.cuda.get_arch_list() answers [] whenever no GPU is usable.
archs = get(lambda: torch._C._cuda_getArchFlags().split())
dist = get(lambda: torch.distributed.is_available(), False)
nccl = bool(dist and get(lambda: torch.distributed.is_nccl_available(), False))
nccl_version = get(lambda: torch.cuda.nccl.version()) if nccl else None
if isinstance(nccl_version, tuple):
    nccl_version = ".".join(map(str, nccl_version))
root = os.path.dirname(torch.__file__)
count = get(lambda: torch.cuda.device_count(), 0)
# NCCL's peer-to-peer needs each pair of GPUs to reach the other's memory (both ways); asking
# initialises CUDA, so only where there is a pair to ask about
peer = get(lambda: [[i, j, bool(torch.cuda.can_device_access_peer(i, j))
                     and bool(torch.cuda.can_device_access_peer(j, i))]
                    for i in range(count) for j in range(i + 1, count)], []) \
    if isinstance(count, int) and count >= 2 and not os.environ.get("FDL_PROBE_NO_PEERS") \
    else []
emit(
    installed=True, stage="done", path=root,
    libtorch=all(os.path.isdir(os.path.join(root, part))
                 for part in ("lib", "include", os.path.join("share", "cmake", "Torch"))),
    version=str(torch.__version__),
    cuda_version=get(lambda: torch.version.cuda),
    hip_version=get(lambda: torch.version.hip),
    arch_list=archs if archs is not None else get(lambda: torch.cuda.get_arch_list(), []),
    nccl_version=nccl_version,
    gloo_available=bool(dist and get(lambda: torch.distributed.is_gloo_available(), False)),
    nccl_available=nccl,
    cuda_available=bool(get(lambda: torch.cuda.is_available(), False)),
    device_count=count,
    peer_access=peer,
)
"""

_QUIET_ENV = {
    "PYTHONWARNINGS": "ignore",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "CUDA_MODULE_LOADING": "LAZY",
}


@dataclass(frozen=True)
class TorchInfo:
    """The torch wheel of one interpreter. ``error`` set = the probe failed (torch broken,
    hung or the interpreter unusable); otherwise ``installed`` False = torch is not installed."""

    installed: bool
    python: str
    version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    arch_list: tuple[str, ...] = ()
    nccl_version: str | None = None
    gloo_available: bool = False
    nccl_available: bool = False
    cuda_available: bool = False
    device_count: int = 0
    path: str | None = None
    libtorch: bool = False  # the wheel ships lib/, include/, share/cmake/Torch: linkable
    error: str | None = None
    # (i, j, ok) per pair of CUDA devices i < j: peer access both ways (NCCL's P2P); () under 2
    peer_access: tuple[tuple[int, int, bool], ...] = ()


def probe_torch(*, python: str | None = None, timeout_s: float = 60.0,
                peers: bool = True) -> TorchInfo:
    """Probe the torch of ``python`` (default: this interpreter) in a child process.
    ``peers=False`` leaves out the GPU pairs' peer access (it initialises CUDA on every GPU:
    seconds that a check of the build alone does not need).

    Never raises: a missing interpreter, a crash or a probe still running after ``timeout_s``
    seconds (the child and its children are then killed) come back as ``TorchInfo.error``.
    """
    python = python or sys.executable
    try:
        child = subprocess.Popen(
            [python, "-c", _PROBE], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, errors="replace",
            env={**os.environ, **_QUIET_ENV, **({} if peers else {"FDL_PROBE_NO_PEERS": "1"})},
            start_new_session=True,
        )
    except OSError as exc:
        return TorchInfo(installed=False, python=python,
                         error=f"cannot run {python}: {exc.strerror or exc}")
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(child)
        out, _ = child.communicate()
        info = parse_probe_output(out, python=python)
        where = " while importing torch" if info.installed else ""
        return replace(info, error=f"the torch probe did not finish within {timeout_s:g} s{where}")
    info = parse_probe_output(out, python=python)
    if child.returncode == 0:
        return info
    where = " while importing torch" if info.installed and info.version is None else ""
    last = next((line for line in reversed(err.splitlines()) if line.strip()), "no output")
    return replace(info, error=f"the torch probe {_exit_text(child.returncode)}{where}: {last}")


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _kill_tree(child: subprocess.Popen[str]) -> None:
    """Kill the probe and anything it started (its session), so no pipe stays open."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(child.pid, signal.SIGKILL)
            return
        except OSError:
            pass
    child.kill()


def parse_probe_output(text: str, *, python: str) -> TorchInfo:
    """The ``TorchInfo`` in the probe's output: its last JSON object line. No such line, or a
    probe that stopped before its final line, gives a ``TorchInfo`` with ``error`` set."""
    record = _last_record(text)
    if record is None:
        return TorchInfo(installed=False, python=python, error="the torch probe printed no result")
    if not record.get("installed"):
        return TorchInfo(installed=False, python=python)
    error = _text(record.get("error"))
    if error is None and record.get("stage") != "done":
        error = "the torch probe stopped while importing torch"
    return TorchInfo(
        installed=True,
        python=python,
        version=_text(record.get("version")),
        cuda_version=_text(record.get("cuda_version")),
        hip_version=_text(record.get("hip_version")),
        arch_list=tuple(str(arch) for arch in record.get("arch_list") or ()),
        nccl_version=_text(record.get("nccl_version")),
        gloo_available=record.get("gloo_available") is True,
        nccl_available=record.get("nccl_available") is True,
        cuda_available=record.get("cuda_available") is True,
        device_count=_count(record.get("device_count")),
        path=_text(record.get("path")),
        libtorch=record.get("libtorch") is True,
        error=error,
        peer_access=_pairs(record.get("peer_access")),
    )


def _last_record(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "installed" in record:
            return record
    return None


def _pairs(value: Any) -> tuple[tuple[int, int, bool], ...]:
    """The probe's ``[[i, j, ok], ...]``; an entry of another shape is dropped."""
    if not isinstance(value, list):
        return ()
    return tuple((item[0], item[1], item[2]) for item in value
                 if isinstance(item, list) and len(item) == 3 and _count(item[0]) == item[0]
                 and _count(item[1]) == item[1] and isinstance(item[2], bool))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
