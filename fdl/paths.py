"""Where fdl keeps things. Every path is computed when asked for, never at import time.

* ``FLODL_HOME`` (default ``~/.flodl``): the libtorch store and other state shared with flodl.
* cache and config directories: platformdirs' per-user locations for ``fdl``, overridable with
  ``FDL_CACHE_DIR`` / ``FDL_CONFIG_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path


def flodl_home() -> Path:
    value = os.environ.get("FLODL_HOME")
    return Path(value).expanduser() if value else Path.home() / ".flodl"


def libtorch_root() -> Path:
    return flodl_home() / "libtorch"


def cache_dir() -> Path:
    value = os.environ.get("FDL_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fdl"))


def config_dir() -> Path:
    value = os.environ.get("FDL_CONFIG_DIR")
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_config_dir("fdl"))
