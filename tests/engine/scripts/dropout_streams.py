"""fdl.Trainer with a dropout layer; records, at this rank's first step, the parameters it
starts from and the dropout mask it draws. Settings come from fdl run.
Usage: dropout_streams.py OUT. Writes OUT/rank<r>.pt: {"initial": state_dict, "mask": bool}."""

import os
import sys

import torch
from common import build_optimizer, make_data, train_step
from torch import nn

import fdl

out = sys.argv[1]
rank = os.environ.get("RANK", "0")
dropout = nn.Dropout(0.5)
seen: dict = {}


def record_mask(module, inputs, output):
    if "mask" not in seen:
        seen["mask"] = (output == 0) & (inputs[0] != 0)


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 64), dropout, nn.Tanh(), nn.Linear(64, 2))
    dropout.register_forward_hook(record_mask)
    return model


def first_step_recorder(model, batch):
    if "initial" not in seen:
        seen["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return train_step(model, batch)


fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=first_step_recorder,
            train_data=make_data(256, seed=1), batch_size=32, epochs=1, seed=7).fit()
torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
