"""Parallel ranged downloads (fdl.download.ranged, fdl.download.ranges) against a real HTTP
server on 127.0.0.1 (``http_server`` in tests/conftest.py) serving files built here, with the
parallel threshold lowered so that a few MiB go over several connections.

Covered: the assembled file and its sha256, a server without ranges and one that offers them
and then ignores them, resuming only the missing ranges after a cut and after SIGINT to a real
process, a file that changes on the server, a sidecar that cannot be trusted, the connections
setting, and the adaptive default: one connection that streams on through the pieces, more
opened while a connection waits on the network (a first answer held by the server), none while
they keep their CPU busy (the rule, on given figures: a CPU-bound transfer on loopback is not
something a test can hold steady)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import GUARD_S, started, wait_until

from fdl.download.client import http_client
from fdl.download.fetch import download, num_connections
from fdl.download.ranged import RangedFetch, more_connections
from fdl.download.ranges import load_state, plan_state, state_path
from fdl.errors import FdlError, UsageError

DATA = random.Random(1).randbytes(3 * (1 << 20) + 4321)  # not a multiple of any piece
DIGEST = hashlib.sha256(DATA).hexdigest()
OTHER = random.Random(2).randbytes(len(DATA))  # the same file, another version
PARALLEL = {"backoff_s": 0.01, "chunk_size": 1 << 16, "allow_http": True, "connections": 3,
            "parallel_min_bytes": 1 << 20}  # pieces of 128 KiB or more: 12 of them here


@pytest.fixture
def served(http_server):
    http_server.files["libtorch.zip"] = DATA
    return http_server


def _part(dest):
    return dest.with_name(dest.name + ".part")


def _ranged(server) -> list[str]:
    return [r["range"] for r in server.requests if r["range"] is not None]


def test_parallel_download_assembles_the_file_and_its_sha256(served, tmp_path):
    calls = []
    dest = tmp_path / "libtorch.zip"
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST,
                      progress=lambda done, total: calls.append((done, total)), **PARALLEL)
    assert (result.sha256, result.size, result.resumed) == (DIGEST, len(DATA), False)
    assert dest.read_bytes() == DATA
    assert not _part(dest).exists() and not state_path(_part(dest)).exists()
    assert served.requests[0]["range"] is None  # the first answer serves the first piece
    ranges = _ranged(served)
    assert len(ranges) == 11 and all(r.startswith("bytes=") for r in ranges)
    first_piece = -(-len(DATA) // 12)  # 12 pieces of equal size, the last one shorter
    assert sum(sent for status, sent in served.sent if status == 206) == len(DATA) - first_piece
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == len(DATA)
    assert {t for _, t in calls} == {len(DATA)}


def test_a_server_without_ranges_gets_one_stream(served, tmp_path):
    served.ignore_range = True
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", expected=DIGEST,
                      **PARALLEL)
    assert result.path.read_bytes() == DATA
    assert served.requests == [{"path": "/libtorch.zip", "range": None}]


def test_a_server_that_offers_ranges_and_ignores_them_falls_back_to_one_stream(served,
                                                                              tmp_path):
    served.ignore_range = served.claim_ranges = True
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", expected=DIGEST,
                      **PARALLEL)
    assert result.path.read_bytes() == DATA and result.sha256 == DIGEST
    assert served.requests[-1]["range"] is None  # the whole file, once more, in one stream
    assert not state_path(_part(result.path)).exists()


def test_one_connection_is_one_stream(served, tmp_path, monkeypatch):
    monkeypatch.setenv("FDL_DOWNLOAD_CONNECTIONS", "1")
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", expected=DIGEST,
                      **{**PARALLEL, "connections": None})
    assert result.path.read_bytes() == DATA
    assert served.requests == [{"path": "/libtorch.zip", "range": None}]


@pytest.mark.parametrize("value", ["0", "many", "65"])
def test_connections_outside_1_to_64_are_refused(monkeypatch, value):
    monkeypatch.setenv("FDL_DOWNLOAD_CONNECTIONS", value)
    with pytest.raises(UsageError) as err:
        num_connections()
    assert err.value.message.startswith(f"FDL_DOWNLOAD_CONNECTIONS={value!r}: expected a whole")
    assert num_connections(7) == 7


def test_a_cut_range_resumes_only_the_missing_ranges(served, tmp_path):
    served.script.extend([served.Act(), served.Act(cut_after=10_000)])  # the second request
    dest = tmp_path / "libtorch.zip"
    with pytest.raises(FdlError) as err:
        download(served.url("libtorch.zip"), dest, expected=DIGEST, **{**PARALLEL, "retries": 0})
    assert "received 10000 bytes" in err.value.message  # the cut, as httpx saw it
    state = load_state(_part(dest))
    assert state is not None and 0 < state.done_bytes < len(DATA)
    missing = [(p.start + p.done, p.end) for p in state.pieces if not p.complete]
    assert len(missing) == 1  # the other connections went on with the other pieces

    served.requests.clear()
    served.sent.clear()
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **PARALLEL)
    assert result.resumed is True and dest.read_bytes() == DATA
    assert _ranged(served) == [f"bytes={a}-{b - 1}" for a, b in missing]
    assert sum(sent for _, sent in served.sent) == len(DATA) - state.done_bytes
    assert not state_path(_part(dest)).exists()


@pytest.mark.parametrize("digest", [DIGEST, None])
def test_a_record_from_another_url_is_resumed_only_when_a_digest_checks_the_whole(
        served, tmp_path, digest):
    served.files["mirror.zip"] = DATA
    served.script.extend([served.Act(), served.Act(cut_after=10_000)])
    dest = tmp_path / "libtorch.zip"
    with pytest.raises(FdlError):
        download(served.url("libtorch.zip"), dest, expected=digest, **{**PARALLEL, "retries": 0})
    state = load_state(_part(dest))
    assert state is not None and 0 < state.done_bytes < len(DATA)

    served.requests.clear()
    served.sent.clear()
    result = download(served.url("mirror.zip"), dest, expected=digest, **PARALLEL)
    assert dest.read_bytes() == DATA
    if digest is None:  # two servers' bytes in one file could go unnoticed: start over
        assert result.resumed is False and served.requests[0]["range"] is None
        assert served.statuses[0] == 200  # the whole file asked for again, from byte 0
    else:  # the digest checks the assembled file: the other mirror's pieces are kept
        assert result.resumed is True
        assert sum(sent for _, sent in served.sent) == len(DATA) - state.done_bytes


def test_sigint_keeps_the_part_and_its_record_and_the_rerun_resumes(served, tmp_path):
    hold = served.Act(pause_after=1 << 16)  # one range stalls: the download cannot finish
    served.script.extend([served.Act(), hold])
    dest = tmp_path / "libtorch.zip"
    script = textwrap.dedent(f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from pathlib import Path
        from fdl.download.fetch import download
        download({served.url("libtorch.zip")!r}, Path({str(dest)!r}), **{PARALLEL!r})
    """)
    with started([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        try:
            wait_until(lambda: (s := load_state(_part(dest))) is not None and s.done_bytes > 0,
                       "the record to count written bytes", proc=proc)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=GUARD_S)
        finally:
            hold.release.set()
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr
    state = load_state(_part(dest))
    assert state is not None and 0 < state.done_bytes < len(DATA)

    served.requests.clear()
    served.sent.clear()
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **PARALLEL)
    assert result.resumed is True and dest.read_bytes() == DATA
    assert served.requests and all(r["range"] for r in served.requests)  # no whole file again
    assert sum(sent for _, sent in served.sent) == len(DATA) - state.done_bytes


