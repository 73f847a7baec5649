"""fdl.httpclient against a real HTTP server on 127.0.0.1 (``http_server`` in tests/conftest.py):
the download client's connections ask the socket for 1 MiB per read (on the pinned httpx and
httpcore: this test fails if an upgrade moves the insides the widening relies on), proxies from
the environment still apply, and a client of another shape is left as it is."""

from __future__ import annotations

import random

import httpx
import pytest

from fdl.httpclient import READ_BYTES, http_client, widen_reads

DATA = random.Random(3).randbytes(3 << 20)


class _Recording:
    """Wraps a network backend; records what each read of its connections asked for."""

    def __init__(self, inner, asked: list[int]):
        self.inner, self.asked = inner, asked

    def connect_tcp(self, *args, **kwargs):
        stream = self.inner.connect_tcp(*args, **kwargs)
        asked, read = self.asked, stream.read

        def recording_read(max_bytes, timeout=None):
            asked.append(max_bytes)
            return read(max_bytes, timeout)

        stream.read = recording_read
        return stream


def test_every_read_of_a_download_asks_for_a_megabyte(http_server):
    http_server.files["libtorch.zip"] = DATA
    asked: list[int] = []
    with http_client(allow_http=True, timeout_s=30) as client:
        wide = client._transport._pool._network_backend  # what widen_reads put there
        wide.inner = _Recording(wide.inner, asked)  # below it: the socket's own backend
        response = client.get(http_server.url("libtorch.zip"))
    assert response.content == DATA
    assert asked and set(asked) == {READ_BYTES}


def test_proxies_from_the_environment_still_apply(http_server, monkeypatch):
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", http_server.url(""))  # the test server plays the proxy
    with http_client(allow_http=True, timeout_s=30) as client:
        response = client.get("http://fdl-test.invalid/libtorch.zip")
    assert response.status_code == 404  # the "proxy" has no such file
    assert http_server.requests == [{"path": "http://fdl-test.invalid/libtorch.zip",
                                     "range": None}]


@pytest.mark.parametrize("client", [
    object(), httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))],
    ids=["not a client", "a client on another transport"])
def test_a_client_of_another_shape_is_left_alone(client):
    assert widen_reads(client) is False
