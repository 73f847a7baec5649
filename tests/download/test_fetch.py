"""fdl.download.fetch against a real HTTP server on 127.0.0.1 that misbehaves on request.

The faults users meet (a cut connection, a wrong sha256, Ctrl-C, plain http) are in
tests/faults/test_download_faults.py."""

from __future__ import annotations

import hashlib
import random

import pytest

from fdl.download.fetch import MinRate, download
from fdl.errors import FdlError, UsageError

DATA = random.Random(0).randbytes(3 * (1 << 20) + 12345)  # not a multiple of any chunk size
DIGEST = hashlib.sha256(DATA).hexdigest()
FAST = {"backoff_s": 0.01, "chunk_size": 1 << 16, "allow_http": True}  # 127.0.0.1: opted in
READ_BYTES = 1 << 20  # no read of a body returns more (httpx asks the socket for 64 KiB)


@pytest.fixture
def served(http_server):
    http_server.files["libtorch.zip"] = DATA
    return http_server


def _part(dest):
    return dest.with_name(dest.name + ".part")


def test_plain_download_hashes_and_reports_progress(served, tmp_path):
    calls = []
    dest = tmp_path / "store" / "libtorch.zip"
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST,
                      progress=lambda done, total: calls.append((done, total)), **FAST)
    assert (result.path, result.sha256, result.size, result.resumed) == (
        dest, DIGEST, len(DATA), False)
    assert dest.read_bytes() == DATA
    assert not _part(dest).exists()
    # a report for each batch: at most one read (READ_BYTES) past chunk_size bytes
    assert len(calls) >= len(DATA) // (READ_BYTES + FAST["chunk_size"]) + 1
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == len(DATA)
    assert {t for _, t in calls} == {len(DATA)}
    assert served.requests == [{"path": "/libtorch.zip", "range": None}]


def test_server_ignoring_range_restarts_from_zero(served, tmp_path):
    served.ignore_range = True
    dest = tmp_path / "libtorch.zip"
    _part(dest).write_bytes(b"stale bytes from another file")
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **FAST)
    assert result.resumed is False
    assert dest.read_bytes() == DATA
    assert served.requests[0]["range"] == "bytes=29-"


@pytest.mark.parametrize("status", [404, 403])
def test_client_errors_fail_at_once(served, tmp_path, status):
    served.default = served.Act(status=status)
    url = served.url("libtorch.zip")
    with pytest.raises(FdlError) as err:
        download(url, tmp_path / "libtorch.zip", source_hint="try the mirror", **FAST)
    assert err.value.message == f"download failed: HTTP {status} for {url}"
    assert err.value.hint == "try the mirror"
    assert len(served.requests) == 1
    assert not (tmp_path / "libtorch.zip").exists()


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_statuses_are_retried(served, tmp_path, status):
    served.script.extend([served.Act(status=status), served.Act(status=status)])
    result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip",
                      expected=DIGEST, **FAST)
    assert result.path.read_bytes() == DATA
    assert len(served.requests) == 3


def test_read_timeout_is_retried(served, tmp_path):
    """The first answer sends its headers and then nothing until the download has returned: a
    stall longer than any timeout, however loaded the machine, that the client must give up on
    and retry. (A later attempt slowed past the timeout by a busy machine is retried too, so
    the test asks for at least one retry, not exactly one.)"""
    stall = served.Act(pause_after=0)
    served.script.append(stall)
    try:
        result = download(served.url("libtorch.zip"), tmp_path / "libtorch.zip",
                          timeout_s=0.2, expected=DIGEST, **FAST)
    finally:
        stall.release.set()
    assert result.sha256 == DIGEST and result.path.read_bytes() == DATA
    assert len(served.requests) >= 2 and served.requests[0]["range"] is None


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
    result = download(served.url("libtorch.zip"), dest, expected=DIGEST, **FAST)
    assert result.resumed is True and dest.read_bytes() == DATA


def test_file_url_is_copied_with_hash_and_progress(tmp_path):
    source = tmp_path / "mirror" / "libtorch.zip"
    source.parent.mkdir()
    source.write_bytes(DATA)
    calls = []
    result = download(source.as_uri(), tmp_path / "out.zip", expected=DIGEST.upper(),
                      progress=lambda done, total: calls.append((done, total)), **FAST)
    assert result.path.read_bytes() == DATA and result.sha256 == DIGEST
    assert calls[-1] == (len(DATA), len(DATA))


def test_file_url_that_does_not_exist(tmp_path):
    with pytest.raises(FdlError) as err:
        download((tmp_path / "missing.zip").as_uri(), tmp_path / "out.zip")
    assert "missing.zip" in err.value.message
    assert not (tmp_path / "out.zip").exists()


# --- several URLs (mirrors), other digest algorithms ----------------------------------------

MD5 = hashlib.md5(DATA).hexdigest()


def test_mirrors_are_tried_in_order_and_a_cut_is_resumed_from_the_next(served, tmp_path):
    served.files["cut/libtorch.zip"] = DATA
    served.script.extend([served.Act(status=404), served.Act(cut_after=1 << 20)])
    urls = [served.url("gone/libtorch.zip"), served.url("cut/libtorch.zip"),
            served.url("libtorch.zip")]
    result = download(urls, tmp_path / "data.bin", expected=MD5, algorithm="md5", **FAST)
    assert (result.sha256, result.resumed) == (DIGEST, True)  # sha256 whatever is verified
    assert (tmp_path / "data.bin").read_bytes() == DATA
    assert served.requests == [{"path": "/gone/libtorch.zip", "range": None},
                               {"path": "/cut/libtorch.zip", "range": None},
                               {"path": "/libtorch.zip", "range": f"bytes={1 << 20}-"}]


