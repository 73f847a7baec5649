"""Which URLs fdl downloads from: https and file; plain http only when the user opts in.

A libtorch is native code and a dataset is fed to training; bytes altered in transit would go
unnoticed where no checksum is published (libtorch archives). So plain ``http`` — a mirror, a
``--url``, or an https URL redirecting to http — is refused unless the user says otherwise with
``--allow-http`` or ``FDL_ALLOW_HTTP=1`` (e.g. a mirror on their own network). Redirects are
checked hop by hop with :func:`redirect_guard`. Example::

    check_url(url, allow_http=http_allowed(flag=allow_http_option))
    httpx.Client(follow_redirects=True, event_hooks=redirect_guard(allow_http=False))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlparse

from fdl.errors import ConfigError, FdlError, UsageError

ALLOW_HTTP_ENV = "FDL_ALLOW_HTTP"
HTTP_OPT_IN = f"--allow-http (or {ALLOW_HTTP_ENV}=1)"
_YES, _NO = ("1", "true", "yes"), ("", "0", "false", "no")


def http_allowed(*, flag: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """Whether plain http is allowed: ``flag`` (``--allow-http``) or ``FDL_ALLOW_HTTP``.

    ``FDL_ALLOW_HTTP`` is ``1``/``true``/``yes`` or ``0``/``false``/``no``/empty; anything else
    is a ``ConfigError`` naming it."""
    value = (os.environ if env is None else env).get(ALLOW_HTTP_ENV, "").strip().lower()
    if value not in _YES + _NO:
        raise ConfigError(f"{ALLOW_HTTP_ENV}={value!r} is not a yes/no value; allowed: 1, true, "
                          "yes, 0, false, no",
                          hint=f"unset it, or set {ALLOW_HTTP_ENV}=1 to allow plain http")
    return flag or value in _YES


def check_url(url: str, *, allow_http: bool, opt_in: str = HTTP_OPT_IN) -> None:
    """Refuse (``UsageError``, exit 2) what ``download`` must not fetch: a scheme other than
    https and file, plain http without the opt-in, an http(s) URL without a host, a file URL
    naming another machine."""
    try:
        parsed = urlparse(url)
        host = parsed.hostname
    except ValueError as exc:  # e.g. an unclosed [ipv6 literal
        raise UsageError(f"URL {url!r} cannot be parsed: {exc}",
                         hint="e.g. https://host/path/file.zip") from exc
    scheme = parsed.scheme.lower()
    if scheme == "http" and not allow_http:
        raise UsageError(f"refusing to download over plain http: {url}",
                         hint=f"use an https URL, or opt in with {opt_in} for a server you "
                              "trust")
    if scheme not in ("http", "https", "file"):
        raise UsageError(f"URL {url!r} has scheme {scheme or 'none'!r}; allowed: https, file, "
                         f"http (with {opt_in})",
                         hint="e.g. https://host/path/file.zip or file:///path/file.zip")
    if scheme != "file" and not host:
        raise UsageError(f"URL {url!r} names no host", hint="e.g. https://host/path/file.zip")
    if scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise UsageError(f"file:// URL names a remote host ({parsed.netloc}): {url}",
                         hint="use file:///absolute/path on this machine")


def redirect_guard(*, allow_http: bool, opt_in: str = HTTP_OPT_IN) -> dict[str, list]:
    """httpx ``event_hooks`` that refuse a request (a redirect hop included) to plain http."""
    def refuse_http(request) -> None:
        if request.url.scheme == "http" and not allow_http:
            raise FdlError(f"refusing a redirect to plain http: {request.url}",
                           hint=f"use the final https URL, or opt in with {opt_in} if you "
                                "trust this server")
    return {"request": [refuse_http]}
