"""The libtorch store on a real filesystem: installs, activation, removal, env, link_python."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from helpers import GUARD_S, started

from fdl.errors import FdlError, MissingTorchError, UsageError
from fdl.libtorch.link import link_python
from fdl.libtorch.store import KINDS, Store, Variant


def make_tree(where: Path, *, nested: bool = False, marker: str = "v1") -> Path:
    """A fake extracted libtorch archive; ``nested`` puts it under a ``libtorch/`` folder."""
    top = where / "libtorch" if nested else where
    (top / "lib").mkdir(parents=True)
    (top / "lib" / "libtorch.so").write_text(marker)
    (top / "include" / "torch").mkdir(parents=True)
    (top / "share" / "cmake" / "Torch").mkdir(parents=True)
    (top / "share" / "cmake" / "Torch" / "TorchConfig.cmake").write_text("# cmake")
    return where


def add(store: Store, name: str, *, kind: str = "precompiled", **meta) -> Variant:
    tree = make_tree(store.staging() / f"src-{kind}-{name}")
    return store.install(kind=kind, name=name, tree=tree, meta={"version": "2.13.0", **meta})


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "libtorch")


@pytest.mark.parametrize("nested", [False, True])
def test_install_moves_the_tree_into_place_and_writes_metadata_last(store, nested):
    tree = make_tree(store.staging() / "download.tree", nested=nested)
    variant = store.install(kind="precompiled", name="2.13.0-cu130", tree=tree,
                            meta={"version": "2.13.0", "cuda": "13.0", "archs": ["sm_75"]})
    assert variant.id == "precompiled/2.13.0-cu130"
    assert variant.path == store.root / "precompiled" / "2.13.0-cu130"
    assert (variant.path / "lib" / "libtorch.so").read_text() == "v1"
    assert (variant.path / "share" / "cmake" / "Torch" / "TorchConfig.cmake").is_file()
    assert not (variant.path / "libtorch").exists()  # the inner folder was used
    on_disk = json.loads((variant.path / "variant.json").read_text())
    assert on_disk == variant.meta
    assert on_disk["cuda"] == "13.0" and on_disk["archs"] == ["sm_75"]
    installed_at = datetime.fromisoformat(on_disk["installed_at"])
    assert installed_at.utcoffset() == timedelta(0)
    assert not tree.exists()
    assert list(store.staging().iterdir()) == []
    assert store.variants() == [variant]


def test_install_replaces_an_existing_variant(store):
    add(store, "2.13.0-cu130")
    tree = make_tree(store.staging() / "again", marker="v2")
    (tree / "lib" / "only-in-v2.so").write_text("")
    variant = store.install(kind="precompiled", name="2.13.0-cu130", tree=tree,
                            meta={"version": "2.13.0", "sha256": "ab"})
    assert (variant.path / "lib" / "libtorch.so").read_text() == "v2"
    assert variant.meta["sha256"] == "ab"
    assert [v.id for v in store.variants()] == ["precompiled/2.13.0-cu130"]
    assert list((store.root / ".trash").iterdir()) == []


def test_install_rejects_what_is_not_a_libtorch(store, tmp_path):
    (tmp_path / "junk" / "lib").mkdir(parents=True)
    with pytest.raises(FdlError, match="not a libtorch tree"):
        store.install(kind="builds", name="x", tree=tmp_path / "junk", meta={})
    tree = make_tree(tmp_path / "ok")
    with pytest.raises(UsageError, match="allowed: precompiled, builds, python"):
        store.install(kind="wheels", name="x", tree=tree, meta={})
    for name in ("", ".hidden", "a/b"):
        with pytest.raises(UsageError, match="not a plain directory name"):
            store.install(kind="builds", name=name, tree=tree, meta={})
    assert store.variants() == []


def test_variants_are_only_complete_directories(store):
    add(store, "sm61-sm120", kind="builds")
    add(store, "2.13.0-cu126")
    (store.root / "precompiled" / "half-installed" / "lib").mkdir(parents=True)
    broken = store.root / "precompiled" / "broken"
    broken.mkdir()
    (broken / "variant.json").write_text("{not json")
    (store.root / "elsewhere" / "x").mkdir(parents=True)
    (store.root / "elsewhere" / "x" / "variant.json").write_text("{}")
    assert [v.id for v in store.variants()] == ["precompiled/2.13.0-cu126", "builds/sm61-sm120"]
    assert KINDS == ("precompiled", "builds", "python")


def test_an_empty_or_missing_store_has_no_variants(store):
    assert store.variants() == []
    assert store.active() is None
    assert not store.root.exists()  # reading creates nothing


def test_activate_writes_the_id_and_active_reads_it(store):
    variant = add(store, "2.13.0-cu130")
    add(store, "2.13.0-cu126")
    assert store.activate("2.13.0-cu130") == variant
    assert (store.root / ".active").read_text() == "precompiled/2.13.0-cu130\n"
    assert store.active() == variant
    store.activate("precompiled/2.13.0-cu126")
    assert store.active().name == "2.13.0-cu126"
    assert sorted(p.name for p in store.root.iterdir() if p.name.startswith(".active")) == [
        ".active"]  # no temp file left beside it
    assert stat.S_IMODE((store.root / ".active").stat().st_mode) == 0o644


def test_a_stale_active_id_reads_as_none(store):
    variant = add(store, "2.13.0-cu130")
    store.activate(variant.id)
    shutil.rmtree(variant.path)
    assert store.active() is None
    (store.root / ".active").write_text("precompiled/never-installed\n")
    assert store.active() is None


def test_find_by_id_or_unique_name_and_errors_name_what_exists(store):
    add(store, "2.13.0-cu130")
    add(store, "dup", kind="precompiled")
    add(store, "dup", kind="builds")
    assert store.find("2.13.0-cu130").id == "precompiled/2.13.0-cu130"
    assert store.find("builds/dup").kind == "builds"
    with pytest.raises(UsageError) as ambiguous:
        store.find("dup")
    assert "precompiled/dup, builds/dup" in ambiguous.value.message
    assert "builds/dup" in ambiguous.value.hint or "precompiled/dup" in ambiguous.value.hint
    with pytest.raises(UsageError) as unknown:
        store.find("2.12.0-cu126")
    assert unknown.value.exit_code == 2
    assert unknown.value.message == ("no libtorch variant '2.12.0-cu126'; installed: "
                                     "precompiled/2.13.0-cu130, precompiled/dup, builds/dup")
    with pytest.raises(UsageError, match="installed: none"):
        Store(store.root / "empty").find("x")


def test_remove_refuses_the_active_variant_without_force(store):
    variant = add(store, "2.13.0-cu130")
    store.activate(variant.id)
    with pytest.raises(UsageError) as refused:
        store.remove("2.13.0-cu130")
    assert "--force" in refused.value.hint
    assert variant.path.is_dir() and store.active() == variant


def test_remove_with_force_deletes_and_clears_active(store):
    variant = add(store, "2.13.0-cu130")
    other = add(store, "2.13.0-cu126")
    store.activate(variant.id)
    assert store.remove(variant.id, force=True) == variant
    assert not variant.path.exists()
    assert not (store.root / ".active").exists() and store.active() is None
    assert store.remove("2.13.0-cu126") == other  # not active: no force needed
    assert store.variants() == [] and list((store.root / ".trash").iterdir()) == []


def test_lock_times_out_with_an_fdl_error(store):
    from filelock import FileLock

    add(store, "anything")
    quick = Store(store.root, lock_timeout_s=0.1)
    with FileLock(store.root / ".lock"), pytest.raises(FdlError, match="locked by another"):
        quick.activate("anything")


def test_env_lines_per_shell(store):
    variant = Variant(kind="builds", name="b", path=Path("/s/builds/b"), meta={})
    assert store.env(variant, shell="bash", platform="linux") == (
        "export LIBTORCH=/s/builds/b\n"
        "export LIBTORCH_PATH=/s/builds/b\n"
        'export LD_LIBRARY_PATH=/s/builds/b/lib"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n'
        'export CMAKE_PREFIX_PATH=/s/builds/b"${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"\n')
    assert store.env(variant, shell="zsh", platform="linux") == store.env(variant)
    mac = store.env(variant, shell="bash", platform="darwin")
    assert 'export DYLD_LIBRARY_PATH=/s/builds/b/lib"${DYLD_LIBRARY_PATH:+:$DYLD_LIBRARY_PATH}"' \
        in mac and "LD_LIBRARY_PATH=" not in mac.replace("DYLD_LIBRARY_PATH", "")
    assert store.env(variant, shell="fish", platform="linux").splitlines() == [
        "set -gx LIBTORCH '/s/builds/b'", "set -gx LIBTORCH_PATH '/s/builds/b'",
        "set -gx LD_LIBRARY_PATH '/s/builds/b/lib' $LD_LIBRARY_PATH",
        "set -gx CMAKE_PREFIX_PATH '/s/builds/b' $CMAKE_PREFIX_PATH"]
    windows = store.env(variant, shell="powershell", platform="win32").splitlines()
    assert windows[0] == "$env:LIBTORCH = '/s/builds/b'"
    assert windows[2] == ("$env:PATH = '/s/builds/b/lib' + "
                          "$(if ($env:PATH) { ';' + $env:PATH } else { '' })")
    with pytest.raises(UsageError, match="allowed: bash, zsh, fish, powershell"):
        store.env(variant, shell="tcsh")


@pytest.mark.parametrize("before", [None, "/opt/x/lib"])
def test_bash_exports_work_in_bash_even_with_awkward_paths(store, tmp_path, before):
    path = tmp_path / "it's a $path"
    variant = Variant(kind="builds", name="b", path=path, meta={})
    script = store.env(variant, shell="bash", platform="linux")
    script += 'printf "%s\\n" "$LIBTORCH" "$LD_LIBRARY_PATH" "$CMAKE_PREFIX_PATH"'
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH",
                                                             "CMAKE_PREFIX_PATH")}
    if before:
        env.update(LD_LIBRARY_PATH=before, CMAKE_PREFIX_PATH=before)
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    tail = f":{before}" if before else ""
    assert out == [str(path), f"{path}/lib{tail}", f"{path}{tail}"]


def test_link_python_registers_the_wheel_libtorch_and_remove_keeps_the_wheel(store):
    variant = link_python(store, python=sys.executable)
    assert variant.kind == "python" and variant.name.startswith("torch-2.13.0")
    assert (store.root / "python" / variant.name / "variant.json").is_file()
    lib = variant.path / "lib"
    assert lib.is_symlink() and lib.resolve().is_dir()
    assert any(p.name.startswith("libtorch") and ".so" in p.name for p in lib.iterdir())
    assert (variant.path / "share" / "cmake" / "Torch" / "TorchConfig.cmake").is_file()
    assert (variant.path / "include" / "torch").is_dir()
    meta = variant.meta
    assert meta["source"] == "python" and meta["version"].startswith("2.13.0")
    assert meta["cuda"] is None and meta["archs"] == []  # the +cpu wheel of this venv
    assert Path(meta["wheel_path"]) == lib.resolve().parent
    assert store.variants() == [variant]
    wheel_lib = lib.resolve()
    store.remove(variant.id)
    assert not variant.path.exists() and wheel_lib.is_dir()  # symlinks removed, not followed


def test_link_python_without_torch_is_missing_torch(store, tmp_path):
    no_site = tmp_path / "python-no-site"
    no_site.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_site.chmod(0o755)
    with pytest.raises(MissingTorchError):
        link_python(store, python=str(no_site))
    with pytest.raises(FdlError, match="cannot run"):
        link_python(store, python=str(tmp_path / "no-such-python"))
    assert store.variants() == []


ACTIVATE_LOOP = """
import sys
from pathlib import Path
from fdl.libtorch.store import Store
store = Store(Path(sys.argv[1]))
for _ in range(int(sys.argv[3])):
    store.activate(sys.argv[2])
"""


def test_concurrent_activations_leave_a_valid_active_file(store):
    ids = {add(store, "a").id, add(store, "b", kind="builds").id}
    seen = set()
    with contextlib.ExitStack() as running:
        children = [running.enter_context(started(
            [sys.executable, "-c", ACTIVATE_LOOP, str(store.root), name, "150"]))
            for name in sorted(ids)]
        deadline = time.monotonic() + GUARD_S  # a guard against a hung child, not a measure
        while any(child.poll() is None for child in children) and time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                seen.add((store.root / ".active").read_text())
            time.sleep(0.001)
        assert [child.wait(timeout=GUARD_S) for child in children] == [0, 0]
    assert seen <= {f"{i}\n" for i in ids}  # every read saw a whole line naming a variant
    assert store.active().id in ids
    leftovers = [p.name for p in store.root.iterdir() if p.name.startswith(".active.")]
    assert leftovers == []
