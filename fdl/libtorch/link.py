"""``fdl libtorch link-python``: the libtorch inside a torch wheel, registered in the store.

The wheel already ships ``lib/``, ``include/`` and ``share/cmake/Torch``; the store gets a
``python/torch-<version>`` variant made of symlinks to them (nothing is downloaded), so CMake and
cargo builds use exactly the libtorch that Python's torch runs on.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from fdl.errors import FdlError, MissingTorchError
from fdl.libtorch.store import Store, Variant
from fdl.libtorch.validate import check_variant_name


def link_python(store: Store, *, python: str | None = None) -> Variant:
    """Register the libtorch inside ``python``'s torch wheel as ``python/torch-<version>``:
    symlinks to the wheel's ``lib``, ``include`` and ``share`` (nothing is downloaded).
    torch is probed in a child interpreter, never imported here."""
    from fdl.system.torchenv import probe_torch

    info = probe_torch(python=python or sys.executable)
    if info.error:
        raise FdlError(f"cannot read the torch of {info.python}: {info.error}",
                       hint="`fdl diagnose` shows the state of the torch install")
    if not info.installed or not info.path:
        raise MissingTorchError("`fdl libtorch link-python`")
    wheel = Path(info.path).resolve()
    missing = [part for part in ("lib", "include", "share/cmake/Torch")
               if not (wheel / part).is_dir()]
    if missing:
        raise FdlError(f"the torch wheel at {wheel} has no {', '.join(missing)}; "
                       "it cannot serve as a libtorch",
                       hint="use `fdl libtorch download` for a standalone libtorch")
    name = check_variant_name(f"torch-{info.version}")
    meta = {"version": info.version, "cuda": info.cuda_version, "archs": list(info.arch_list),
            "source": "python", "wheel_path": str(wheel), "python": info.python}
    staged = Path(tempfile.mkdtemp(prefix="link-", dir=store.staging()))
    try:
        staged.chmod(0o755)
        for part in ("lib", "include", "share"):
            (staged / part).symlink_to(wheel / part, target_is_directory=True)
        return store.install(kind="python", name=name, tree=staged, meta=meta)
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # gone already when the install took it
