"""Install a libtorch archive into the store: download -> verify -> extract -> install ->
(activate). Every step works beside the target and the variant appears only when complete:

1. stream the zip to ``<store>/.staging/<name>.zip.part`` (resumable, sha256 while writing);
2. check the sha256 when one is known, rename to ``<name>.zip``;
3. extract (integrity check, no escaping paths) into ``<store>/.staging/<name>.tree``;
4. ``Store.install`` moves the tree into ``precompiled/<name>`` and writes ``variant.json``
   last, under the store lock; then, unless told not to, ``.active`` names it.

A crash or Ctrl-C at any point leaves the previous state intact: the staging files are either
resumed by the next run or removed, and no half-installed variant is visible.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdl.libtorch.store import Store, Variant


@dataclass(frozen=True)
class ArchiveRequest:
    """What to install: a name in the store, where to fetch it, and what we know about it."""

    name: str  # precompiled/<name>, e.g. "2.13.0-cu130"
    url: str
    sha256: str | None = None  # expected; checked when given
    meta: dict[str, Any] | None = None  # version, cuda, archs, variant ... for variant.json


def install_archive(store: Store, request: ArchiveRequest, *, activate: bool = True,
                    progress: Callable[[int, int | None], None] | None = None) -> Variant:
    from fdl.libtorch.download import download
    from fdl.libtorch.extract import extract_zip

    staging = store.staging()
    archive = staging / f"{request.name}.zip"
    tree = staging / f"{request.name}.tree"
    result = download(request.url, archive, expected_sha256=request.sha256, progress=progress)
    shutil.rmtree(tree, ignore_errors=True)  # a tree left by an interrupted earlier run
    try:
        extract_zip(result.path, tree)
        meta = {**(request.meta or {}), "source": "download", "url": request.url,
                "sha256": result.sha256, "size": result.size}
        variant = store.install(kind="precompiled", name=request.name, tree=tree, meta=meta)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    result.path.unlink(missing_ok=True)
    return store.activate(variant.id) if activate else variant
