"""``fdl setup --yes`` on the surveyed GTX 1060 + RTX 5060 Ti: the environments made for real
(venvs, pip), the device map written, and ``fdl run`` reading it.

The boundaries this host lacks are stood in for: the GPUs (FDL_GPU_SURVEY), and PyTorch's wheel
index, served here on 127.0.0.1 (a PEP 503 index, ``FDL_TORCH_INDEX``) with stand-in torch
wheels of 2.11.0 for cu126 and cu128 that report their build's arch list as a real one would.
pip, venv, the HTTP fetch and the probes are real. ``PIP_NO_DEPS`` keeps pip from asking a
package index for fdl's dependencies (none is reachable offline).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import zipfile
from pathlib import Path

import pytest
from helpers import assert_one_error, run_fdl, standin_torch

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gpus" / "gtx1060_rtx5060ti.json"
ARCHS = {"cu126": "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90",
         "cu128": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"}
#: each wheel's NCCL, as torch.cuda.nccl.version() reports it: two wheels, two NCCLs
NCCL = {"cu126": (2, 21, 5), "cu128": (2, 26, 2)}


def standin_wheel(folder: Path, variant: str, *, archs: str,
                  nccl: tuple[int, ...] | None = None) -> Path:
    """torch-2.11.0+<variant>-py3-none-any.whl, a valid wheel (PEP 427) of the stand-in."""
    version = f"2.11.0+{variant}"
    info = f"torch-{version}.dist-info"
    files = {"torch/__init__.py": standin_torch(version, archs=archs,
                                                nccl=nccl or NCCL[variant]),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: fdl-test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


@pytest.fixture
def torch_index(tmp_path, request):
    """PyTorch's wheel index, stood in: <base>/<variant>/torch/ lists that variant's wheel
    (``request.param``: one NCCL for both wheels instead of each its own)."""
    root = tmp_path / "index"
    for variant, archs in ARCHS.items():
        folder = root / variant / "torch"
        folder.mkdir(parents=True)
        wheel = standin_wheel(folder, variant, archs=archs,
                              nccl=getattr(request, "param", None))
        (folder / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("torch_index", "backend"), [
    (None, {"value": "cpu", "source": "device map: several environments"}),
    ((2, 21, 5), {"value": "auto", "source": "default"})], indirect=["torch_index"])
def test_setup_makes_one_environment_per_card_and_run_uses_them(tmp_path, torch_index,
                                                                backend):
    """Two wheels carry two NCCLs: averages go through host memory; the same NCCL in both
    leaves the backend to the usual choice."""
    home = tmp_path / "flodl"
    env = {"FDL_GPU_SURVEY": str(FIXTURE), "FLODL_HOME": str(home),
           "FDL_TORCH_INDEX": torch_index, "FDL_ALLOW_HTTP": "1", "PIP_NO_DEPS": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    made = run_fdl("setup", "--yes", env=env, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    envs = home / "envs"
    device_map = json.loads((envs / "device-map.json").read_text())
    assert device_map == {"release": "2.11.0", "devices": {
        "index:0": {"environment": "2.11.0-cu128",
                    "python": str(envs / "2.11.0-cu128" / "bin" / "python")},
        "index:1": {"environment": "2.11.0-cu126",
                    "python": str(envs / "2.11.0-cu126" / "bin" / "python")}}}
    assert "environment 2/2: 2.11.0-cu126" in made.stderr
    (tmp_path / "train.py").write_text("")
    planned = run_fdl("run", "--dry-run", "--json", "train.py", cwd=tmp_path, env=env)
    assert planned.returncode == 0, planned.stderr
    spec = json.loads(planned.stdout)
    assert [w["python"] for w in spec["workers"]] == [
        str(envs / "2.11.0-cu128" / "bin" / "python"),
        str(envs / "2.11.0-cu126" / "bin" / "python")]
    assert [i["torch"] for i in spec["interpreters"]] == ["2.11.0+cu128", "2.11.0+cu126"]
    assert spec["kernel_check"] == []  # each card's torch has its kernels
    assert spec["settings"]["backend"] == backend
    assert ("FDL_BACKEND" in spec["env"]) == (backend["value"] == "cpu")


def test_an_environment_whose_torch_misses_its_card_is_refused_and_no_map_is_written(
        tmp_path, torch_index):
    """The cu126 wheel served here lacks Pascal (a wrong wheel behind the index): setup stops
    naming it, and fdl run has no device map to follow."""
    index_root = tmp_path / "index" / "cu126" / "torch"
    for old in index_root.glob("*.whl"):
        old.unlink()
    wheel = standin_wheel(index_root, "cu126", archs="sm_70 sm_75 sm_80 sm_86 sm_90")
    (index_root / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    home = tmp_path / "flodl"
    env = {"FDL_GPU_SURVEY": str(FIXTURE), "FLODL_HOME": str(home),
           "FDL_TORCH_INDEX": torch_index, "FDL_ALLOW_HTTP": "1", "PIP_NO_DEPS": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    made = run_fdl("setup", "--yes", env=env, timeout=600)
    assert made.returncode == 1
    assert "error: environment 2.11.0-cu126: its torch 2.11.0+cu126 has no kernels for " \
           "NVIDIA GeForce GTX 1060 6GB (sm_61)" in made.stderr
    assert not (home / "envs" / "device-map.json").exists()


@pytest.mark.parametrize(("index", "says"), [
    ("notaurl", "FDL_TORCH_INDEX: URL 'notaurl' has scheme 'none'"),
    ("http://127.0.0.1:9/whl", "FDL_TORCH_INDEX: refusing to download over plain http"),
    ("ftp://mirror/whl", "FDL_TORCH_INDEX: URL 'ftp://mirror/whl' has scheme 'ftp'")])
def test_a_torch_index_that_is_no_usable_url_is_refused_before_anything_is_made(tmp_path, index,
                                                                                says):
    """notaurl failed in pip after a venv was made; plain http was used without the opt-in
    every other URL fdl fetches needs."""
    home = tmp_path / "flodl"
    made = run_fdl("setup", "--yes", env={"FDL_GPU_SURVEY": str(FIXTURE), "FLODL_HOME": str(home),
                                          "FDL_TORCH_INDEX": index})
    assert_one_error(made, 2, says)
    assert not (home / "envs").exists()


def test_environments_share_nccl_only_when_every_build_carries_the_same():
    from fdl.launch.kernels import shared_nccl
    from fdl.system.torchenv import TorchInfo

    def build(nccl):
        return TorchInfo(installed=True, python="p", nccl_version=nccl)

    assert shared_nccl({"a": build("2.21.5"), "b": build("2.21.5")}) == "2.21.5"
    assert shared_nccl({"a": build("2.21.5"), "b": build("2.26.2")}) is None
    assert shared_nccl({"a": build(None), "b": build(None)}) is None
