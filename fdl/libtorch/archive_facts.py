"""What a libtorch archive says about itself, and the store name ``--url`` gives it.

An official libtorch zip carries ``libtorch/build-version`` (one line, ``2.13.0+cu128``) and
``libtorch/include/caffe2/core/macros.h``, whose build strings hold ``{"CUDA_VERSION",
"12.8"}`` and, in ``CUDA_FLAGS``, the ``-gencode arch=compute_XX,code=sm_XX`` list it was built
for. :func:`read_archive_facts` reads those two members (nothing is extracted);
:func:`name_archive` (pure) turns the facts and the flags into the store name and metadata:

* the name is ``<version>-<tag>`` from build-version (``2.13.0-cu128``), never the URL's file
  name when the archive says it (``.../libtorch.zip`` would give a bare ``libtorch``);
* ``--version V`` must agree with the archive (a mismatch is an ``FdlError``, nothing is
  installed); it supplies the version when the archive has no build-version;
* ``--variant cpu|cuNNN|rocmX.Y`` must agree with the archive's tag likewise; any other
  ``--variant NAME`` is the store name itself (``site-build``);
* an archive that does not say its version and no ``--variant``: the URL's file name, when it
  gives a versioned name (``libtorch-...-2.13.0%2Bcpu.zip``), else an error asking for
  ``--variant``.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from fdl.errors import FdlError, UsageError
from fdl.libtorch.validate import NAME_RULE, is_variant_name

BUILD_VERSION = "build-version"
MACROS_H = "include/caffe2/core/macros.h"
_TAG = re.compile(r"^(cpu|cu\d{2,4}|rocm\d+(\.\d+)*)$")
# The prefixes of the official archive names, longest first: what is left names the variant.
_URL_PREFIXES = ("libtorch-win-shared-with-deps-", "libtorch-shared-with-deps-",
                 "libtorch-cxx11-abi-shared-with-deps-", "libtorch-")
_MAX_MEMBER = 1 << 20  # the members read are a few KB; a larger one is not what we look for


@dataclass(frozen=True)
class ArchiveFacts:
    build_version: str | None = None  # "2.13.0+cu128"
    cuda: str | None = None  # "12.8"
    archs: tuple[str, ...] = ()  # ("sm_61", "sm_120", "compute_120")

    @property
    def version(self) -> str | None:
        return self.build_version.split("+", 1)[0] if self.build_version else None

    @property
    def tag(self) -> str | None:
        if self.build_version and "+" in self.build_version:
            return self.build_version.split("+", 1)[1]
        return None


def read_archive_facts(archive: Path) -> ArchiveFacts:
    """The facts in ``archive``'s build-version and macros.h (either may be absent)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            members = {_strip_top(info.filename): info for info in zf.infolist()
                       if info.file_size <= _MAX_MEMBER}
            text = {key: zf.read(members[key]).decode("utf-8", "replace")
                    for key in (BUILD_VERSION, MACROS_H) if key in members}
    except (OSError, zipfile.BadZipFile) as exc:
        raise FdlError(f"cannot read {archive.name}: {exc}",
                       hint="the download is not a zip archive; check the URL") from exc
    version = text.get(BUILD_VERSION, "").strip() or None
    cuda, archs = parse_build_strings(text.get(MACROS_H, ""))
    return ArchiveFacts(version, cuda, archs)


def parse_build_strings(macros_h: str) -> tuple[str | None, tuple[str, ...]]:
    """CUDA version and target architectures from the text of ``caffe2/core/macros.h``."""
    match = re.search(r'\{"CUDA_VERSION",\s*"([^"]*)"\}', macros_h)
    cuda = match.group(1) if match and match.group(1) else None
    flags = re.search(r'\{"CUDA_FLAGS",\s*R?"(?:PYT\()?(.*?)(?:\)PYT)?"\}', macros_h, re.S)
    archs: list[str] = []
    for code in re.findall(r"code=\[?([\w,]+)\]?", flags.group(1) if flags else ""):
        archs.extend(part for part in code.split(",") if part not in archs)
    return cuda, tuple(archs)


def name_archive(facts: ArchiveFacts, *, url_name: str | None, variant: str | None,
                 version: str | None) -> tuple[str, dict[str, Any]]:
    """The store name and metadata for a ``--url`` archive (rules in the module docstring);
    ``url_name`` is the name the URL's file name gives, if any."""
    if version and facts.version and facts.version != version:
        raise FdlError(f"--version {version} does not match the archive, which is "
                       f"{facts.build_version} (its libtorch/build-version); nothing installed",
                       hint=f"drop --version, or pass --version {facts.version}")
    if variant and _TAG.match(variant) and facts.tag and facts.tag != variant:
        raise FdlError(f"--variant {variant} does not match the archive, which is "
                       f"{facts.build_version} (its libtorch/build-version); nothing installed",
                       hint=f"drop --variant, or pass --variant {facts.tag}")
    ver = facts.version or version
    tag = facts.tag or (variant if variant and _TAG.match(variant) else None)
    if variant and not _TAG.match(variant):
        name = variant
    elif ver and tag:
        name = f"{ver}-{tag}"
    elif url_name and url_name[:1].isdigit():
        name = url_name
    else:
        raise FdlError("the archive does not say its version (no libtorch/build-version) "
                       "and its URL gives no versioned name",
                       hint="name it with --variant NAME (e.g. --variant site-build) "
                            "or pass --version and --variant cpu|cuNNN")
    meta = {"version": ver, "variant": tag or name, "cuda": facts.cuda,
            "archs": list(facts.archs), "build_version": facts.build_version}
    return name, meta


def _strip_top(name: str) -> str:
    """``libtorch/build-version`` -> ``build-version`` (the one top folder of the archive)."""
    return name.split("/", 1)[1] if "/" in name else name


def name_from_url(url: str) -> str:
    """The variant name a URL's file name gives (``libtorch-...-2.13.0%2Bcpu.zip`` ->
    ``2.13.0-cpu``); a ``UsageError`` asking for ``--variant`` when that is no plain name."""
    stem = unquote(urlparse(url).path.rsplit("/", 1)[-1]).removesuffix(".zip")
    for prefix in _URL_PREFIXES:
        stem = stem.removeprefix(prefix)
    name = stem.replace("+", "-") or "custom"
    if not is_variant_name(name):
        raise UsageError(f"--url {url} gives the variant name {name!r}, which is not a plain "
                         f"directory name ({NAME_RULE})",
                         hint="name the variant with --variant NAME, e.g. --variant site-build")
    return name


def url_file_name(url: str) -> str | None:
    """The name a URL's file name gives, or None when it is no plain directory name."""
    try:
        return name_from_url(url)
    except UsageError:
        return None
