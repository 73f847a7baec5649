"""Install a libtorch archive into the store: download -> verify -> extract -> install ->
(activate). Every step works beside the target and the variant appears only when complete:

1. stream the zip to ``<store>/.staging/<name>.zip.part`` (resumable, sha256 while writing);
2. check the sha256 when one is known, rename to ``<name>.zip``;
3. extract (integrity check, no escaping paths) into ``<store>/.staging/<name>.tree``;
4. ``Store.install`` moves the tree into ``precompiled/<name>`` and writes ``variant.json``
   last, under the store lock; then, unless told not to, ``.active`` names it.

Before any of it the name, the URL (https or file; plain http only with ``allow_http``) and
``FDL_MAX_EXTRACT_BYTES`` are checked, so bad input writes nothing. The whole sequence holds the
variant's download lock (``Store.download_lock``): a second download of the same variant waits
for the first and then reuses its install instead of writing into the same ``.part``.

A crash or Ctrl-C at any point leaves the previous state intact and no half-installed variant
visible. An interrupted download keeps its ``.part`` (``fdl libtorch list`` shows it; the next run
resumes it); a downloaded archive never outlives the attempt to install it: it is removed when
extraction fails (truncated, bad CRC, a refused member, too large) as well as after success.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdl.libtorch.store import Store, Variant

# Where else a libtorch archive may be found, for download errors.
SOURCE_HINT = ("check the URL, pass another with --url, or point FDL_LIBTORCH_MIRROR at a mirror "
               "that has this file")


@dataclass(frozen=True)
class ArchiveRequest:
    """What to install: a name in the store, where to fetch it, and what we know about it."""

    name: str  # precompiled/<name>, e.g. "2.13.0-cu130"
    url: str
    sha256: str | None = None  # expected; checked when given
    meta: dict[str, Any] | None = None  # version, cuda, archs, variant ... for variant.json


def check_request(request: ArchiveRequest, *, allow_http: bool) -> int:
    """Check what ``install_archive`` takes from outside, before anything is written; returns
    the extraction limit. Raises ``UsageError``/``ConfigError`` (exit 2)."""
    from fdl.libtorch.extract import max_extract_bytes
    from fdl.libtorch.validate import check_variant_name
    from fdl.urls import check_url

    check_variant_name(request.name)
    check_url(request.url, allow_http=allow_http)
    return max_extract_bytes()


def install_archive(store: Store, request: ArchiveRequest, *, activate: bool = True,
                    allow_http: bool = False,
                    progress: Callable[[int, int | None], None] | None = None,
                    on_wait: Callable[[], None] | None = None) -> Variant:
    """Download, verify, extract and install ``request`` (see the module docstring); activate
    it unless told not to. ``on_wait`` is called when another process is installing the same
    variant and this one waits for it; the install found then (same name, URL and checksum) is
    reused, not downloaded again."""
    max_bytes = check_request(request, allow_http=allow_http)
    with store.download_lock(request.name, on_wait=on_wait):
        variant = _installed(store, request) or _fetch_and_install(
            store, request, allow_http=allow_http, max_bytes=max_bytes, progress=progress)
    return store.activate(variant.id) if activate else variant


def _installed(store: Store, request: ArchiveRequest) -> Variant | None:
    """The variant as another process just installed it from the same URL (and checksum)."""
    for variant in store.variants():
        if variant.id == f"precompiled/{request.name}" and variant.meta.get("url") == request.url \
                and request.sha256 in (None, variant.meta.get("sha256")):
            return variant
    return None


def _fetch_and_install(store: Store, request: ArchiveRequest, *, allow_http: bool,
                       max_bytes: int,
                       progress: Callable[[int, int | None], None] | None) -> Variant:
    from fdl.download import download
    from fdl.libtorch.extract import extract_zip

    staging = store.staging()
    archive = staging / f"{request.name}.zip"
    tree = staging / f"{request.name}.tree"
    result = download(request.url, archive, expected=request.sha256, progress=progress,
                      allow_http=allow_http, source_hint=SOURCE_HINT,
                      max_bytes=max_bytes)  # zipped <= unpacked
    try:
        shutil.rmtree(tree, ignore_errors=True)  # a tree left by an interrupted earlier run
        extract_zip(result.path, tree, max_bytes=max_bytes)
        meta = {**(request.meta or {}), "source": "download", "url": request.url,
                "sha256": result.sha256, "size": result.size}
        return store.install(kind="precompiled", name=request.name, tree=tree, meta=meta)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        result.path.unlink(missing_ok=True)  # gigabytes: never left behind, failed or not
