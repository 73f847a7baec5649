"""The HTTP client fdl downloads with: redirects checked hop by hop
(:func:`fdl.download.urls.redirect_guard`) and socket reads of up to 1 MiB instead of httpcore's 64 KiB.

Why the reads: on a fast link the client is bound by its own CPU, and most of it goes on the
work done per read (a ``recv``, h11's parsing, a bytes object and a Python loop turn each).
Measured on this 2-vCPU machine with scripts/bench-download's server on 127.0.0.1, in one run,
medians of 3: an httpx stream written to a file and hashed in a thread, as fdl's one stream
does, ran at 0.79x ``curl -o`` with 64 KiB reads and 1.15x with 1 MiB reads. A read returns
what the socket holds, so a slow link gets the same small reads it got before: only a fast
one, with a megabyte waiting, takes it in one go.

httpx has no public way to give its default transport a network backend, and passing a whole
transport would turn off the proxies taken from the environment (``HTTPS_PROXY``). So the
client is made as usual and the backend of its direct (non-proxy) connection pool is wrapped
in place: two private attributes of the pinned httpx/httpcore (``scripts/constraints.txt``).
Where they are not found the client keeps 64 KiB reads and works the same;
``tests/download/test_client.py`` fails on the pinned versions if the wrapping stops taking effect.
Connections through a proxy (httpx's own proxy transports) keep 64 KiB reads. Over TLS a read
returns one record (16 KiB) whatever it asks, so a TLS read also takes, without waiting, the
records already received after it, up to 1 MiB.
"""

from __future__ import annotations

from typing import Any

from fdl.download.urls import HTTP_OPT_IN, redirect_guard

READ_BYTES = 1 << 20


def http_client(*, allow_http: bool, timeout_s: float, opt_in: str = HTTP_OPT_IN) -> Any:
    """An ``httpx.Client`` following redirects under the http rule, with wide reads."""
    import httpx

    client = httpx.Client(timeout=timeout_s, follow_redirects=True,
                          event_hooks=redirect_guard(allow_http=allow_http, opt_in=opt_in))
    widen_reads(client)
    return client


def widen_reads(client: Any, read_bytes: int = READ_BYTES) -> bool:
    """Make the direct connections of ``client`` read up to ``read_bytes`` at a time; whether
    it could (False, and nothing changed, when httpx's insides are not the pinned ones)."""
    import httpcore

    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if not isinstance(pool, httpcore.ConnectionPool) or not isinstance(
            backend, httpcore.NetworkBackend):
        return False
    if not isinstance(backend, _WideBackend):
        pool._network_backend = _WideBackend(backend, read_bytes)
    return True


class _WideStream:
    """A connection (an httpcore ``NetworkStream``) whose reads ask for at least ``read_bytes``."""

    def __init__(self, inner: Any, read_bytes: int):
        import ssl

        self.inner, self.read_bytes = inner, read_bytes
        sock = inner.get_extra_info("socket")
        self._tls = sock if isinstance(sock, ssl.SSLSocket) else None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        want = max(max_bytes, self.read_bytes)
        data = self.inner.read(want, timeout)
        if self._tls is None or not data or len(data) >= want:
            return data
        return self._tls_records_waiting(data, want, timeout)

    def _tls_records_waiting(self, data: bytes, want: int, timeout: float | None) -> bytes:
        """``data`` (one TLS record) and the records already received after it, up to
        ``want`` bytes, without waiting for more. Any trouble ends the gathering: the next
        read, a blocking one through httpcore, meets it again and reports it its way."""
        parts, have = [data], len(data)
        sock = self._tls
        try:
            sock.setblocking(False)
            while have < want:
                more = sock.recv(want - have)
                if not more:  # the end: the next read says so
                    break
                parts.append(more)
                have += len(more)
        except OSError:  # ssl.SSLWantReadError (nothing more yet) and any real failure alike
            pass
        finally:
            sock.settimeout(timeout)
        return b"".join(parts)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> _WideStream:
        return _WideStream(self.inner.start_tls(ssl_context, server_hostname, timeout),
                           self.read_bytes)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _WideBackend:
    """An httpcore ``NetworkBackend`` whose connections are ``inner``'s, as :class:`_WideStream`."""

    def __init__(self, inner: Any, read_bytes: int):
        self.inner, self.read_bytes = inner, read_bytes

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None) -> _WideStream:
        return _WideStream(self.inner.connect_tcp(host, port, timeout, local_address,
                                                  socket_options), self.read_bytes)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> _WideStream:
        return _WideStream(self.inner.connect_unix_socket(path, timeout, socket_options),
                           self.read_bytes)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)
