"""``fdl libtorch download``: fetch, verify, extract and activate a libtorch variant.

    fdl libtorch download                  # the variant covering every GPU (explained)
    fdl libtorch download --cpu            # the CPU variant
    fdl libtorch download --cuda 12.6      # a CUDA variant of the newest (or --version) release
    fdl libtorch download --variant cu130 --version 2.13.0
    fdl libtorch download --url URL [--sha256 HEX] [--variant NAME]   # mirrors, air-gapped sites
    fdl libtorch download --dry-run        # say what would be fetched, fetch nothing

``FDL_LIBTORCH_MIRROR`` replaces https://download.pytorch.org/libtorch as the base URL. An
already installed variant is only activated (unless ``--no-activate``). Plain http (a mirror, a
``--url`` or a redirect) is refused unless ``--allow-http`` or ``FDL_ALLOW_HTTP=1``; names, URLs
and ``FDL_MAX_EXTRACT_BYTES`` are checked before anything is written (exit 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from fdl.libtorch.catalog import LibtorchArchive
    from fdl.libtorch.install import ArchiveRequest
    from fdl.libtorch.store import Store, Variant


def download(
    cpu: Annotated[bool, typer.Option("--cpu", help="The CPU variant.")] = False,
    cuda: Annotated[Optional[str], typer.Option(help="CUDA version, e.g. 12.6 or 13.0.")] = None,  # noqa: UP045
    variant: Annotated[Optional[str], typer.Option(help="Variant name, e.g. cu130, cpu.")] = None,  # noqa: UP045
    version: Annotated[Optional[str], typer.Option(help="libtorch version (default: newest).")] = None,  # noqa: UP045
    url: Annotated[Optional[str], typer.Option(help="Fetch this URL instead of the catalog's.")] = None,  # noqa: UP045
    sha256: Annotated[Optional[str], typer.Option(help="Expected sha256 of the archive.")] = None,  # noqa: UP045
    no_activate: Annotated[bool, typer.Option(help="Install without activating.")] = False,
    allow_http: Annotated[bool, typer.Option(
        "--allow-http", help="Allow plain http (a mirror you trust).")] = False,
    dry_run: Annotated[bool, typer.Option(help="Say what would be fetched; fetch nothing.")] = False,
) -> None:
    """Download a libtorch variant into the store and activate it."""
    from fdl import console
    from fdl.libtorch.install import check_request
    from fdl.libtorch.store import Store
    from fdl.paths import libtorch_root
    from fdl.urls import http_allowed

    allow_http = http_allowed(flag=allow_http)
    request, why = _request(cpu=cpu, cuda=cuda, variant=variant, version=version, url=url,
                            sha256=sha256)
    check_request(request, allow_http=allow_http)
    store = Store(libtorch_root())
    console.info(why)
    existing = {v.id: v for v in store.variants()}.get(f"precompiled/{request.name}")
    if dry_run:
        console.print_pairs([("variant", f"precompiled/{request.name}"), ("url", request.url),
                             ("installed", "yes" if existing else "no"),
                             ("sha256", request.sha256 or "computed while downloading"),
                             ("into", str(libtorch_root() / "precompiled" / request.name))])
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


def _request(*, cpu: bool, cuda: str | None, variant: str | None, version: str | None,
             url: str | None, sha256: str | None) -> tuple[ArchiveRequest, str]:
    import os

    from fdl.errors import UsageError
    from fdl.libtorch.catalog import MIRROR_ENV, find_archive, latest_version
    from fdl.libtorch.install import ArchiveRequest
    from fdl.libtorch.validate import check_variant_name

    if sum([cpu, cuda is not None, variant is not None and url is None]) > 1:
        raise UsageError("choose one of --cpu, --cuda, --variant",
                         hint="see `fdl libtorch download --help`")
    if sha256 is not None and not _is_sha256(sha256):
        raise UsageError(f"--sha256 must be 64 hex digits, got {sha256!r}",
                         hint="e.g. the output of `sha256sum libtorch.zip`")
    if url is not None:
        if cpu or cuda is not None or version is not None:
            raise UsageError("--url fetches exactly that archive; --cpu, --cuda and --version "
                             "pick one from the catalog: give one or the other",
                             hint="name the variant with --variant NAME")
        if variant is not None:
            check_variant_name(variant, what="--variant")
        name = variant or _name_from_url(url)
        return ArchiveRequest(name, url, sha256, {"variant": name}), f"fetching {url}"
    base = os.environ.get(MIRROR_ENV)
    version = version or latest_version()
    chosen = "cpu" if cpu else f"cu{cuda.replace('.', '')}" if cuda else variant
    if chosen is not None:
        archive = find_archive(version=version, variant=chosen, base=base)
        return archive_request(archive, sha256), f"{archive.name} as asked"
    return _auto(version=version, base=base, sha256=sha256)


def _auto(*, version: str, base: str | None, sha256: str | None) -> tuple[ArchiveRequest, str]:
    from fdl.errors import FdlError
    from fdl.libtorch.resolve import resolve_variant
    from fdl.system.gpus import probe_gpus

    resolution = resolve_variant(probe_gpus(), version=version, base=base)
    if resolution.archive is None:
        options = []
        if resolution.best_partial:
            options.append(f"--variant {resolution.best_partial.variant} (covers the most; "
                           f"leaves out {', '.join(resolution.left_out)})")
        if resolution.source_arch_list:
            options.append(f'fdl libtorch build --archs "{resolution.source_arch_list}"')
        raise FdlError(resolution.reason, hint="; or ".join(options) or None)
    return archive_request(resolution.archive, sha256), f"auto: {resolution.reason}"


def archive_request(archive: LibtorchArchive, sha256: str | None) -> ArchiveRequest:
    """What to install for a catalog entry, with its metadata for variant.json."""
    from fdl.libtorch.install import ArchiveRequest

    meta = {"version": archive.version, "variant": archive.variant, "cuda": archive.cuda,
            "archs": list(archive.archs), "platform": archive.platform,
            "min_driver": archive.min_driver}
    return ArchiveRequest(archive.name, archive.url, sha256, meta)


def _name_from_url(url: str) -> str:
    """The variant name a URL's file name gives (``libtorch-...-2.13.0%2Bcpu.zip`` ->
    ``2.13.0-cpu``); a ``UsageError`` asking for ``--variant`` when that is no plain name."""
    from urllib.parse import unquote, urlparse

    from fdl.errors import UsageError
    from fdl.libtorch.validate import NAME_RULE, is_variant_name

    stem = unquote(urlparse(url).path.rsplit("/", 1)[-1]).removesuffix(".zip")
    for prefix in ("libtorch-win-shared-with-deps-", "libtorch-shared-with-deps-",
                   "libtorch-cxx11-abi-shared-with-deps-", "libtorch-"):
        stem = stem.removeprefix(prefix)
    name = stem.replace("+", "-") or "custom"
    if not is_variant_name(name):
        raise UsageError(f"--url {url} gives the variant name {name!r}, which is not a plain "
                         f"directory name ({NAME_RULE})",
                         hint="name the variant with --variant NAME, e.g. --variant site-build")
    return name


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def install_request_with_progress(store: Store, request: ArchiveRequest, *,
                                  activate: bool, allow_http: bool) -> Variant:
    from fdl import console
    from fdl.libtorch.install import install_archive

    def wait() -> None:
        console.info(f"waiting for another fdl process that is installing "
                     f"precompiled/{request.name}...")

    with console.progress() as bar:
        task = bar.add_task(f"libtorch {request.name}", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        return install_archive(store, request, activate=activate, allow_http=allow_http,
                               progress=progress, on_wait=wait)
