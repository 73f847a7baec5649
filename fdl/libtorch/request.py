"""What ``fdl libtorch download`` fetches, decided from its flags before anything is written.

:func:`resolve_download` is pure: the flags as typed (a :class:`DownloadAsk`), the mirror base
(``FDL_LIBTORCH_MIRROR``) and, only when no flag names the archive, the GPU survey go in; the
:class:`~fdl.libtorch.install.ArchiveRequest` to install and one line saying why come out.

    --cpu | --cuda 12.6 | --variant cu130   that catalog entry of --version (default: the newest
                                            release that has it); --variant 2.11.0-cu128 names both
    --url URL [--version V] [--variant NAME]
                                            exactly that archive, named from the archive itself
                                            (its build-version: 2.13.0-cu128) once fetched;
                                            --version/--variant cpu|cuNNN must agree with it,
                                            another --variant NAME is the name (archive_facts)
    no flag naming an archive               the variant covering every GPU (resolve_variant)

Contradicting flags, a ``--sha256`` that is not 64 hex digits and a name that is no plain
directory name raise ``UsageError`` (exit 2); GPUs no official variant covers raise ``FdlError``
(exit 1) whose hint names the options. ``fdl setup`` takes its request from
:func:`archive_request` too, so both commands install a catalog entry with the same metadata.

Example::

    >>> resolve_download(DownloadAsk(cpu=True, version="2.13.0"), base=None).request.url
    'https://download.pytorch.org/libtorch/cpu/libtorch-shared-with-deps-2.13.0%2Bcpu.zip'
"""

from __future__ import annotations

from dataclasses import dataclass

from fdl.errors import FdlError, UsageError
from fdl.libtorch.catalog import LibtorchArchive, split_variant
from fdl.libtorch.install import ArchiveRequest
from fdl.libtorch.resolve import resolve_variant
from fdl.libtorch.validate import check_variant_name
from fdl.system.gpus import GpuSurvey

__all__ = ["DownloadAsk", "DownloadChoice", "archive_request", "resolve_download"]

_HELP = "see `fdl libtorch download --help`"


@dataclass(frozen=True)
class DownloadAsk:
    """The flags of ``fdl libtorch download`` that choose the archive, as the user typed them."""

    cpu: bool = False
    cuda: str | None = None  # "12.6"
    variant: str | None = None  # "cu130"; with url: the name in the store
    version: str | None = None  # None: the newest release in the catalog
    url: str | None = None
    sha256: str | None = None

    @property
    def needs_survey(self) -> bool:
        """True when no flag names the archive, so the GPUs decide (probe them for this)."""
        return not self.cpu and self.cuda is None and self.variant is None and self.url is None


@dataclass(frozen=True)
class DownloadChoice:
    request: ArchiveRequest
    reason: str  # one line for the user: why this archive


def resolve_download(ask: DownloadAsk, *, base: str | None,
                     survey: GpuSurvey | None = None) -> DownloadChoice:
    """The archive ``ask`` names (see the module docstring). ``survey`` is needed exactly when
    ``ask.needs_survey``; ``base`` replaces download.pytorch.org in catalog URLs."""
    _check_ask(ask)
    if ask.url is not None:
        if ask.variant is not None:
            check_variant_name(ask.variant, what="--variant")
        request = ArchiveRequest(None, ask.url, ask.sha256, None, version=ask.version,
                                 variant=ask.variant)
        return DownloadChoice(request, f"fetching {ask.url} (named from its build-version)")
    chosen = "cpu" if ask.cpu else f"cu{ask.cuda.replace('.', '')}" if ask.cuda else ask.variant
    if chosen is not None:
        archive = split_variant(chosen, version=ask.version, base=base)
        return DownloadChoice(archive_request(archive, sha256=ask.sha256),
                              f"{archive.name} as asked")
    assert survey is not None, "resolve_download: the GPUs decide and no survey was given"
    # the same resolution as fdl setup's (every release unless --version names one)
    return _for_every_gpu(survey, version=ask.version, base=base, sha256=ask.sha256)


def archive_request(archive: LibtorchArchive, *, sha256: str | None = None) -> ArchiveRequest:
    """What to install for a catalog entry, with its metadata for variant.json."""
    meta = {"version": archive.version, "variant": archive.variant, "cuda": archive.cuda,
            "archs": list(archive.archs), "platform": archive.platform,
            "min_driver": archive.min_driver}
    return ArchiveRequest(archive.name, archive.url, sha256, meta)


def _check_ask(ask: DownloadAsk) -> None:
    # --variant with --url names the download; alone it picks from the catalog like --cpu/--cuda
    if sum([ask.cpu, ask.cuda is not None, ask.variant is not None and ask.url is None]) > 1:
        raise UsageError("choose one of --cpu, --cuda, --variant", hint=_HELP)
    if ask.sha256 is not None and not _is_sha256(ask.sha256):
        raise UsageError(f"--sha256 must be 64 hex digits, got {ask.sha256!r}",
                         hint="e.g. the output of `sha256sum libtorch.zip`")
    if ask.url is not None and (ask.cpu or ask.cuda is not None):
        raise UsageError("--url fetches exactly that archive; --cpu and --cuda pick one from "
                         "the catalog: give one or the other",
                         hint="name the variant with --variant NAME")


def _for_every_gpu(survey: GpuSurvey, *, version: str | None, base: str | None,
                   sha256: str | None) -> DownloadChoice:
    resolution = resolve_variant(survey, version=version, base=base)
    if resolution.archive is None:
        options = []
        if resolution.best_partial:
            options.append(f"--variant {resolution.best_partial.name} (covers the most; "
                           f"leaves out {', '.join(resolution.left_out)})")
        if resolution.source_arch_list:
            options.append(f'fdl libtorch build --archs "{resolution.source_arch_list}" (one '
                           "libtorch for every GPU: what a C++ program on all of them needs; "
                           "fdl's Python workers can instead run one environment per card: "
                           "fdl setup --dry-run)")
        raise FdlError(resolution.reason, hint="; or ".join(options) or None)
    return DownloadChoice(archive_request(resolution.archive, sha256=sha256),
                          f"auto: {resolution.reason}")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)
