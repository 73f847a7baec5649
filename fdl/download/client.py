"""The HTTP client fdl downloads with: one ``httpx.Client``, built with httpx's public API only.

What it is given, and why:

* redirects are followed, and every hop is checked by :func:`fdl.download.urls.redirect_guard`
  before it is requested (plain http refused unless the user opted in);
* ``timeout_s`` for connecting, for each read and write, and for a connection from the pool: a
  stalled server becomes a timeout, which the download retries;
* proxies (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) and CA certificates
  (``SSL_CERT_FILE``, ``SSL_CERT_DIR``) from the environment, as httpx takes them (``trust_env``).

Nothing here reaches into httpx's or httpcore's private attributes. Socket reads are httpx's
own: wider reads patched into its connection pool gain only on loopback, where no user's link
to a mirror is, and an upgrade of httpx would break them without a word. What a capped or
distant link feels is the number of connections (:mod:`fdl.download.ranged`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdl.download.urls import HTTP_OPT_IN, redirect_guard

if TYPE_CHECKING:
    import httpx


def http_client(*, allow_http: bool, timeout_s: float, opt_in: str = HTTP_OPT_IN
                ) -> httpx.Client:
    """An ``httpx.Client`` following redirects under the http rule (see the module docstring);
    the caller closes it (``with http_client(...) as client:``)."""
    import httpx

    return httpx.Client(timeout=timeout_s, follow_redirects=True, trust_env=True,
                        event_hooks=redirect_guard(allow_http=allow_http, opt_in=opt_in))