def _open_fds_on(path) -> list[str]:
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) == str(path):
                found.append(fd.name)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_ctrl_c_in_a_long_lived_process_leaves_no_fd_once_the_workers_are_through(
        served, tmp_path):
    hold = served.Act(pause_after=1 << 16)  # one range stalls until released
    served.script.extend([served.Act(), hold])
    dest = tmp_path / "libtorch.zip"

    def interrupt(done: int, total: int | None) -> None:
        if done > 0:  # Ctrl-C as the main thread sees it, while a worker is mid-range
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download(served.url("libtorch.zip"), dest, progress=interrupt, **PARALLEL)
    hold.release.set()  # the stalled worker gets its bytes, writes them and is through
    wait_until(lambda: not _open_fds_on(_part(dest)), "the .part's fd to be closed")
    state = load_state(_part(dest))
    assert state is not None and 0 < state.done_bytes < len(DATA)
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **PARALLEL)
    assert result.resumed is True and dest.read_bytes() == DATA


def test_a_file_changed_on_the_server_is_fetched_again_whole(served, tmp_path):
    def swap(number: int) -> None:
        if number == 2:  # mid-download: some ranges are of the old version already
            served.files["libtorch.zip"] = OTHER

    served.on_request = swap
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", **PARALLEL)
    assert result.path.read_bytes() == OTHER
    assert result.sha256 == hashlib.sha256(OTHER).hexdigest()
    # two whole-file answers to the two first requests, and at least one to a failed If-Range
    assert served.statuses.count(200) >= 3
    assert sum(1 for r in served.requests if r["range"] is None) == 2  # a fresh start


def test_one_connection_resumed_after_the_file_changed_is_not_a_mix(served, tmp_path):
    served.script.append(served.Act(cut_after=100_000))
    dest = tmp_path / "libtorch.zip"
    one = {**PARALLEL, "connections": 1}
    with pytest.raises(FdlError):  # no expected digest: nothing at the end would catch a mix
        download(served.url("libtorch.zip"), dest, **{**one, "retries": 0})
    state = load_state(_part(dest))
    assert state is not None and state.done_bytes == 100_000 and state.etag
    served.files["libtorch.zip"] = OTHER  # republished under the same name (a nightly)
    served.requests.clear()
    result = download(served.url("libtorch.zip"), dest, **one)
    assert dest.read_bytes() == OTHER and result.resumed is False
    assert served.requests[0]["range"].startswith("bytes=100000-")  # with If-Range
    assert served.requests[-1]["range"] is None  # and started over on the new version


