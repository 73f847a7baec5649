"""fdl.launch.startup: the garbage collections fdl run skips while importing torch, and only
while torch is not imported yet."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from fdl.launch.startup import torch_import_without_collections


def test_torch_is_imported_with_collections_paused_then_frozen():
    code = (
        "import gc, sys\n"
        "from fdl.launch.startup import torch_import_without_collections\n"
        "with torch_import_without_collections():\n"
        "    during = gc.isenabled()\n"
        "    import torch.distributed.launcher.api\n"
        "print(during, gc.isenabled(), gc.get_freeze_count() > 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.split() == ["False", "True", "True"]


@pytest.mark.parametrize("reason", ["torch imported", "collector off"])
def test_nothing_changes_once_torch_is_imported_or_the_collector_is_off(reason, monkeypatch):
    import torch  # noqa: F401  (the first case: torch is already imported)

    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    if reason == "collector off":  # and torch not imported yet: only the collector decides
        monkeypatch.delitem(sys.modules, "torch")
        gc.disable()
    try:
        with torch_import_without_collections():
            assert gc.isenabled() == (reason == "torch imported")
        assert gc.isenabled() == (reason == "torch imported")
        assert gc.get_freeze_count() == frozen
    finally:
        if enabled:
            gc.enable()
