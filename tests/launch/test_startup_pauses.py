"""fdl.launch.startup: the pauses fdl run skips before its workers start, and nothing else."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from fdl.launch.startup import no_join_stagger, torch_import_without_collections


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
    assert "torch" in sys.modules  # this module imported it
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


def test_only_the_random_join_stagger_is_skipped(monkeypatch):
    pauses: list[object] = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: pauses.append(seconds))
    original = dynamic_rendezvous._delay
    with no_join_stagger():
        dynamic_rendezvous._delay(seconds=(0, 0.3))  # the first join's stagger
        dynamic_rendezvous._delay(seconds=1)  # the poll while waiting for other nodes
    assert pauses == [1]
    assert dynamic_rendezvous._delay is original
    dynamic_rendezvous._delay(seconds=(0, 0.3))
    assert pauses == [1, (0, 0.3)]