def test_a_file_that_keeps_changing_fails_and_keeps_nothing(served, tmp_path):
    def swap(number: int) -> None:
        served.files["libtorch.zip"] = random.Random(number).randbytes(len(DATA))

    served.on_request = swap
    dest = tmp_path / "libtorch.zip"
    with pytest.raises(FdlError) as err:
        download(served.url("libtorch.zip"), dest, **{**PARALLEL, "retries": 2})
    assert "the file changed on the server during the download" in err.value.message
    assert "after 3 attempts" in err.value.message
    assert not dest.exists() and not state_path(_part(dest)).exists()


HOSTILE = {
    "garbage": "{not json",
    "torn": json.dumps({"version": 1, "url": "x", "size": len(DATA)})[:30],
    "a list": "[1, 2, 3]",
    "out of bounds": {"pieces": [[0, len(DATA) + 10, 5]]},
    "overlapping": {"pieces": [[0, 200, 200], [100, len(DATA), 0]]},
    "a gap": {"pieces": [[0, 100, 100], [200, len(DATA), 0]]},
    "done past the end": {"pieces": [[0, 100, 101], [100, len(DATA), 0]]},
    "strings": {"pieces": [["0", str(len(DATA)), "0"]]},
    "another size": {"size": len(DATA) + 1, "pieces": [[0, len(DATA) + 1, 0]]},
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_sidecar_that_cannot_be_trusted_is_ignored(served, tmp_path, name):
    dest = tmp_path / "libtorch.zip"
    _part(dest).write_bytes(b"\xff" * len(DATA))  # junk where the record claims data
    hostile = HOSTILE[name]
    if isinstance(hostile, dict):
        hostile = json.dumps({"version": 1, "url": served.url("libtorch.zip"),
                              "size": len(DATA), "etag": None, "last_modified": None,
                              **hostile})
    state_path(_part(dest)).write_text(hostile)
    assert load_state(_part(dest)) is None
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **PARALLEL)
    assert result.path.read_bytes() == DATA and result.resumed is False
    assert served.requests[0]["range"] is None  # from the start: nothing on disk was trusted
    assert not state_path(_part(dest)).exists()


def test_the_first_answer_alone_streams_through_every_piece(served, tmp_path):
    part = tmp_path / "libtorch.zip.part"
    state = plan_state(url=served.url("libtorch.zip"), size=len(DATA), etag=None,
                       last_modified=None, num_connections=4, min_piece_bytes=1 << 17)
    assert len(state.pieces) == 16
    part.write_bytes(b"\0" * len(DATA))
    fetch = RangedFetch(None, part, state, algorithms=("sha256",), num_connections=1,
                        batch_bytes=1 << 16, progress=None)
    with http_client(allow_http=True, timeout_s=30) as client, \
            client.stream("GET", served.url("libtorch.zip")) as first:
        fetch.client = client
        fetch.run(first)
    assert part.read_bytes() == DATA and fetch.hashers["sha256"].hexdigest() == DIGEST
    assert served.requests == [{"path": "/libtorch.zip", "range": None}]  # one request
    assert all(piece.complete for piece in state.pieces) and fetch.most_connections == 1


def test_the_default_opens_more_connections_while_one_waits_on_the_network(
        served, tmp_path, monkeypatch):
    monkeypatch.delenv("FDL_DOWNLOAD_CONNECTIONS", raising=False)
    held = served.Act(pause_after=10_000)  # the first answer: 10 kB, then nothing until released
    served.script.append(held)
    dest = tmp_path / "libtorch.zip"
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(download(
        served.url("libtorch.zip"), dest, expected=DIGEST, **{**PARALLEL, "connections": None})))
    worker.start()
    try:  # the only connection is waiting for bytes, not using its CPU: another must open
        wait_until(lambda: any(r["range"] for r in served.requests),
                   "a second connection to ask for a range")
    finally:
        held.release.set()
        worker.join(timeout=GUARD_S)
    (result,) = results
    assert result.connections >= 2 and dest.read_bytes() == DATA and result.sha256 == DIGEST
    assert served.requests[0]["range"] is None
    # the first answer served its piece and stopped there: the 15 others came in ranges
    first_piece = -(-len(DATA) // 16)
    assert len(_ranged(served)) == 15
    assert sum(sent for status, sent in served.sent if status == 206) == len(DATA) - first_piece


@pytest.mark.parametrize(("running", "busy", "pieces_left", "opened"), [
    (1, [0.05], 15, 1),  # a capped link: double
    (2, [0.1, 0.2], 13, 2),
    (4, [0.1] * 4, 9, 0),  # at the most already
    (3, [0.1] * 3, 9, 1),  # up to the most, not past it
    (2, [0.1, 0.1], 1, 1),  # no more than the pieces nobody has taken
    (1, [0.8], 15, 0),  # one connection keeps a core busy: a fast mirror, stay at one
    (2, [0.1, 0.6], 13, 0),  # any busy one holds the rest back
    (1, [], 15, 0),  # nothing measured yet
])
def test_more_connections_only_while_every_open_one_waits(running, busy, pieces_left, opened):
    assert more_connections(running=running, maximum=4, pieces_left=pieces_left,
                            busy=busy) == opened
