"""fdl.Trainer on a tiny task (3 epochs) that stops itself in one of two ways, so a test can watch
how fdl run ends. Usage: stopped_train.py OUT MODE

* ``hold``: in the second epoch (once the first epoch's record and, when the run writes
  checkpoints, its checkpoint are in place) each rank writes its pid to OUT/held-<rank> and
  waits, until the test interrupts the run (a 120 s guard keeps a broken test from hanging);
* ``crash``: rank 1's third step raises (a shape bug in the loss), the others train on.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

out, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
run_dir = Path(os.environ["FDL_RUN_DIR"])
steps = 0


def make_data(num_samples, seed):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(features, (features[:, :4].sum(dim=1) > 0).long())


def first_epoch_done():
    checkpointed = any((path / "manifest.json").is_file()
                       for path in (run_dir / "checkpoints").glob("ckpt-r*"))
    return (run_dir / "metrics.jsonl").is_file() and (
        checkpointed or "FDL_CHECKPOINT_EVERY" not in os.environ)


def hold():
    (out / f"held-{rank}.tmp").write_text(str(os.getpid()))
    os.replace(out / f"held-{rank}.tmp", out / f"held-{rank}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


def train_step(model, batch):
    global steps
    steps += 1
    features, labels = batch
    logits = model(features)
    if mode == "hold" and first_epoch_done():
        hold()
    if mode == "crash" and rank == 1 and steps == 3:
        labels = labels[:3]
    return F.cross_entropy(logits, labels)


fdl.Trainer(
    model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), train_step=train_step,
    train_data=make_data(512, seed=1), batch_size=16, epochs=3, seed=3,
).fit()
