"""``fdl libtorch download``: fetch, verify, extract and activate a libtorch variant.

    fdl libtorch download                  # the variant covering every GPU (explained)
    fdl libtorch download --cpu            # the CPU variant
    fdl libtorch download --cuda 12.6      # a CUDA variant of the newest (or --version) release
    fdl libtorch download --variant cu130 --version 2.13.0
    fdl libtorch download --url URL [--sha256 HEX] [--variant NAME] [--version V]
                                           # mirrors, air-gapped sites: named from the
                                           # archive's build-version (2.13.0-cu128)
    fdl libtorch download --dry-run        # say what would be fetched, fetch nothing

``FDL_LIBTORCH_MIRROR`` replaces https://download.pytorch.org/libtorch as the base URL. An
already installed variant is only activated (unless ``--no-activate``), unless ``--sha256``
differs from its recorded digest: then the archive is fetched and verified against the new
digest, and one that differs from the installed variant is refused, naming both digests, with
nothing replaced (``fdl/libtorch/install.py``). Plain http (a mirror, a
``--url`` or a redirect) is refused unless ``--allow-http`` or ``FDL_ALLOW_HTTP=1``; names, URLs
and ``FDL_MAX_EXTRACT_BYTES`` are checked before anything is written (exit 2).

This module parses and renders; which archive the flags name is decided in
``fdl/libtorch/request.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from pathlib import Path

    from fdl.libtorch.install import ArchiveRequest
    from fdl.libtorch.request import DownloadAsk
    from fdl.libtorch.store import Store, Variant
    from fdl.system.gpus import GpuSurvey


def download(
    cpu: Annotated[bool, typer.Option("--cpu", help="The CPU variant.")] = False,
    cuda: Annotated[Optional[str], typer.Option(help="CUDA version, e.g. 12.6 or 13.0.")] = None,  # noqa: UP045
    variant: Annotated[Optional[str], typer.Option(help="Variant name, e.g. cu130, cpu.")] = None,  # noqa: UP045
    version: Annotated[Optional[str], typer.Option(help="libtorch version (default: newest).")] = None,  # noqa: UP045
    url: Annotated[Optional[str], typer.Option(help="Fetch this URL instead of the catalog's.")] = None,  # noqa: UP045
    sha256: Annotated[Optional[str], typer.Option(help="Expected sha256 of the archive.")] = None,  # noqa: UP045
    no_activate: Annotated[bool, typer.Option(
        "--no-activate", help="Install without activating.")] = False,
    allow_http: Annotated[bool, typer.Option(
        "--allow-http", help="Allow plain http (a mirror you trust).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Say what would be fetched; fetch nothing.")] = False,
) -> None:
    """Download a libtorch variant into the store and activate it."""
    import os

    from fdl import console
    from fdl.download.urls import http_allowed
    from fdl.libtorch.catalog import MIRROR_ENV
    from fdl.libtorch.install import check_request, find_installed
    from fdl.libtorch.request import DownloadAsk, resolve_download
    from fdl.libtorch.store import Store
    from fdl.paths import libtorch_root

    allow_http = http_allowed(flag=allow_http)
    ask = DownloadAsk(cpu=cpu, cuda=cuda, variant=variant, version=version, url=url,
                      sha256=sha256)
    choice = resolve_download(ask, base=os.environ.get(MIRROR_ENV), survey=_survey(ask))
    request = choice.request
    check_request(request, allow_http=allow_http)
    store = Store(libtorch_root())
    console.info(choice.reason)
    existing = find_installed(store, request)
    if dry_run:
        _print_dry_run(request, installed=existing is not None, into=store.root)
        return
    if existing is not None:
        if not no_activate:
            store.activate(existing.id)
        console.info(f"{existing.id} is already installed"
                     + ("" if no_activate else "; activated"))
        return
    installed = install_request_with_progress(store, request, activate=not no_activate,
                                              allow_http=allow_http)
    console.info(f"installed {installed.id} at {installed.path}"
                 + ("" if no_activate else " and activated it"))


def _print_dry_run(request: ArchiveRequest, *, installed: bool, into: Path) -> None:
    from fdl import console

    name = request.name or "named from the archive's build-version once fetched"
    console.print_pairs([("variant", f"precompiled/{name}" if request.name else name),
                         ("url", request.url),
                         ("installed", "yes" if installed else "no"),
                         ("sha256", request.sha256 or "computed while downloading"),
                         ("into", str(into / "precompiled" / (request.name or "<name>")))])


def _survey(ask: DownloadAsk) -> GpuSurvey | None:
    """The GPUs, probed only when no flag names the archive."""
    if not ask.needs_survey:
        return None
    from fdl.system.gpus import probe_gpus

    return probe_gpus()


def install_request_with_progress(store: Store, request: ArchiveRequest, *,
                                  activate: bool, allow_http: bool) -> Variant:
    from fdl import console
    from fdl.libtorch.install import install_archive

    label = request.name or request.url.rsplit("/", 1)[-1]

    def wait() -> None:
        console.info(f"waiting for another fdl process that is installing {label}...")

    with console.progress() as bar:
        task = bar.add_task(f"libtorch {label}", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        return install_archive(store, request, activate=activate, allow_http=allow_http,
                               progress=progress, on_wait=wait)
