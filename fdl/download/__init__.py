"""fdl's HTTP downloads: every byte fdl fetches from a server (libtorch archives, bench datasets)
comes through this package, and no other part of fdl imports an HTTP library
(tests/download/test_http_boundary.py holds that).

The one entry point is :func:`fdl.download.fetch.download`: mirrors tried in order, the file
streamed to ``<dest>.part`` and hashed as it lands, resumed with ``Range`` after a cut, retried
with backoff, verified, then renamed into place. The other modules are its parts:

* ``fetch.py``: ``download`` itself, its retry rounds over the mirrors and one stream's GET;
* ``ranged.py``: a large file over several ranged connections, as many as the link needs;
* ``ranges.py``: the on-disk record of which ranges are written (``<dest>.part.ranges.json``);
* ``partfile.py``: the ``.part`` staging file and the running hashes of what it holds;
* ``urls.py``: which URLs may be fetched (https and file; plain http only when opted in) and the
  per-hop redirect guard;
* ``client.py``: the one ``httpx.Client`` the downloads use, built with httpx's public API only.

Example::

    from fdl.download.fetch import download

    result = download("https://download.pytorch.org/libtorch/cpu/libtorch-....zip",
                      store / "libtorch.zip", expected=sha256)
    result.path, result.sha256, result.size

Importing this package imports nothing: httpx is loaded by the functions that fetch, so that
``fdl --help`` stays light (tests/cli/test_startup.py).
"""
