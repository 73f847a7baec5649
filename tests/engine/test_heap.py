"""The heap while a rank trains (fdl.engine.heap.frozen_heap): what exists when training starts
is frozen, so a full collection during training walks only what training made; it is given back
when training ends, and a process that froze objects itself or disabled the collector is left
alone. Each case runs in a fresh interpreter: the collector's state is the process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import clean_env

PROBE = """
import gc, json, sys
from fdl.engine.heap import frozen_heap

class Cycle:
    finalized = []
    def __init__(self, name):
        self.name, self.me = name, self
    def __del__(self):
        Cycle.finalized.append(self.name)

case = sys.argv[1]
seen = {}
if case == "user_froze":
    gc.freeze()
if case == "disabled":
    gc.disable()
before = gc.get_freeze_count()
kept = [Cycle("kept")]            # alive: frozen with the rest
Cycle("young")                    # garbage when training starts
try:
    with frozen_heap() as did:
        seen["did"] = did
        seen["finalized_at_start"] = list(Cycle.finalized)
        seen["inside"] = gc.get_freeze_count() - before
        Cycle("made_inside")
        gc.collect()
        seen["finalized_inside"] = list(Cycle.finalized)
        if case == "raises":
            raise RuntimeError("the script failed")
except RuntimeError:
    seen["raised"] = True
seen["after"] = gc.get_freeze_count() - before
seen["enabled"] = gc.isenabled()
print(json.dumps(seen))
"""


def probe(case: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, case], capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_training_runs_on_a_frozen_heap_that_is_given_back_when_it_ends():
    seen = probe("plain")
    assert seen["did"] is True
    assert seen["inside"] > 0 and seen["after"] == 0
    assert seen["finalized_at_start"] == ["young"]  # young garbage is not frozen
    assert seen["finalized_inside"] == ["young", "made_inside"]  # training's cycles still go


def test_the_heap_is_given_back_when_training_raises():
    seen = probe("raises")
    assert seen["raised"] and seen["inside"] > 0 and seen["after"] == 0


def test_a_process_that_froze_objects_itself_is_left_as_it_is():
    seen = probe("user_froze")
    assert seen["did"] is False
    assert seen["inside"] == 0 and seen["after"] == 0


def test_a_disabled_collector_is_left_disabled_and_nothing_frozen():
    seen = probe("disabled")
    assert seen["did"] is False
    assert seen["inside"] == 0 and seen["after"] == 0 and seen["enabled"] is False


LOOP = """
import gc, json, sys
import torch
from torch.utils.data import TensorDataset
import fdl

run = fdl.init(seed=0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
inside = []
for x, y in run.batches(data, model=model, optimizer=optimizer, batch_size=16, epochs=1):
    inside.append(gc.get_freeze_count())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    if sys.argv[1] == "break":
        break
after_loop = gc.get_freeze_count()
if sys.argv[1] == "whole":
    run.finish()
print(json.dumps({"inside": inside, "after_loop": after_loop}))
"""


@pytest.mark.parametrize("how", ["whole", "break"])
def test_a_loop_script_trains_on_the_frozen_heap_and_gets_it_back_when_it_leaves_the_loop(
        tmp_path, how):
    """fdl.init alone (one rank, no launcher): the model, the optimizer and everything torch made
    are frozen while the loop's body runs; the heap is the script's again after the loop, run to
    its end or left at its first batch."""
    proc = subprocess.run([sys.executable, "-c", LOOP, how], capture_output=True, text=True,
                          timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert len(seen["inside"]) == (4 if how == "whole" else 1) and min(seen["inside"]) > 0
    assert seen["after_loop"] == 0
