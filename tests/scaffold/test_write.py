"""All or nothing on disk: a new folder, an empty one, --force, and failures that leave no trace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fdl.errors import FdlError, UsageError
from fdl.scaffold import write as write_module
from fdl.scaffold.write import write_project

FILES = {"train.py": "print('hi')\n", "tests/test_train.py": "def test(): pass\n",
         "Makefile": "train:\n\tpython train.py\n"}


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` -> its text ("/" for folders)."""
    return {str(path.relative_to(root)): "/" if path.is_dir() else path.read_text()
            for path in sorted(root.rglob("*"))}


def test_a_new_folder_gets_every_file_and_no_staging_is_left(tmp_path):
    result = write_project(tmp_path / "demo", FILES, force=False)
    assert result.replaced == ()
    assert tree(tmp_path) == {"demo": "/", "demo/Makefile": FILES["Makefile"],
                              "demo/tests": "/", "demo/tests/test_train.py": "def test(): pass\n",
                              "demo/train.py": "print('hi')\n"}


def test_the_new_folder_has_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_project(tmp_path / "demo", FILES, force=False)
    finally:
        os.umask(umask)
    assert (tmp_path / "demo").stat().st_mode & 0o777 == 0o755


def test_missing_parent_folders_are_created(tmp_path):
    write_project(tmp_path / "a" / "b" / "demo", FILES, force=False)
    assert (tmp_path / "a" / "b" / "demo" / "train.py").is_file()


def test_an_empty_folder_is_filled(tmp_path):
    (tmp_path / "demo").mkdir()
    write_project(tmp_path / "demo", FILES, force=False)
    assert set(tree(tmp_path / "demo")) == {"Makefile", "tests", "tests/test_train.py", "train.py"}


def test_a_non_empty_folder_needs_force(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists and is not empty") as info:
        write_project(tmp_path / "demo", FILES, force=False)
    assert "--force" in info.value.hint
    assert tree(tmp_path) == {"demo": "/", "demo/notes.txt": "mine"}


def test_force_replaces_the_templates_files_and_keeps_the_others(tmp_path):
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "notes.txt").write_text("mine")
    (demo / "train.py").write_text("old")
    result = write_project(demo, FILES, force=True)
    assert result.replaced == ("train.py",)
    assert (demo / "train.py").read_text() == "print('hi')\n"
    assert (demo / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_a_path_under_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        write_project(tmp_path / "file" / "sub" / "demo", FILES, force=False)
    with pytest.raises(UsageError, match="is a file, not a folder"):
        write_project(tmp_path / "file", FILES, force=True)
    assert tree(tmp_path) == {"file": "x"}


def test_a_failing_write_leaves_nothing_behind(tmp_path, monkeypatch):
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == "Makefile":
            raise OSError(28, "No space left on device", str(self))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(FdlError, match="No space left on device") as info:
        write_project(tmp_path / "new" / "demo", FILES, force=False)
    assert info.value.exit_code == 1 and "nothing was written" in info.value.hint
    assert f"({tmp_path / 'new' / 'demo' / 'Makefile'})" in info.value.message  # not staging
    assert tree(tmp_path) == {}


def test_a_failing_move_under_force_puts_the_old_files_back(tmp_path, monkeypatch):
    demo = tmp_path / "demo"
    (demo / "tests").mkdir(parents=True)
    (demo / "train.py").write_text("old train")
    (demo / "tests" / "test_train.py").write_text("old test")
    before = tree(tmp_path)
    real = os.rename

    def rename(src, dst):
        if Path(dst).name == "Makefile" and "fdl-init" in str(src):
            raise OSError(13, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(write_module.os, "rename", rename)
    with pytest.raises(FdlError, match="Permission denied"):
        write_project(demo, FILES, force=True)
    assert tree(tmp_path) == before


def test_a_folder_in_the_way_of_a_file_is_never_replaced(tmp_path):
    demo = tmp_path / "demo"
    (demo / "Makefile").mkdir(parents=True)
    (demo / "Makefile" / "keep.txt").write_text("keep")
    with pytest.raises(FdlError, match="a folder is in the way"):
        write_project(demo, FILES, force=True)
    assert tree(tmp_path) == {"demo": "/", "demo/Makefile": "/",
                              "demo/Makefile/keep.txt": "keep"}


def test_bytes_are_written_as_they_are(tmp_path):
    data = bytes(range(256)) + b"\r\n"  # a wheel: no encoding, no newline translation
    write_project(tmp_path / "demo", {**FILES, "wheels/x.whl": data}, force=False)
    assert (tmp_path / "demo" / "wheels" / "x.whl").read_bytes() == data
