"""fdl.download.client against real servers on 127.0.0.1: proxies from the environment apply
(``http_server`` in tests/conftest.py plays the proxy), and a download over real TLS (a
self-signed certificate made with openssl, trusted through ``SSL_CERT_FILE``) is whole.

The redirect guard is tested where users meet it, in tests/faults/test_download_faults.py (an
https -> http redirect through a real TLS server)."""

from __future__ import annotations

import hashlib
import random
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import self_signed_cert

from fdl.download.client import http_client
from fdl.download.fetch import download

DATA = random.Random(3).randbytes(3 << 20)


def test_proxies_from_the_environment_still_apply(http_server, monkeypatch):
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", http_server.url(""))  # the test server plays the proxy
    with http_client(allow_http=True, timeout_s=30) as client:
        response = client.get("http://fdl-test.invalid/libtorch.zip")
    assert response.status_code == 404  # the "proxy" has no such file
    assert http_server.requests == [{"path": "http://fdl-test.invalid/libtorch.zip",
                                     "range": None}]


@pytest.fixture
def server_context(tmp_path):
    """A server context with a self-signed certificate for 127.0.0.1 (``tmp_path/cert.pem``)."""
    cert, key = self_signed_cert(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server


def test_an_https_download_is_whole_and_verified(server_context, tmp_path, monkeypatch):
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
