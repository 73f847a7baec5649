"""All or nothing on disk: a new folder, an empty one, --force, and failures that leave no trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import GUARD_S, clean_env

from fdl.errors import FdlError, UsageError
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


def test_a_full_disk_leaves_nothing_behind(tmp_path):
    """A real full disk: write_project in a child whose file-size limit (RLIMIT_FSIZE) is
    64 KiB, with a Makefile of 128 KiB, the last file staged (EFBIG, as a full disk fails a
    write)."""
    script = textwrap.dedent(f"""
        import json, resource, signal, sys
        from pathlib import Path
        from fdl.errors import FdlError
        from fdl.scaffold.write import write_project
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            files = {{**{FILES!r}, "Makefile": "#" * (1 << 17) + "\\n"}}
            write_project(Path({str(tmp_path / "new" / "demo")!r}), files, force=False)
        except FdlError as exc:
            print(json.dumps([exc.message, exc.hint, exc.exit_code]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=GUARD_S, env=clean_env())
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    message, hint, exit_code = json.loads(proc.stdout)
    assert exit_code == 1 and "nothing was written" in hint
    # A failed write() carries no file name (the patched Path.write_text this test once used
    # gave one): the message names the target and the reason, never the staging folder.
    assert message == f"cannot write the project at {tmp_path / 'new' / 'demo'}: File too large"
    assert tree(tmp_path) == {}


def test_a_failure_half_way_under_force_puts_the_old_files_back(tmp_path):
    """A real failure after the template's files have moved in: the project's last file needs
    a folder where the target has a file (mkdir fails), so every file moved in, and every old
    one kept aside, must be put back."""
    demo = tmp_path / "demo"
    (demo / "tests").mkdir(parents=True)
    (demo / "train.py").write_text("old train")
    (demo / "tests" / "test_train.py").write_text("old test")
    (demo / "docs").write_text("a file where the project has a folder")
    before = tree(tmp_path)
    with pytest.raises(FdlError, match="cannot write the project") as info:
        write_project(demo, {**FILES, "docs/guide.md": "# guide\n"}, force=True)
    assert "nothing was written" in info.value.hint
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
