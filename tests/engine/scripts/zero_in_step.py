"""fdl.Trainer with torch's ZeroRedundancyOptimizer, whose step broadcasts the shards: fine
under sync (every rank steps together), a hang under cadence and async, which fdl refuses.
Settings come from fdl run. Usage: zero_in_step.py"""

import torch
from common import build_model, make_data, train_step
from torch.distributed.optim import ZeroRedundancyOptimizer

import fdl

fdl.Trainer(
    model=build_model,
    optimizer=lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD,
                                                     lr=0.1),
    train_step=train_step, train_data=make_data(512, seed=1), batch_size=32, epochs=1,
).fit()
