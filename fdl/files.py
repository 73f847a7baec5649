"""Atomic file writes: the one way fdl replaces a file others may read (config.json,
summary.json, metrics.jsonl, checkpoint manifests, timeline and bench reports, the libtorch
store's metadata). A reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> Path:
    """Write ``data`` to a unique temporary file beside ``path`` and rename it over ``path``;
    ``durable`` also flushes it to disk first (for what a crash must not lose). Returns
    ``path``. On any failure the temporary file is removed and ``path`` is left as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; fdl's files are as readable as their dir
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
