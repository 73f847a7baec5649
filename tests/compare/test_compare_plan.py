"""`fdl compare`'s plan (pure: the cells and their exact fdl run argv), the options it refuses,
the compare directory it refuses, and how a cell's run directory is read back: a finished run
of this very cell, or a clear reason why not (no summary, garbage, NaN, another plan)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from fdl.compare.plan import CompareRequest, canonical_flags, parse_policies, plan_compare
from fdl.compare.results import RunUnusable, load_run_result
from fdl.compare.run import check_out_dir
from fdl.errors import UsageError
from fdl.rundir.config import matches_launch

NOW = datetime(2026, 11, 21, 14, 30, 5, tzinfo=timezone.utc)


def plan_of(tmp_path: Path, *, digest: str = "ab12", **request):
    defaults = {"script": "train.py", "policies": ("sync", "async")}
    return plan_compare(CompareRequest(**{**defaults, **request}), cwd=tmp_path, now=NOW,
                        base_seed=7, script_sha256=digest)


def test_cells_go_seed_by_seed_with_the_exact_fdl_run_argv(tmp_path):
    plan = plan_of(tmp_path, script_args=("--lr", "0.1"), num_seeds=2,
                   flags={"nproc_per_node": "2", "simulate_slowdown": "1, 2.5",
                          "quiet_ranks": True, "max_restarts": None})
    out = tmp_path / "runs" / "compare-20261121T143005Z-train"
    assert plan.out == out
    assert [(c.policy, c.seed, c.name) for c in plan.cells] == [
        ("sync", 7, "sync-seed7"), ("async", 7, "async-seed7"),
        ("sync", 8, "sync-seed8"), ("async", 8, "async-seed8")]
    assert plan.cells[1].argv == (
        sys.executable, "-m", "fdl", "run", "--nproc-per-node", "2", "--quiet-ranks",
        "--simulate-slowdown", "1,2.5", "--policy", "async", "--seed", "7",
        "--run-dir", str(out / "async-seed7"), str(tmp_path / "train.py"), "--", "--lr", "0.1")
    assert plan.cells[1].log == out / "async-seed7.log"
    assert plan.identity == {"script": str(tmp_path / "train.py"), "script_sha256": "ab12",
                             "args": ["--lr", "0.1"],
                             "options": {"nproc_per_node": "2", "quiet_ranks": True,
                                         "simulate_slowdown": "1,2.5"}}


def test_a_given_seed_is_the_base_and_out_is_taken_as_given(tmp_path):
    plan = plan_of(tmp_path, flags={"seed": "3"}, out=Path("cmp"), policies=("cadence",))
    assert plan.out == tmp_path / "cmp"
    assert plan.cells[0].argv[4:] == ("--policy", "cadence", "--seed", "7", "--run-dir",
                                      str(tmp_path / "cmp" / "cadence-seed7"),
                                      str(tmp_path / "train.py"))  # base_seed is the caller's
    assert plan.identity["options"] == {"seed": "3"}  # the base names the compare


@pytest.mark.parametrize(("flags", "message", "hint"), [
    ({"policy": "sync"}, "--policy is fdl compare's to set", "use --policies"),
    ({"run_dir": "x"}, "--run-dir is fdl compare's to set", "use --out DIR"),
    ({"resume": "x"}, "--resume is fdl compare's to set", "use the same --out"),
    ({"overwrite_run_dir": True}, "--overwrite-run-dir is fdl compare's to set", "a new --out"),
    ({"epochs": "0"}, "--epochs: epochs must be a whole number in [1, 1000000], got '0'",
     "whole number"),
])
def test_options_fdl_compare_owns_or_that_are_bad_are_usage_errors(flags, message, hint):
    with pytest.raises(UsageError) as caught:
        canonical_flags(flags)
    assert caught.value.message == message and hint in caught.value.hint


def test_policies_are_checked_and_kept_once_in_order():
    assert parse_policies("async, sync,async") == ("async", "sync")
    with pytest.raises(UsageError, match="--policies: unknown policy 'fast'"):
        parse_policies("sync,fast")
    with pytest.raises(UsageError, match="names no policy"):
        parse_policies(" , ")


def test_the_compare_directory_must_be_new_empty_or_this_compare(tmp_path):
    plan = plan_of(tmp_path, out=Path("cmp"))
    check_out_dir(plan)  # absent
    plan.out.mkdir()
    check_out_dir(plan)  # empty
    (plan.out / "plan.json").write_text(json.dumps({"schema": 1, **plan.to_dict()}))
    check_out_dir(plan)  # this compare
    check_out_dir(plan_of(tmp_path, out=Path("cmp"), policies=("sync",), num_seeds=3))
    with pytest.raises(UsageError) as caught:
        check_out_dir(plan_of(tmp_path, out=Path("cmp"), script_args=("--lr", "1")))
    assert caught.value.message == (f"--out {plan.out} holds another compare "
                                    f"({tmp_path / 'train.py'} with no fdl run option)")
    with pytest.raises(UsageError) as caught:
        check_out_dir(plan_of(tmp_path, out=Path("cmp"), digest="cd34"))
    assert caught.value.message == (f"--out {plan.out} holds another compare (of "
                                    f"{tmp_path / 'train.py'} as it was before an edit)")
    (plan.out / "plan.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot be read as fdl compare's plan"):
        check_out_dir(plan)


def test_a_directory_with_other_files_is_refused(tmp_path):
    plan = plan_of(tmp_path, out=Path("cmp"))
    plan.out.mkdir()
    (plan.out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="is not empty and holds no fdl compare"):
        check_out_dir(plan)


# --- reading a run back ----------------------------------------------------------------------

EXPECTED = {"script": "/x/train.py", "args": [], "module": False, "nproc_per_node": 2,
            "settings": {"policy": "sync", "seed": 7, "simulate_slowdown": [1.0, 2.5]}}


def write_run(run_dir: Path, *, summary: dict | None = None, metrics: list | None = None,
              settings: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    config = {"fdl_version": "0", "script": "/x/train.py", "args": [], "module": False,
              "nproc_per_node": 2, "settings": {
                  name: {"value": value, "source": "flag"}
                  for name, value in (settings or EXPECTED["settings"]).items()}}
    (run_dir / "config.json").write_text(json.dumps(config))
    base = {"policy": "sync", "backend": "cpu", "world_size": 2, "epochs": 2, "samples": 200,
            "wall_s": 4.0, "throughput": {"samples_per_s": 50.0,
                                          "per_rank_samples_per_s": [25.0, 25.0]},
            "sync": {"rounds": 3, "mean_ms": 1.0, "overhead": 0.01}, "emulated_slowdown": None,
            "idle_fraction": [0.1, 0.3], "eval": {"accuracy": 0.8}, "final_loss": 0.4}
    (run_dir / "summary.json").write_text(json.dumps({**base, **(summary or {})}))
    lines = metrics if metrics is not None else [
        {"epoch": 1, "samples": 100, "train_loss": 0.9, "eval": {"accuracy": 0.6},
         "samples_per_s": 50.0},
        {"epoch": 2, "samples": 200, "train_loss": 0.4, "eval": {"accuracy": 0.8},
         "samples_per_s": 50.0, "elapsed_s": 3.5}]
    (run_dir / "metrics.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return run_dir


def test_a_finished_run_is_read_back(tmp_path):
    result = load_run_result(write_run(tmp_path / "r"), expected=EXPECTED)
    assert (result.world_size, result.samples_per_s, result.wall_s) == (2, 50.0, 4.0)
    assert result.idle_fraction == pytest.approx(0.2) and result.sync_overhead == 0.01
    assert result.final_loss == 0.4 and result.eval == {"accuracy": 0.8}
    # elapsed_s when the line has it, else samples / samples_per_s
    assert [p.elapsed_s for p in result.curve] == [2.0, 3.5]


@pytest.mark.parametrize(("damage", "needle"), [
    ({"summary": {"eval": {"accuracy": float("nan")}}}, "summary.json: eval.accuracy is nan"),
    ({"summary": {"throughput": {"samples_per_s": None, "per_rank_samples_per_s": [1, 1]}}},
     "throughput.samples_per_s is None, expected a finite number"),
    ({"summary": {"world_size": "two"}}, "summary.json: world_size is \"two\""),
    ({"metrics": [{"epoch": 1, "samples": 100, "train_loss": float("nan"),
                   "samples_per_s": 5.0}]}, "metrics.jsonl:1: train_loss is nan"),
    ({"metrics": ["garbage"]}, "metrics.jsonl:1: not a JSON record"),
    ({"metrics": []}, "metrics.jsonl: no epoch recorded"),
    ({"metrics": [{"epoch": 1, "samples": 100, "train_loss": 1.0, "samples_per_s": 0}]},
     "samples_per_s is 0.0, expected a number > 0"),
    ({"settings": {"policy": "sync", "seed": 8, "simulate_slowdown": [1.0, 2.5]}},
     "config.json does not match this cell's plan"),
])
def test_an_unusable_run_says_which_file_and_what(tmp_path, damage, needle):
    run_dir = write_run(tmp_path / "r", **damage)
    with pytest.raises(RunUnusable) as caught:
        load_run_result(run_dir, expected=EXPECTED)
    assert needle in caught.value.message and "reruns this cell" in caught.value.hint


def test_a_run_without_summary_is_unusable(tmp_path):
    run_dir = write_run(tmp_path / "r")
    (run_dir / "summary.json").unlink()
    with pytest.raises(RunUnusable, match=r"has no summary\.json"):
        load_run_result(run_dir)


def test_config_matches_every_planned_value():
    config = {"script": "/x/train.py", "args": [], "module": False, "nproc_per_node": 2,
              "settings": {k: {"value": v} for k, v in EXPECTED["settings"].items()}}
    assert matches_launch(config, identity=EXPECTED)
    assert not matches_launch({**config, "args": ["--lr", "1"]}, identity=EXPECTED)
    assert not matches_launch({**config, "settings": {}}, identity=EXPECTED)
    assert not matches_launch({**config, "settings": "x"}, identity=EXPECTED)