def test_a_transient_round_is_retried_after_every_url_failed(served, tmp_path):
    served.files["b/libtorch.zip"] = DATA
    served.script.extend([served.Act(status=503), served.Act(status=500)])
    urls = [served.url("libtorch.zip"), served.url("b/libtorch.zip")]
    result = download(urls, tmp_path / "data.bin", expected=DIGEST, **FAST)
    assert result.path.read_bytes() == DATA
    assert [r["path"] for r in served.requests] == ["/libtorch.zip", "/b/libtorch.zip",
                                                     "/libtorch.zip"]


def test_every_url_failing_names_each_and_keeps_the_part(served, tmp_path):
    served.script.append(served.Act(cut_after=1000))
    served.default = served.Act(status=500)
    urls = [served.url("libtorch.zip"), served.url("missing.zip"), "http://127.0.0.1:9/x.zip"]
    dest = tmp_path / "data.bin"
    with pytest.raises(FdlError) as err:
        download(urls, dest, expected=DIGEST, source_hint="try another mirror", retries=1,
                 **FAST)
    message = err.value.message
    assert message.startswith("download failed after 2 attempts: HTTP 500 for "
                              f"{served.url('libtorch.zip')}; HTTP 500 for "
                              f"{served.url('missing.zip')}; ")
    assert message.endswith("(ConnectError) for http://127.0.0.1:9/x.zip")
    assert err.value.hint == (f"run again to resume from the 1000 bytes kept in {_part(dest)}; "
                              "if it keeps failing, try another mirror")
    assert _part(dest).read_bytes() == DATA[:1000] and not dest.exists()


def test_a_refused_url_is_skipped_while_others_remain(served, tmp_path):
    urls = ["ftp://127.0.0.1/libtorch.zip", served.url("libtorch.zip")]
    result = download(urls, tmp_path / "a.bin", expected=DIGEST, **FAST)
    assert result.sha256 == DIGEST
    with pytest.raises(UsageError) as err:  # plain http without the opt-in: nothing is left
        download([served.url("libtorch.zip"), "gopher://127.0.0.1/x"], tmp_path / "b.bin",
                 expected=DIGEST, http_opt_in="FDL_ALLOW_HTTP=1")
    assert err.value.message.startswith("no URL to download from: refusing to download over "
                                        "plain http: ")
    assert "FDL_ALLOW_HTTP=1" in err.value.hint
    assert len(served.requests) == 1 and _only(tmp_path) == ["a.bin"]


def test_an_md5_mismatch_deletes_the_part_and_names_both_digests(served, tmp_path):
    dest = tmp_path / "data.bin"
    with pytest.raises(FdlError) as err:
        download([served.url("libtorch.zip")], dest, expected="0" * 32, algorithm="md5", **FAST)
    assert err.value.message == (f"checksum mismatch for {served.url('libtorch.zip')}: "
                                 f"expected md5 {'0' * 32}, got {MD5}")
    assert _only(tmp_path) == []


def test_a_resumed_part_is_rehashed_with_the_expected_algorithm(served, tmp_path):
    dest = tmp_path / "data.bin"
    _part(dest).write_bytes(DATA[:777])  # left by an earlier run
    result = download(served.url("libtorch.zip"), dest, expected=MD5, algorithm="md5", **FAST)
    assert result.resumed is True and result.sha256 == DIGEST
    assert served.requests == [{"path": "/libtorch.zip", "range": "bytes=777-"}]


def test_several_urls_need_an_expected_digest(tmp_path):
    with pytest.raises(ValueError, match="expected digest"):
        download(["https://a.example/f", "https://b.example/f"], tmp_path / "f")
    assert _only(tmp_path) == []


def test_a_file_url_naming_another_host_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(UsageError, match=r"file:// URL names a remote host \(server\)"):
        download("file://server/share/libtorch.zip", tmp_path / "out" / "libtorch.zip")
    assert _only(tmp_path) == []


def _only(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_drip_slower_than_the_minimum_rate_is_given_up_and_retried(served, tmp_path):
    """A byte at a time keeps every read within its timeout: 1,000 bytes at 1 byte/s took 17
    minutes. Under the minimum rate over a window (shortened here) the stream is a transient
    failure; the next attempt, served normally, completes."""
    small = bytes(range(200))
    served.files["small.bin"] = small
    served.script.append(served.Act(drip_s=0.02))  # 50 bytes/s, then normal answers
    told = []
    result = download(served.url("small.bin"), tmp_path / "small.bin",
                      expected=hashlib.sha256(small).hexdigest(),
                      min_rate=MinRate(bytes_per_s=1000, window_s=0.3), on_retry=told.append,
                      **FAST)
    assert result.path.read_bytes() == small
    assert len(served.requests) == 2
    assert len(told) == 1 and told[0].startswith("download attempt 1 of 5 failed (the server sent ")
    assert "under the 1000 bytes/s a download needs" in told[0]
    assert told[0].endswith("; trying again in 0.01 s")


def test_each_failed_round_is_told_in_one_line_and_the_error_names_the_last(served, tmp_path):
    """A server that keeps failing said nothing but `fetching ...` for the whole of its
    retries."""
    served.default = served.Act(status=503)
    told = []
    with pytest.raises(FdlError, match="download failed after 3 attempts"):
        download(served.url("libtorch.zip"), tmp_path / "libtorch.zip", expected=DIGEST,
                 retries=2, on_retry=told.append, **FAST)
    assert [line.split(" failed ")[0] for line in told] == ["download attempt 1 of 3",
                                                             "download attempt 2 of 3"]
    assert all("HTTP 503" in line and served.url("libtorch.zip") in line for line in told)
