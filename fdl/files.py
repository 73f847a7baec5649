"""Files several parts of fdl write and read.

* :func:`write_atomic` — the one way fdl replaces a file others may read (config.json,
  summary.json, metrics.jsonl, checkpoint manifests, timeline and bench reports, the libtorch
  store's metadata). A reader sees the old file or the new one, never half of either.
* :func:`read_jsonl` — the records of a JSON-lines file that fdl appends to while running
  (timelines, samples, metrics, bench results), tolerating the torn last line a killed writer
  leaves."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, skipping lines that do not parse (a writer killed
    mid-line) or are not objects; empty when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
