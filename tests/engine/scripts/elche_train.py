"""fdl.Trainer on the common task; settings come from fdl run. Writes the returned consensus
model to OUT/rank<r>.pt and the metrics to OUT/rank<r>.json.
``--slow-eval S``: each evaluation batch also sleeps S seconds (an evaluation that costs time).
Usage: elche_train.py OUT [--batch-norm] [--policy P] [--scalar-bug] [--slow-eval S]"""

import json
import os
import sys
import time

import torch
from common import build_model, build_optimizer, evaluate, make_data, native_threads, train_step

import fdl

out = sys.argv[1]
batch_norm = "--batch-norm" in sys.argv
policy = sys.argv[sys.argv.index("--policy") + 1] if "--policy" in sys.argv else "cadence"
slow_eval = float(sys.argv[sys.argv.index("--slow-eval") + 1]) if "--slow-eval" in sys.argv \
    else 0.0


def evaluating(model, batch):
    time.sleep(slow_eval)  # the workload: an evaluation that takes time
    return evaluate(model, batch)


result = fdl.Trainer(
    model=lambda: build_model(batch_norm), optimizer=build_optimizer, train_step=train_step,
    train_data=make_data(1024, seed=1), eval_data=make_data(256, seed=2), evaluate=evaluating,
    batch_size=32, epochs=2, policy=policy, seed=7,
).fit()
rank = os.environ.get("RANK", "0")
torch.save(result.model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({"metrics": result.metrics, "history": result.history,
               "summary_policy": result.summary["policy"],
               "threads_after_finish": native_threads()}, handle)
