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

A ``--url`` request has no name until its archive is read (``name`` None): it is fetched to
``.staging/url-<hash of the URL>.zip`` under that lock, and ``fdl.libtorch.archive_facts`` names
it from the archive's ``build-version`` (checking ``--version``/``--variant`` against it).

The sha256 rule: an installed variant is reused without a fetch only when no ``--sha256`` is
given or it equals the installed one's. A different ``--sha256`` downloads again and verifies
against the new digest (a mismatch is the download's error, naming both digests); an archive
that verifies but differs from the installed variant's is refused, naming both digests, and
nothing is replaced (remove the variant first, or give the new one another ``--variant``).

A crash or Ctrl-C at any point leaves the previous state intact and no half-installed variant
visible. An interrupted download keeps its ``.part`` (``fdl libtorch list`` shows it; the next run
resumes it); a downloaded archive never outlives the attempt to install it: it is removed when
extraction fails (truncated, bad CRC, a refused member, too large) as well as after success.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.libtorch.store import Store, Variant

# Where else a libtorch archive may be found, for download errors.
SOURCE_HINT = ("check the URL, pass another with --url, or point FDL_LIBTORCH_MIRROR at a mirror "
               "that has this file")


@dataclass(frozen=True)
class ArchiveRequest:
    """What to install: a name in the store, where to fetch it, and what we know about it."""

    name: str | None  # precompiled/<name>, e.g. "2.13.0-cu130"; None: named from the archive
    url: str
    sha256: str | None = None  # expected; checked when given
    meta: dict[str, Any] | None = None  # version, cuda, archs, variant ... for variant.json
    version: str | None = None  # name None: the --version the archive must agree with
    variant: str | None = None  # name None: --variant (a tag to check, or the name itself)


def check_request(request: ArchiveRequest, *, allow_http: bool) -> int:
    """Check what ``install_archive`` takes from outside, before anything is written; returns
    the extraction limit. Raises ``UsageError``/``ConfigError`` (exit 2)."""
    from fdl.download.urls import check_url
    from fdl.libtorch.extract import max_extract_bytes
    from fdl.libtorch.validate import check_variant_name

    if request.name is not None:
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
    with store.download_lock(_lock_name(request), on_wait=on_wait):
        variant = find_installed(store, request) or _fetch_and_install(
            store, request, allow_http=allow_http, max_bytes=max_bytes, progress=progress)
    return store.activate(variant.id) if activate else variant


def find_installed(store: Store, request: ArchiveRequest) -> Variant | None:
    """The installed variant ``request`` names (by name, or for a ``--url`` request by URL) when
    no sha256 is asked or it is the installed one's: then nothing needs fetching."""
    for variant in store.variants():
        same = variant.name == request.name if request.name is not None \
            else variant.meta.get("url") == request.url \
            and request.version in (None, variant.meta.get("version")) \
            and request.variant in (None, variant.name, variant.meta.get("variant"))
        if variant.kind == "precompiled" and same and (
                request.sha256 is None or request.sha256.lower() == variant.meta.get("sha256")):
            return variant
    return None


def _lock_name(request: ArchiveRequest) -> str:
    if request.name is not None:
        return request.name
    import hashlib

    return "url-" + hashlib.sha256(request.url.encode()).hexdigest()[:16]


def _fetch_and_install(store: Store, request: ArchiveRequest, *, allow_http: bool,
                       max_bytes: int,
                       progress: Callable[[int, int | None], None] | None) -> Variant:
    from fdl.download.fetch import download
    from fdl.libtorch.extract import extract_zip

    staging = store.staging()
    archive = staging / f"{_lock_name(request)}.zip"
    tree = staging / f"{_lock_name(request)}.tree"
    from fdl import console

    result = download(request.url, archive, expected=request.sha256, progress=progress,
                      allow_http=allow_http, source_hint=SOURCE_HINT,
                      max_bytes=max_bytes, on_retry=console.warn)  # zipped <= unpacked
    try:
        name, meta = _name_and_meta(request, result.path)
        same = next((v for v in store.variants() if v.id == f"precompiled/{name}"), None)
        if same is not None:
            return _same_archive(same, sha256=result.sha256)
        shutil.rmtree(tree, ignore_errors=True)  # a tree left by an interrupted earlier run
        extract_zip(result.path, tree, max_bytes=max_bytes)
        meta = {**meta, "source": "download", "url": request.url,
                "sha256": result.sha256, "size": result.size}
        return store.install(kind="precompiled", name=name, tree=tree, meta=meta)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        result.path.unlink(missing_ok=True)  # gigabytes: never left behind, failed or not


def _name_and_meta(request: ArchiveRequest, archive: Path) -> tuple[str, dict[str, Any]]:
    if request.name is not None:
        return request.name, dict(request.meta or {})
    from fdl.libtorch.archive_facts import name_archive, read_archive_facts, url_file_name

    return name_archive(read_archive_facts(archive), url_name=url_file_name(request.url),
                        variant=request.variant, version=request.version)


def _same_archive(installed: Variant, *, sha256: str) -> Variant:
    """``installed`` when it came from this very archive; otherwise refuse (the sha256 rule)."""
    from fdl.errors import FdlError

    old = installed.meta.get("sha256")
    if old == sha256:
        return installed
    raise FdlError(f"{installed.id} is already installed from another archive (sha256 {old}); "
                   f"the one downloaded now has sha256 {sha256}: nothing was replaced",
                   hint=f"`fdl libtorch remove {installed.name}` first to install this one, "
                        "or give it another name with --variant")
