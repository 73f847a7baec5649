"""A Trainer run that records, per rank, which interpreter ran it: OUT/rank<r>.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine" / "scripts"))
from common import build_model, build_optimizer, make_data, train_step

import fdl

out = Path(sys.argv[1])
result = fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
                     train_data=make_data(1024, seed=1), batch_size=32, epochs=2,
                     seed=3).fit()
Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"prefix": sys.prefix, "executable": sys.executable, "checksum": result.summary["checksum"],
     "backend": result.summary.get("backend")}))
