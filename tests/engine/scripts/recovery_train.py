"""fdl.Trainer on the common task, long enough to be killed mid-run; settings come from fdl run.
Usage: recovery_train.py OUT NUM_SAMPLES. Writes OUT/rank<r>.json (final metrics, history)."""

import json
import os
import sys

from common import build_model, build_optimizer, evaluate, make_data, train_step

import fdl

out, num_samples = sys.argv[1], int(sys.argv[2])
result = fdl.Trainer(
    model=build_model, optimizer=build_optimizer, train_step=train_step,
    train_data=make_data(num_samples, seed=1), eval_data=make_data(512, seed=2),
    evaluate=evaluate, batch_size=32, epochs=4, policy="cadence", seed=7,
).fit()
rank = os.environ.get("RANK", "0")
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({"metrics": result.metrics, "history": result.history,
               "summary": result.summary}, handle)
