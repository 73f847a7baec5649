"""Where fdl keeps things. Every path is computed when asked for, never at import time.

* ``FLODL_HOME`` (default ``~/.flodl``): the libtorch store and other state shared with flodl;
  it must be a directory, or not exist yet.
* the cache directory: platformdirs' per-user location for ``fdl``, overridable with
  ``FDL_CACHE_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path


def flodl_home() -> Path:
    value = os.environ.get("FLODL_HOME")
    return Path(value).expanduser() if value else Path.home() / ".flodl"


def libtorch_root() -> Path:
    """``$FLODL_HOME/libtorch``; a ``ConfigError`` (exit 2) when FLODL_HOME, the store or the
    nearest of their parents that exists is not a directory (nothing can ever be kept there)."""
    home = flodl_home()
    root = home / "libtorch"
    existing = next((p for p in (root, home, *home.parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        from fdl.errors import ConfigError

        raise ConfigError(f"FLODL_HOME={home} cannot hold the libtorch store: {existing} is "
                          "not a directory",
                          hint="point FLODL_HOME at a directory (or unset it for ~/.flodl)")
    return root


def cache_dir() -> Path:
    value = os.environ.get("FDL_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fdl"))
