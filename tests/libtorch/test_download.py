"""fdl.download against a real HTTP server on 127.0.0.1 that misbehaves on request.

The faults users meet (a cut connection, a wrong sha256, Ctrl-C, plain http) are in
tests/faults/test_download_faults.py."""

from __future__ import annotations

import hashlib
import random

import pytest

from fdl.download import download, sha256_file
from fdl.errors import FdlError

DATA = random.Random(0).randbytes(3 * (1 << 20) + 12345)  # not a multiple of any chunk size
DIGEST = hashlib.sha256(DATA).hexdigest()
FAST = {"backoff_s": 0.01, "chunk_size": 1 << 16, "allow_http": True}  # 127.0.0.1: opted in


@pytest.fixture
def served(http_server):
    http_server.files["libtorch.zip"] = DATA
    return http_server


def _part(dest):
    return dest.with_name(dest.name + ".part")


def test_plain_download_hashes_and_reports_progress(served, tmp_path):
    calls = []
    dest = tmp_path / "store" / "libtorch.zip"
    result = download(served.url("libtorch.zip"), dest, expected_sha256=DIGEST,
                      progress=lambda done, total: calls.append((done, total)), **FAST)
    assert (result.path, result.sha256, result.size, result.resumed) == (
        dest, DIGEST, len(DATA), False)
    assert dest.read_bytes() == DATA
    assert not _part(dest).exists()
    assert len(calls) > 10
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == len(DATA)
    assert {t for _, t in calls} == {len(DATA)}
    assert served.requests == [{"path": "/libtorch.zip", "range": None}]


def test_server_ignoring_range_restarts_from_zero(served, tmp_path):
    served.ignore_range = True
    dest = tmp_path / "libtorch.zip"
    _part(dest).write_bytes(b"stale bytes from another file")
    result = download(served.url("libtorch.zip"), dest, expected_sha256=DIGEST, **FAST)
    assert result.resumed is False
    assert dest.read_bytes() == DATA
    assert served.requests[0]["range"] == "bytes=29-"


@pytest.mark.parametrize("status", [404, 403])
def test_client_errors_fail_at_once(served, tmp_path, status):
    served.default = served.Act(status=status)
    url = served.url("libtorch.zip")
    with pytest.raises(FdlError) as err:
        download(url, tmp_path / "libtorch.zip", **FAST)
    assert err.value.message == f"download failed: HTTP {status} for {url}"
    assert "--url" in err.value.hint and "FDL_LIBTORCH_MIRROR" in err.value.hint
    assert len(served.requests) == 1
    assert not (tmp_path / "libtorch.zip").exists()


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_statuses_are_retried(served, tmp_path, status):
    served.script.extend([served.Act(status=status), served.Act(status=status)])
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip",
                      expected_sha256=DIGEST, **FAST)
    assert result.path.read_bytes() == DATA
    assert len(served.requests) == 3


def test_read_timeout_is_retried(served, tmp_path):
    served.script.append(served.Act(delay_s=1.0))
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", timeout_s=0.2,
                      expected_sha256=DIGEST, **FAST)
    assert result.sha256 == DIGEST and len(served.requests) == 2


def test_retries_exhausted_keeps_the_part_for_a_later_run(served, tmp_path):
    served.script.append(served.Act(cut_after=1 << 20))
    served.default = served.Act(status=500)
    dest = tmp_path / "libtorch.zip"
    with pytest.raises(FdlError) as err:
        download(served.url("libtorch.zip"), dest, retries=2, **FAST)
    assert err.value.message.startswith("download failed after 3 attempts: HTTP 500")
    assert "resume" in err.value.hint
    assert len(served.requests) == 3
    assert not dest.exists() and _part(dest).read_bytes() == DATA[:1 << 20]

    served.default = served.Act()  # the server recovers: the next run continues the .part
    result = download(served.url("libtorch.zip"), dest, expected_sha256=DIGEST, **FAST)
    assert result.resumed is True and dest.read_bytes() == DATA


def test_file_url_is_copied_with_hash_and_progress(tmp_path):
    source = tmp_path / "mirror" / "libtorch.zip"
    source.parent.mkdir()
    source.write_bytes(DATA)
    calls = []
    result = download(source.as_uri(), tmp_path / "out.zip", expected_sha256=DIGEST.upper(),
                      progress=lambda done, total: calls.append((done, total)), **FAST)
    assert result.path.read_bytes() == DATA and result.sha256 == DIGEST
    assert calls[-1] == (len(DATA), len(DATA))


def test_file_url_that_does_not_exist(tmp_path):
    with pytest.raises(FdlError) as err:
        download((tmp_path / "missing.zip").as_uri(), tmp_path / "out.zip")
    assert "missing.zip" in err.value.message
    assert not (tmp_path / "out.zip").exists()


def test_sha256_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(DATA)
    assert sha256_file(path) == DIGEST
