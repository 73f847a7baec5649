"""`fdl libtorch ...` end to end: the real entry point with FLODL_HOME in a temp directory
(``flodl_home``, its store ``store``: tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from helpers import clean_env, install_variant, run_fdl, started

from fdl.libtorch.store import Store

COMMANDS = ("list", "info", "activate", "remove", "env", "link-python")


def fdl(home: Path, *args: str) -> subprocess.CompletedProcess:
    return run_fdl("libtorch", *args, env={"FLODL_HOME": str(home)})


def add(store: Store, name: str, *, kind: str = "precompiled") -> None:
    install_variant(store, name, kind=kind, cuda="13.0", archs=["sm_75", "sm_120"],
                    source="download", url="https://example.invalid/a.zip", sha256="ab" * 32,
                    size=3 * 2**20)


def test_every_libtorch_command_is_registered():
    # their --help stays light: tests/cli/test_startup.py walks every group and command
    from typer.main import get_command

    from fdl.cli.main import app

    assert set(COMMANDS) <= set(get_command(app).commands["libtorch"].commands)


def test_list_when_empty(flodl_home):
    proc = fdl(flodl_home, "list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no libtorch installed in ")
    assert "fdl libtorch download" in proc.stdout
    proc = fdl(flodl_home, "list", "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {"schema": 1, "active": None, "variants": []}


def test_list_json_shape_and_table(flodl_home, store):
    add(store, "2.13.0-cu130")
    add(store, "sm75-sm120", kind="builds")
    store.activate("sm75-sm120")
    proc = fdl(flodl_home, "list", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == 1 and doc["active"] == "builds/sm75-sm120"
    first = doc["variants"][0]
    assert list(first)[:5] == ["id", "kind", "name", "path", "active"]
    installed_at = first.pop("installed_at")
    assert first == {"id": "precompiled/2.13.0-cu130", "kind": "precompiled",
                     "name": "2.13.0-cu130", "active": False,
                     "path": str(store.root / "precompiled" / "2.13.0-cu130"),
                     "version": "2.13.0", "cuda": "13.0", "archs": ["sm_75", "sm_120"],
                     "source": "download", "url": "https://example.invalid/a.zip",
                     "sha256": "ab" * 32, "size": 3 * 2**20}
    assert installed_at.endswith("+00:00")
    assert [v["active"] for v in doc["variants"]] == [False, True]
    table = fdl(flodl_home, "list")
    assert table.returncode == 0
    line = next(row for row in table.stdout.splitlines() if "builds/sm75-sm120" in row)
    assert "*" in line and "sm_75 sm_120" in line


def test_info_defaults_to_the_active_variant(flodl_home, store):
    add(store, "2.13.0-cu130")
    proc = fdl(flodl_home, "info")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == "error: no libtorch is active"
    assert "fdl libtorch download" in proc.stderr and "fdl libtorch link-python" in proc.stderr
    store.activate("2.13.0-cu130")
    doc = json.loads(fdl(flodl_home, "info", "--json").stdout)
    assert doc["schema"] == 1 and doc["id"] == "precompiled/2.13.0-cu130" and doc["active"]
    text = fdl(flodl_home, "info").stdout
    for key, value in [("id", "precompiled/2.13.0-cu130"), ("cuda", "13.0"),
                       ("archs", "sm_75 sm_120"), ("size", "3.0 MiB"), ("active", "yes"),
                       ("path", str(store.root / "precompiled" / "2.13.0-cu130"))]:
        assert any(line.split()[:1] == [key] and value in line for line in text.splitlines())


def test_info_unknown_name_is_a_usage_error(flodl_home, store):
    add(store, "2.13.0-cu130")
    proc = fdl(flodl_home, "info", "nope")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == ("error: no libtorch variant 'nope'; installed: "
                                           "precompiled/2.13.0-cu130")
    assert "Traceback" not in proc.stderr


def test_activate_and_remove(flodl_home, store):
    add(store, "2.13.0-cu130")
    proc = fdl(flodl_home, "activate", "2.13.0-cu130")
    assert (proc.returncode, proc.stdout) == (0, "active libtorch: precompiled/2.13.0-cu130\n")
    assert (store.root / ".active").read_text() == "precompiled/2.13.0-cu130\n"
    assert fdl(flodl_home, "activate", "nope").returncode == 2
    refused = fdl(flodl_home, "remove", "2.13.0-cu130")
    assert refused.returncode == 2
    assert "--force" in refused.stderr and (store.root / "precompiled" / "2.13.0-cu130").is_dir()
    proc = fdl(flodl_home, "remove", "2.13.0-cu130", "--force")
    assert (proc.returncode, proc.stdout) == (0, "removed precompiled/2.13.0-cu130\n")
    assert not (store.root / ".active").exists() and store.variants() == []


def test_env_prints_exports_for_the_active_variant(flodl_home, store):
    proc = fdl(flodl_home, "env")
    assert proc.returncode == 1 and "fdl libtorch link-python" in proc.stderr
    add(store, "2.13.0-cu130")
    variant = store.activate("2.13.0-cu130")
    for shell in ("bash", "fish", "powershell"):
        proc = fdl(flodl_home, "env", "--shell", shell)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == store.env(variant, shell=shell)
    assert fdl(flodl_home, "env").stdout == store.env(variant, shell="bash")
    bad = fdl(flodl_home, "env", "--shell", "tcsh")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: unknown shell 'tcsh'; allowed: bash, zsh, fish")


def fake_python(where: Path, *, record: dict) -> Path:
    """An "interpreter" that answers the torch probe with ``record`` (a real wheel is linked in
    test_store.py; here only the command around it is under test)."""
    script = where / "fake-python"
    script.write_text(f"#!/bin/sh\necho '{json.dumps(record)}'\n")
    script.chmod(0o755)
    return script


def test_link_python_from_the_cli(flodl_home, store, tmp_path):
    wheel = tmp_path / "site-packages" / "torch"
    for part in ("lib", "include", "share/cmake/Torch"):
        (wheel / part).mkdir(parents=True)
    python = fake_python(tmp_path, record={
        "installed": True, "stage": "done", "path": str(wheel), "version": "2.13.0+cu130",
        "cuda_version": "13.0", "arch_list": ["sm_75", "sm_120"]})
    proc = fdl(flodl_home, "link-python", "--python", str(python))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"linked python/torch-2.13.0+cu130 -> {wheel}\n"
    assert "fdl libtorch activate python/torch-2.13.0+cu130" in proc.stderr
    (variant,) = store.variants()
    assert (variant.path / "lib").resolve() == wheel / "lib"
    assert (variant.meta["cuda"], variant.meta["archs"]) == ("13.0", ["sm_75", "sm_120"])


def test_link_python_without_torch_is_a_usage_error(flodl_home, store, tmp_path):
    python = fake_python(tmp_path, record={"installed": False})
    proc = fdl(flodl_home, "link-python", "--python", str(python))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: torch is not installed; `fdl libtorch link-python`")
    assert store.variants() == []


def test_concurrent_cli_activations_leave_one_of_the_two(flodl_home, store):
    add(store, "a")
    add(store, "b", kind="builds")
    env = {"FLODL_HOME": str(flodl_home)}
    for _ in range(3):
        with ExitStack() as running:
            children = [running.enter_context(started(
                [sys.executable, "-m", "fdl", "libtorch", "activate", name], env=clean_env(env),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)) for name in ("a", "b")]
            assert [child.wait(timeout=60) for child in children] == [0, 0]
        assert (store.root / ".active").read_text() in ("precompiled/a\n", "builds/b\n")
