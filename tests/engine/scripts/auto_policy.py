"""--policy auto in fdl.Trainer (default) or in a loop script (``--loop``), on the common task
with BatchNorm (sync averages its buffers only); settings come from fdl run. Writes the
consensus model to OUT/rank<r>.pt and the summary to OUT/rank<r>.json.

``--force P``: the rule's figures as measured, its pick replaced by P (sync, cadence or async).
A test seam of this script only: which policy the rule picks depends on this machine's speeds,
and the switch to sync must be checked whatever they are.

Usage: auto_policy.py OUT [--loop] [--force P] [--samples N]"""

import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
from common import build_model, build_optimizer, evaluate, make_data, train_step

import fdl
import fdl.engine.plan as plan
from fdl.engine.policies import policy_named

out = sys.argv[1]
if "--force" in sys.argv:
    chosen, rule = policy_named(sys.argv[sys.argv.index("--force") + 1]), plan.choose_policy

    def forced(**figures):
        return dataclasses.replace(rule(**figures), policy=chosen,
                                   reason=f"forced to {chosen.name} by the test")

    plan.choose_policy = forced  # what plan.auto_choice calls
samples = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 1024
data, eval_data = make_data(samples, seed=1), make_data(256, seed=2)
if "--loop" in sys.argv:
    run = fdl.init(seed=7)
    model = build_model(True).to(run.device)
    optimizer = build_optimizer(model.parameters())
    run.evaluate(eval_data, evaluate)
    for features, labels in run.batches(data, model=model, optimizer=optimizer, batch_size=32,
                                        epochs=2):
        F.cross_entropy(model(features), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    result = run.finish()
    model, summary = result.model, result.summary
else:
    trained = fdl.Trainer(
        model=lambda: build_model(True), optimizer=build_optimizer, train_step=train_step,
        train_data=data, eval_data=eval_data, evaluate=evaluate, batch_size=32, epochs=2,
        seed=7).fit()
    model, summary = trained.model, trained.summary
rank = os.environ.get("RANK", "0")
torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(summary, handle)
