"""`fdl libtorch download` and `fdl setup` end to end: the real entry point in a subprocess,
archives built here and served by a real HTTP server on 127.0.0.1 (the internet is the boundary
we cannot have: FDL_LIBTORCH_MIRROR points the catalog at the local server). Faults (wrong
sha256, hostile archives, Ctrl-C, concurrent downloads, plain http) are in
tests/faults/test_download_faults.py."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import sys
import zipfile
from pathlib import Path

from helpers import GPU_FIXTURES, libtorch_list, run_fdl

from fdl.libtorch.store import Store

CPU_PATH = "cpu/libtorch-shared-with-deps-{v}%2Bcpu.zip"


def libtorch_zip(version: str = "2.13.0") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("libtorch/lib/libtorch_cpu.so", b"\x7fELF" + b"\0" * 64)
        archive.writestr("libtorch/include/torch/torch.h", "// stand-in header\n")
        archive.writestr("libtorch/share/cmake/Torch/TorchConfig.cmake", "# stand-in\n")
        archive.writestr("libtorch/build-version", f"{version}+cpu\n")
    return buffer.getvalue()


def test_download_installs_verifies_and_activates(http_server, mirror_env):
    data = libtorch_zip()
    http_server.files[CPU_PATH.format(v="2.13.0")] = data
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", env=mirror_env)
    assert proc.returncode == 0, proc.stderr
    doc = libtorch_list(mirror_env)
    assert doc["active"] == "precompiled/2.13.0-cpu"
    entry = doc["variants"][0]
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["size"] == len(data) and entry["url"].endswith("%2Bcpu.zip")
    assert Path(entry["path"], "lib", "libtorch_cpu.so").is_file()
    home = Path(mirror_env["FLODL_HOME"]) / "libtorch" / ".staging"
    # no archive, part file, tree or download lock left behind
    assert [p.name for p in home.iterdir()] == []
    exports = run_fdl("libtorch", "env", env=mirror_env).stdout
    assert f"export LIBTORCH={entry['path']}" in exports
    # a second download of the same variant fetches nothing and keeps it active
    before = len(http_server.requests)
    again = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", env=mirror_env)
    assert again.returncode == 0, again.stderr
    assert len(http_server.requests) == before


def test_404_is_a_clear_error(http_server, mirror_env):
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.12.0", env=mirror_env)
    assert proc.returncode == 1
    assert "404" in proc.stderr
    assert libtorch_list(mirror_env)["variants"] == []


def test_dry_run_fetches_nothing(http_server, mirror_env):
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", "--dry-run",
                   env=mirror_env)
    assert proc.returncode == 0 and "libtorch-shared-with-deps-2.13.0%2Bcpu.zip" in proc.stdout
    assert http_server.requests == []


def test_url_and_variant_name_for_air_gapped_sites(http_server, mirror_env):
    http_server.files["site/libtorch.zip"] = libtorch_zip()
    proc = run_fdl("libtorch", "download", "--url", http_server.url("site/libtorch.zip"),
                   "--variant", "site-build", "--no-activate", env=mirror_env)
    assert proc.returncode == 0, proc.stderr
    doc = libtorch_list(mirror_env)
    assert doc["active"] is None and doc["variants"][0]["id"] == "precompiled/site-build"


def test_setup_on_a_cpu_host_ends_with_the_cpu_variant_active(http_server, mirror_env):
    from fdl.libtorch.catalog import latest_version

    http_server.files[CPU_PATH.format(v=latest_version())] = libtorch_zip(latest_version())
    assert run_fdl("setup", "--dry-run", "--download", env=mirror_env).returncode == 0
    assert libtorch_list(mirror_env)["variants"] == []
    proc = run_fdl("setup", "--yes", "--download", env=mirror_env)
    assert proc.returncode == 0, proc.stderr
    assert libtorch_list(mirror_env)["active"] == f"precompiled/{latest_version()}-cpu"
    assert "export LIBTORCH=" in proc.stdout
    report = json.loads(run_fdl("diagnose", "--json", env=mirror_env).stdout)
    assert report["libtorch"]["id"] == f"precompiled/{latest_version()}-cpu"


def test_setup_without_yes_and_without_a_terminal_asks_for_yes(http_server, mirror_env):
    from fdl.libtorch.catalog import latest_version

    http_server.files[CPU_PATH.format(v=latest_version())] = libtorch_zip(latest_version())
    proc = run_fdl("setup", "--download", env=mirror_env)
    assert proc.returncode == 2 and "--yes" in proc.stderr
    assert libtorch_list(mirror_env)["variants"] == []


def test_setup_install_torch_runs_exactly_the_pip_command_it_shows(tmp_path, monkeypatch, capsys):
    # In-process, so that the interpreter can be the seam: pip would fetch torch from the
    # internet, so a stand-in records `-m pip ...` and hands the rest (the torch probe) on.
    record = tmp_path / "pip-argv"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then\n'
                      f'  printf "%s\\n" "$@" > {shlex.quote(str(record))}\n  exit 0\nfi\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    home = tmp_path / "home"
    for name, value in (("FLODL_HOME", str(home)),
                        ("FDL_GPU_SURVEY", str(GPU_FIXTURES / "rtx4090.json"))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FDL_LIBTORCH_MIRROR", raising=False)
    tree = tmp_path / "tree" / "libtorch"
    for part in ("lib", "include"):
        (tree / part).mkdir(parents=True)
    Store(home / "libtorch").install(kind="precompiled", name="2.14.0-cu126", tree=tree.parent,
                                     meta={"version": "2.14.0", "cuda": "12.6"})

    from fdl.cli.main import app

    code = app(["setup", "--install-torch", "--yes"], prog_name="fdl", standalone_mode=False)
    out, err = capsys.readouterr()
    assert code == 0, err
    shown = next(line.strip().removeprefix("pip").strip() for line in out.splitlines()
                 if line.split()[:1] == ["pip"])
    assert shown == ("pip install --force-reinstall 'torch==2.14.0' "
                     "--index-url https://download.pytorch.org/whl/cu126")
    ran = record.read_text().splitlines()
    assert ran == ["-m", *shlex.split(shown)]
    assert f"running: {shlex.join([str(python), *ran])}" in err.splitlines()
    assert "precompiled/2.14.0-cu126 at" in out  # activated, nothing downloaded


def test_setup_links_a_covering_wheel_and_downloads_nothing(http_server, mirror_env, tmp_path):
    wheel = tmp_path / "site-packages" / "torch"
    for part in ("lib", "include", "share/cmake/Torch"):
        (wheel / part).mkdir(parents=True)
    python = tmp_path / "python"  # answers the torch probe: a CPU wheel with its libtorch
    record = {"installed": True, "stage": "done", "path": str(wheel), "version": "2.13.0+cpu",
              "libtorch": True}
    python.write_text(f"#!/bin/sh\necho '{json.dumps(record)}'\n")
    python.chmod(0o755)
    doc = json.loads(run_fdl("setup", "--json", "--python", str(python), env=mirror_env).stdout)
    assert (doc["action"], doc["source"], doc["variant"], doc["url"]) == (
        "link", "wheel", "python/torch-2.13.0+cpu", None)
    assert doc["why"].startswith("the installed torch 2.13.0+cpu wheel covers this CPU-only "
                                 "host: linking its libtorch (0 bytes) instead of downloading")
    forced = json.loads(run_fdl("setup", "--json", "--download", "--python", str(python),
                                env=mirror_env).stdout)
    assert forced["action"] == "download" and forced["url"].endswith("%2Bcpu.zip")
    proc = run_fdl("setup", "--yes", "--python", str(python), env=mirror_env)
    assert proc.returncode == 0, proc.stderr
    assert "linking its libtorch (0 bytes)" in proc.stdout.replace("\n  ", " ")
    assert libtorch_list(mirror_env)["active"] == "python/torch-2.13.0+cpu"
    assert http_server.requests == []
