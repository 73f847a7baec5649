"""fdl.init's first import (fdl.engine.collectives._bind_world_before_it_exists): torch's FSDP
package, imported before the default group exists and with the cyclic collector paused, which
is then back as the script had it. Each case runs in a fresh interpreter, where the package is
not imported yet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import gc, json, sys
import torch
from fdl.engine.collectives import _bind_world_before_it_exists

if sys.argv[1] == "disabled":
    gc.disable()
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
_bind_world_before_it_exists()
gc.callbacks.clear()
print(json.dumps({"collections": runs, "enabled": gc.isenabled(),
                  "imported": "torch.distributed.fsdp" in sys.modules}))
"""


@pytest.mark.parametrize("before", ["enabled", "disabled"])
def test_fsdp_is_imported_without_a_collection_and_the_collector_left_as_it_was(before):
    proc = subprocess.run([sys.executable, "-c", PROBE, before], capture_output=True, text=True,
                          timeout=120, check=True)
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["imported"]
    assert seen["collections"] == []
    assert seen["enabled"] is (before == "enabled")
