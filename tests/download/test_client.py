"""fdl.download.client against a real HTTP server on 127.0.0.1 (``http_server`` in tests/conftest.py):
the download client's connections ask the socket for 1 MiB per read (on the pinned httpx and
httpcore: this test fails if an upgrade moves the insides the widening relies on), proxies from
the environment still apply, and a client of another shape is left as it is. Over real TLS
(a self-signed certificate made with openssl): one read takes every record already received,
and a download over https is whole."""

from __future__ import annotations

import array
import hashlib
import random
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import httpx
import pytest
from helpers import GUARD_S, self_signed_cert, wait_until

from fdl.download.client import READ_BYTES, _WideBackend, http_client, widen_reads
from fdl.download.fetch import download

try:
    import fcntl
    import termios
except ImportError:  # not on Windows
    fcntl = termios = None

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


@pytest.fixture
def tls_pair(tmp_path):
    """(client context, server context) with a self-signed certificate for 127.0.0.1."""
    cert, key = self_signed_cert(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return ssl.create_default_context(cafile=str(cert)), server


def _waiting_bytes(sock) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


@pytest.mark.skipif(termios is None or not hasattr(termios, "FIONREAD"),
                    reason="counts the bytes waiting in the socket (FIONREAD)")
def test_a_tls_read_takes_every_record_already_received(tls_pair):
    client_context, server_context = tls_pair
    payload = random.Random(4).randbytes(80 << 10)  # 5 TLS records; fits a socket buffer
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with server_context.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(payload)
            done.wait(GUARD_S)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    backend = _WideBackend(httpcore.SyncBackend(), READ_BYTES)
    stream = backend.connect_tcp("127.0.0.1", listener.getsockname()[1], timeout=GUARD_S)
    stream = stream.start_tls(client_context, "127.0.0.1", timeout=GUARD_S)
    try:
        raw = stream.get_extra_info("socket")
        wait_until(lambda: _waiting_bytes(raw) >= len(payload), "the whole payload to arrive")
        data = stream.read(1 << 16, timeout=GUARD_S)  # httpcore asks for 64 KiB
        assert data == payload  # every record waiting, in one read, where one read gave 16 KiB
    finally:
        done.set()
        stream.close()
        listener.close()
        thread.join(GUARD_S)


def test_an_https_download_is_whole_and_verified(tls_pair, tmp_path, monkeypatch):
    _, server_context = tls_pair
    files = {"/libtorch.zip": DATA}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):
            pass

        def do_GET(self):
            body = files[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = server_context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    cafile = tmp_path / "cert.pem"
    monkeypatch.setenv("SSL_CERT_FILE", str(cafile))
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}/libtorch.zip"
        result = download(url, tmp_path / "out.zip", expected=hashlib.sha256(DATA).hexdigest())
    finally:
        server.shutdown()
        server.server_close()
    assert result.path.read_bytes() == DATA
