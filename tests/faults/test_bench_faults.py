"""Faults in ``fdl bench``'s inputs and in the sweep directory it reads back: one line, the
right exit code, nothing started."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import partial

import pytest
from helpers import assert_one_error, run_fdl
from torch.utils.data import Subset

from fdl.bench.cells import Cell
from fdl.bench.datasets import load_dataset
from fdl.bench.models import get_model
from fdl.bench.results import (
    append_record,
    build_record,
    check_record,
    load_results,
    write_sweep_json,
)
from fdl.engine.trainer import Trainer
from fdl.errors import FdlError

GOOD = {"model": "mlp", "mode": "solo@1x", "policy": "solo", "backend": "cpu", "seed": 0,
        "world_size": 1, "slowdown": [1.0], "eval": 0.9, "wall_s": 1.0, "samples_per_s": 10.0,
        "history": [{"epoch": 1, "train_loss": 0.5, "eval": 0.9}]}


@pytest.mark.parametrize("out", ["afile/sub", "afile"])
def test_an_unusable_out_dir_is_one_line_before_anything_runs(tmp_path, out):
    (tmp_path / "afile").write_text("not a directory\n")
    result = run_fdl("bench", "--model", "logreg", "--dataset", "synthetic", "--mode",
                     "solo@1x", "--out", out, cwd=tmp_path)
    assert_one_error(result, 2, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made, no runs/


def test_a_sweep_json_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "sweep.json").write_bytes(b"\xff\xfe{}")
    result = run_fdl("bench", "report", str(tmp_path))
    assert_one_error(result, 2, "sweep.json is not UTF-8")  # as fdl report: not a sweep's


@pytest.mark.parametrize(("meta", "problem"), [
    ("[1, 2]", "expected an object"),
    ('{"machine": "x"}', "expected an object"),
    ("{", "not JSON"),
])
def test_a_malformed_sweep_json_is_named(tmp_path, meta, problem):
    (tmp_path / "results.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "sweep.json").write_text(meta)
    with pytest.raises(FdlError, match=problem):
        load_results(tmp_path)


@pytest.mark.parametrize(("change", "field"), [
    ({"mode": 3}, "mode"),
    ({"model": ""}, "model"),
    ({"samples_per_s": "fast"}, "samples_per_s"),
    ({"eval": True}, "eval"),
    ({"world_size": 1e9}, "world_size"),
    ({"world_size": 10**9}, "world_size"),
    ({"slowdown": "1,2.5"}, "slowdown"),
    ({"slowdown": [1, 0]}, "slowdown"),
    ({"history": {"epoch": 1}}, "history"),
    ({"history": [{"epoch": "one", "train_loss": 1.0}]}, "history"),
])
def test_a_record_with_a_wrong_field_is_reported_by_line_and_field(tmp_path, change, field):
    lines = [json.dumps(GOOD), json.dumps({**GOOD, **change}), json.dumps(GOOD)]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(FdlError, match=rf"results.jsonl:2: field '{field}'"):
        load_results(tmp_path)


def test_the_records_fdl_writes_pass_the_check_including_a_diverged_loss(tmp_path, monkeypatch):
    """A record fdl bench itself builds (fdl.bench.results.build_record) from a real run
    directory: the autoencoder cell on the synthetic set, trained solo in-process with its LR
    made infinite so that it diverges. Its loss and its eval (mse) are NaN, as a diverged cell's
    are, and the record still reads back: a diverged run is a result too."""
    out, run_dir = tmp_path / "out", tmp_path / "out" / "runs" / "cell"
    model = replace(get_model("autoencoder"), lr=math.inf)
    splits = load_dataset("synthetic", data_dir=tmp_path / "data", download=False)
    monkeypatch.setenv("FDL_RUN_DIR", str(run_dir))
    Trainer(model=partial(model.build, splits.meta), optimizer=model.make_optimizer,
            train_step=model.train_step, evaluate=model.evaluate,
            train_data=Subset(splits.train, range(256)), eval_data=Subset(splits.test, range(64)),
            batch_size=model.batch_size, epochs=1).fit()
    cell = Cell("autoencoder", "synthetic", "solo@1x", "solo", None, 0, 1, (1.0,), 1)
    append_record(out / "results.jsonl", build_record(cell, run_dir=run_dir, out_dir=out))

    records, _ = load_results(out)
    assert len(records) == 1 and check_record(records[0]) is None
    record = records[0]
    assert math.isnan(record["eval"]) and math.isnan(record["history"][0]["train_loss"])
    assert (record["model"], record["metric"], record["run_dir"]) == ("autoencoder", "mse",
                                                                      "runs/cell")
    assert check_record([record]) == "expected a JSON object, got list"


@pytest.mark.parametrize("previous", [b"\xff\xfe", b"[1]", b'{"sessions": 3}'])
def test_a_hostile_sweep_json_is_started_anew_by_the_next_sweep(tmp_path, previous):
    (tmp_path / "sweep.json").write_bytes(previous)
    write_sweep_json(tmp_path, machine={}, args={"models": ["mlp"]}, num_cells=2, num_skipped=0)
    meta = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["cells"] for s in meta["sessions"]] == [2]
