"""fdl.files, the one implementation of each file primitive, on real files: atomic writes that
leave the old file when they fail (a value JSON cannot hold, a full disk in a subprocess under
RLIMIT_FSIZE, an exception inside the block), JSON-lines appends that survive a killed writer
and a torn last line, and file hashing against hashlib."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from fdl.files import (
    JsonlAppender,
    atomic_replace,
    hash_file,
    read_jsonl,
    scan_jsonl,
    sha256_file,
    write_atomic,
    write_json_atomic,
)

GUARD_S = 60  # a deadline that only stops a hung test; nothing is timed against it
OLD = '{"old": true}\n'


def _only(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- atomic writes ---------------------------------------------------------------------------

def test_write_json_atomic_writes_indented_json_and_stringifies_the_rest(tmp_path):
    path = tmp_path / "summary.json"
    assert write_json_atomic(path, {"run_dir": tmp_path, "n": 1}) == path
    assert path.read_text() == json.dumps({"run_dir": str(tmp_path), "n": 1}, indent=2) + "\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert _only(tmp_path) == ["summary.json"]


@pytest.mark.parametrize("document", [{("tuple", "key"): 1}, "cycle"])
def test_a_document_json_cannot_hold_leaves_the_old_file(tmp_path, document):
    if document == "cycle":
        document = {}
        document["self"] = document
    path = tmp_path / "config.json"
    path.write_text(OLD)
    with pytest.raises((TypeError, ValueError)):
        write_json_atomic(path, document)
    assert path.read_text() == OLD
    assert _only(tmp_path) == ["config.json"]


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(OLD)
    script = textwrap.dedent(f"""
        import errno, resource, sys
        from pathlib import Path
        from fdl.files import write_atomic
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))  # python ignores SIGXFSZ
        try:
            write_atomic(Path({str(path)!r}), b"x" * (1 << 20))
        except OSError as exc:
            sys.exit(7 if exc.errno == errno.EFBIG else 1)
        sys.exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=GUARD_S)
    assert proc.returncode == 7, proc.stderr  # the write did fail, with "file too large"
    assert path.read_text() == OLD
    assert _only(tmp_path) == ["report.json"]


def test_atomic_replace_renames_only_a_block_that_finishes(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"old model")
    with pytest.raises(RuntimeError), atomic_replace(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.pt.")
        tmp.write_bytes(b"half a mod")
        raise RuntimeError("killed mid-save")
    assert path.read_bytes() == b"old model" and _only(tmp_path) == ["model.pt"]

    with atomic_replace(path) as tmp:
        tmp.write_bytes(b"new model")
        assert path.read_bytes() == b"old model"  # nothing visible before the block ends
    assert path.read_bytes() == b"new model" and _only(tmp_path) == ["model.pt"]


def test_write_atomic_durable_replaces_the_file(tmp_path):
    path = tmp_path / "variant.json"
    path.write_text(OLD)
    write_atomic(path, "new\n", durable=True)
    assert path.read_text() == "new\n" and _only(tmp_path) == ["variant.json"]


# --- JSON lines ------------------------------------------------------------------------------

def test_reading_skips_a_torn_last_line_and_says_which(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1}\n\n[1, 2]\n{"epoch": 2}\n{"epoch": 3, "lo')
    found = scan_jsonl(path)
    assert found.records == [{"epoch": 1}, {"epoch": 2}]
    assert found.line_numbers == [1, 4] and found.bad_lines == [3, 5]
    assert read_jsonl(path) == [{"epoch": 1}, {"epoch": 2}]
    assert read_jsonl(tmp_path / "absent.jsonl") == [] and scan_jsonl(
        tmp_path / "absent.jsonl").error == "missing"


def test_an_append_after_a_torn_line_starts_a_fresh_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"cell": 1}\n{"cell": 2, "wal')
    with JsonlAppender(path, durable=True) as appender:
        appender.append({"cell": 3})
        appender.append({"cell": 4})
    assert read_jsonl(path) == [{"cell": 1}, {"cell": 3}, {"cell": 4}]
    assert scan_jsonl(path).bad_lines == [2]


def test_durable_appends_acknowledged_before_a_kill_are_all_in_the_file(tmp_path):
    """A writer killed (SIGKILL) after saying it appended k records leaves those k whole: each
    record is one unbuffered write (fsync'd too, which only a power cut could tell apart)."""
    path = tmp_path / "results.jsonl"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from fdl.files import JsonlAppender
        appender = JsonlAppender(Path({str(path)!r}), durable=True)
        for i in range(1000000):
            appender.append({{"cell": i, "pad": "x" * 500}})
            print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        acknowledged = [int(proc.stdout.readline()) for _ in range(50)]
    finally:
        proc.kill()
        proc.wait(timeout=GUARD_S)
        proc.stdout.close()
    cells = [r["cell"] for r in read_jsonl(path)]
    assert cells[:len(acknowledged)] == acknowledged  # every acknowledged record, in order
    assert cells == list(range(len(cells)))  # and nothing torn or out of order after them
    assert scan_jsonl(path).bad_lines == []


# --- hashing ---------------------------------------------------------------------------------

def test_sha256_file_matches_hashlib_across_chunks(tmp_path):
    data = os.urandom(3 * (1 << 20) + 12345)  # not a multiple of the read size
    path = tmp_path / "archive.zip"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_hash_file_feeds_every_algorithm_and_can_be_continued(tmp_path):
    head, tail = os.urandom(70000), os.urandom(5000)
    path = tmp_path / "part"
    path.write_bytes(head)
    hashers = hash_file(path, algorithms=("md5", "sha256"), chunk_size=4096)
    for hasher in hashers.values():  # a resumed download goes on with the bytes that arrive
        hasher.update(tail)
    assert hashers["md5"].hexdigest() == hashlib.md5(head + tail).hexdigest()
    assert hashers["sha256"].hexdigest() == hashlib.sha256(head + tail).hexdigest()
    with pytest.raises(ValueError):
        hash_file(path, algorithms=("no-such-hash",))
