"""fdl.Trainer on the common task, long enough to be killed mid-run; settings come from fdl run.
The LR decays linearly to a tenth over the run (a schedule a resume must not apply twice).
Usage: recovery_train.py OUT NUM_SAMPLES. Writes OUT/rank<r>.json (final metrics, history, and
the LR of every param group at the end)."""

import json
import os
import sys

from common import build_model, build_optimizer, evaluate, make_data, train_step

import fdl

out, num_samples = sys.argv[1], int(sys.argv[2])
optimizers = []


def remember(params):
    optimizers.append(build_optimizer(params))
    return optimizers[-1]


result = fdl.Trainer(
    model=build_model, optimizer=remember, train_step=train_step,
    schedule=lambda progress: 1 - 0.9 * progress,
    train_data=make_data(num_samples, seed=1), eval_data=make_data(512, seed=2),
    evaluate=evaluate, batch_size=32, epochs=4, policy="cadence", seed=7,
).fit()
rank = os.environ.get("RANK", "0")
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({"metrics": result.metrics, "history": result.history, "summary": result.summary,
               "lrs": [group["lr"] for group in optimizers[-1].param_groups]}, handle)
