"""A loop script on fdl.init's API, in the shape the docs teach: accumulation, clipping, a cosine
LR on run.progress, an autocast region, run.log, run.state, run.evaluate. Settings come from
fdl run. Writes OUT/rank<r>.pt (the consensus model) and OUT/rank<r>.json (what it saw).

Usage: loop_train.py OUT [--accumulate K] [--epochs E] [--samples N] [--batch-norm] [--plain]
                     [--drop-last]
                     [--never-step] [--tick-every S] [--all-reduce-loss] [--scheduler]
                     [--all-reduce-by-name] [--driven [--sched-steps N] [--also-step]]
                     [--first-step-s S]

``--plain``: no schedule, no clipping (the step plain DDP's reference takes; with ``--clip``
clipping at 0.05, as the reference's ``--clip``); ``--never-step``:
a loop that forgets optimizer.step() (the engine must say so); ``--tick-every S``: the
liveness thread ticks every S seconds instead of every 2 (a tick nearly always in flight when
the worker exits); ``--all-reduce-loss``: an all-reduce of the loss in every step, as a
torchrun script logs it (``--all-reduce-by-name``: through ``all_reduce`` imported by name
before the run); ``--scheduler``: a torch LR scheduler made on the optimizer (never
stepped); ``--driven``: a OneCycleLR of ``run.total_steps`` steps (``--sched-steps N``: N) handed to
``run.batches(scheduler=)`` instead of the cosine on run.progress, which the script never steps
(``--also-step``: it steps it too, as it did before); ``--drop-last``: the data is a
``DataLoader(batch_size=32, shuffle=True, drop_last=True)``, as a script with BatchNorm has it;
``--first-step-s S``: the process's first batch takes S seconds more, as torch.compile's
compilation does.

It checks, batch by batch, the contract a loop relies on: the weights never change between two
batches of one accumulated step (no average lands mid-step), and ``run.progress`` never goes
back. Its ``Counter`` goes through run.state, so a resumed run continues the count.
"""

import json
import math
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
from common import build_model, evaluate, make_data, native_threads
from torch.distributed import all_reduce

import fdl
import fdl.engine.liveness
import fdl.engine.recorder


def flag(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


class Counter:
    """The steps this rank's optimizer took, across resumes (through run.state)."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


# a spy on the epoch end's own collective (fdl's epoch figures ride in the epoch's last average)
exchanges = []
_exchange_rows = fdl.engine.recorder.exchange_rows
fdl.engine.recorder.exchange_rows = lambda *a, **k: exchanges.append(1) or _exchange_rows(*a, **k)
out, accumulate = sys.argv[1], flag("--accumulate", 1)
fdl.engine.liveness.BEAT_S = flag("--tick-every", fdl.engine.liveness.BEAT_S)
plain, never_step = "--plain" in sys.argv, "--never-step" in sys.argv
run = fdl.init(seed=7)
model = build_model("--batch-norm" in sys.argv).to(run.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if "--scheduler" in sys.argv:  # made, never stepped: the LR stays the loop's own
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=10**6)
train_set, driven = make_data(flag("--samples", 1024), seed=1), None
if "--drop-last" in sys.argv:
    train_set = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True,
                                            drop_last=True)
if "--driven" in sys.argv:
    total = flag("--sched-steps", run.total_steps(train_set, batch_size=32,
                                                  epochs=flag("--epochs", 2),
                                                  accumulate=accumulate))
    driven = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
counter = Counter()
run.state(counter=counter)
run.evaluate(make_data(256, seed=2), evaluate)
seen = {"batches": 0, "mid_step_changes": 0, "progress_back": 0, "resumed_steps": None,
        "autocast_dtypes": [], "averages": 0, "epoch_ends": 0, "samples": 0,
        "batch_sizes": [], "lrs": []}
run.after_average(lambda: seen.update(averages=seen["averages"] + 1))
run.at_epoch_end(lambda record: seen.update(epoch_ends=record["epoch"]))
last_progress, after = 0.0, None
for index, (features, labels) in enumerate(run.batches(
        train_set, model=model, optimizer=optimizer, batch_size=32,
        epochs=flag("--epochs", 2), accumulate=accumulate, scheduler=driven)):
    if seen["resumed_steps"] is None:
        seen["resumed_steps"] = counter.steps
        time.sleep(flag("--first-step-s", 0.0))  # a compilation's once-only cost
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if index % accumulate and not torch.equal(weights, after):
        seen["mid_step_changes"] += 1
    if run.progress < last_progress:
        seen["progress_back"] += 1
    last_progress = run.progress
    if driven is not None:  # the step's LR, as the engine set it
        if index % accumulate == 0:
            seen["lrs"].append(optimizer.param_groups[0]["lr"])
    else:
        for group in optimizer.param_groups:
            group["lr"] = 0.1 if plain else 0.1 * 0.5 * (1 + math.cos(math.pi * run.progress))
    with run.autocast():
        logits = model(features)
        if len(seen["autocast_dtypes"]) < 1:
            seen["autocast_dtypes"].append(str(logits.dtype))
    loss = F.cross_entropy(logits.float(), labels)
    (loss / accumulate).backward()
    run.log(loss=loss)
    if "--all-reduce-loss" in sys.argv:  # a torchrun script's logging, left in
        torch.distributed.all_reduce(loss.detach().clone())
    if "--all-reduce-by-name" in sys.argv:  # the same, through the name imported above
        all_reduce(loss.detach().clone())
    seen["batches"] += 1
    seen["samples"] += len(labels)
    if len(labels) not in seen["batch_sizes"]:
        seen["batch_sizes"].append(len(labels))
    if (index + 1) % accumulate == 0 and not never_step:
        if "--clip" in sys.argv:  # tight enough to bind: clipping the mean, as DDP does
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif not plain:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        counter.steps += 1
        if "--also-step" in sys.argv:
            driven.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
result = run.finish()
rank = os.environ.get("RANK", "0")
torch.save(result.model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({**seen, "steps": counter.steps, "metrics": result.metrics,
               "scheduler_count": driven.last_epoch if driven is not None else None,
               "threads_after_finish": native_threads(),
               "python_threads_after_finish": [t.name for t in threading.enumerate()],
               "epoch_exchanges": len(exchanges),
               "history": result.history, "summary": result.summary,
               "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}, handle)
