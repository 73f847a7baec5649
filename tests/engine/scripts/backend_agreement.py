"""One rank of a real 2-process gloo group agreeing on the averaging backend: for each CLAIM
(1: this rank could use NCCL, 0: it could not) it calls fdl's agreed_backend("auto", ...) with
the trainer's own all-reduce MIN, and writes the answers to OUT/rank<r>.json.
Usage: backend_agreement.py INIT_FILE RANK OUT CLAIM..."""

import json
import os
import sys

import torch.distributed as dist

from fdl.engine.collectives import agreed_backend, all_true

init_file, rank, out, claims = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
answers = [agreed_backend("auto", can_nccl=claim == "1", all_can_nccl=all_true)
           for claim in claims]
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(answers, handle)
dist.destroy_process_group()
