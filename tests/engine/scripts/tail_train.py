"""fdl.Trainer under sync on NUM_SAMPLES samples, batch 4, 2 epochs: with two workers and
NUM_SAMPLES = 8k + 3 each epoch's last round gives rank 0 a partial batch and rank 1 nothing.
Settings come from fdl run. Writes the consensus model to OUT/rank<r>.pt.
Usage: tail_train.py OUT NUM_SAMPLES"""

import os
import sys

import torch
from common import build_model, build_optimizer, make_data, train_step

import fdl

out, num_samples = sys.argv[1], int(sys.argv[2])
result = fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
                     train_data=make_data(num_samples, seed=1), batch_size=4, epochs=2,
                     policy="sync", seed=7).fit()
torch.save(result.model.state_dict(), os.path.join(out, f"rank{os.environ.get('RANK', '0')}.pt"))
