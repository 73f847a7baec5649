"""`fdl compare` end to end: two real `fdl run` cells (sync and cadence, 2 gloo CPU workers, one
epoch of a tiny script), compare.json / compare.md / compare.png checked against each run's own
files, a second invocation with the same --out that reruns nothing, a damaged run that the next
invocation plans to rerun, and the refusals that start nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_error, run_fdl

SCRIPT = Path(__file__).parent.parent / "engine" / "scripts" / "compare_train.py"
ARGS = ["compare", str(SCRIPT), "--policies", "sync,cadence", "--epochs", "1",
        "--nproc-per-node", "2", "--quiet-ranks", "--out", "cmp", "--lr", "0.2"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("compare")
    first = run_fdl(*ARGS, "--json", cwd=cwd, timeout=240)
    assert first.returncode == 0, first.stderr
    out = cwd / "cmp"
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")}
    second = run_fdl(*ARGS, cwd=cwd, timeout=240)
    return cwd, out, first, second, mtimes


def summary(out: Path, name: str) -> dict:
    return json.loads((out / name / "summary.json").read_text())


def median(figure: dict | None) -> float | None:
    return None if figure is None else figure["median"]


def test_each_policy_ran_once_in_its_own_run_directory(compared):
    _, out, first, _, _ = compared
    assert sorted(p.name for p in out.iterdir()) == [
        "cadence-seed42", "cadence-seed42.log", "compare.json", "compare.md", "compare.png",
        "plan.json", "sync-seed42", "sync-seed42.log"]
    for policy in ("sync", "cadence"):
        found = summary(out, f"{policy}-seed42")
        assert (found["policy"], found["world_size"], found["epochs"]) == (policy, 2, 1)
    lines = first.stderr.splitlines()
    assert "[1/2] sync seed 42 ..." in lines and "[2/2] cadence seed 42 ..." in lines
    assert any(line.startswith("[rank 0] epoch 1/1") for line in lines)  # the cell's output


def test_compare_json_holds_each_runs_own_figures(compared):
    _, out, first, _, _ = compared
    document = json.loads((out / "compare.json").read_text())
    assert json.loads(first.stdout)["rows"] == document["rows"]  # --json: that document only
    assert (document["schema"], document["policies"], document["seeds"]) == (
        1, ["sync", "cadence"], [42])
    assert document["options"] == {"epochs": "1", "nproc_per_node": "2", "quiet_ranks": True}
    assert document["args"] == ["--lr", "0.2"] and document["metric"] == "accuracy"
    rows = {row["policy"]: row for row in document["rows"]}
    for policy in ("sync", "cadence"):
        found, row = summary(out, f"{policy}-seed42"), rows[policy]
        assert row["samples_per_s"]["median"] == found["throughput"]["samples_per_s"]
        assert row["eval"]["accuracy"]["median"] == found["eval"]["accuracy"]
        assert row["final_loss"]["median"] == pytest.approx(found["final_loss"])
        assert median(row["sync_overhead"]) == found["sync"]["overhead"]  # None: no sync
        idle = found["idle_fraction"]
        assert row["idle_fraction"]["median"] == pytest.approx(sum(idle) / len(idle))
    sync_rate = rows["sync"]["samples_per_s"]["median"]
    assert rows["cadence"]["speedup_vs_sync"] == pytest.approx(
        rows["cadence"]["samples_per_s"]["median"] / sync_rate)
    assert rows["sync"]["reached_sync_loss"] == 1  # sync reaches its own final loss
    assert document["recommendation"]["policy"] in ("sync", "cadence")
    assert "based on 1 epoch x 1 seed on this machine" in document["recommendation"]["text"]
    assert document["recommendation"]["thin_evidence"] is True


def test_compare_md_shows_the_table_recommendation_and_plot(compared):
    _, out, _, _, _ = compared
    markdown = (out / "compare.md").read_text()
    document = json.loads((out / "compare.json").read_text())
    for policy in ("sync", "cadence"):
        found = summary(out, f"{policy}-seed42")
        rate = f"{found['throughput']['samples_per_s']:,.0f}"
        assert f"| {policy} | 1/1 | {rate} |" in markdown
        assert f"| {policy} | {found['final_loss']:.4f} | {found['eval']['accuracy']:.4f} |" \
            in markdown
    assert document["recommendation"]["text"] in markdown
    assert "![compare.png](compare.png)" in markdown
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_same_command_again_reruns_nothing(compared):
    _, out, _, second, mtimes = compared
    assert second.returncode == 0, second.stderr
    assert len(mtimes) == 2
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")} == mtimes
    lines = second.stderr.splitlines()
    assert "[1/2] sync seed 42 finished earlier: kept" in lines
    assert "[2/2] cadence seed 42 finished earlier: kept" in lines
    assert not any(line.startswith("fdl run:") for line in lines)
    assert "recommendation: " in second.stdout and str(out / "compare.md") in second.stdout


def test_a_damaged_run_is_planned_again(compared):
    cwd, out, _, _, _ = compared
    metrics = out / "cadence-seed42" / "metrics.jsonl"
    kept = metrics.read_text()
    record = json.loads(kept.splitlines()[-1])
    metrics.write_text(json.dumps({**record, "train_loss": float("nan")}) + "\n")
    try:
        proc = run_fdl(*ARGS, "--dry-run", cwd=cwd)
    finally:
        metrics.write_text(kept)
    assert proc.returncode == 0, proc.stderr
    assert "[1/2] sync seed 42 (finished: kept)" in proc.stdout
    assert "[2/2] cadence seed 42 (to run again: " in proc.stdout
    assert "metrics.jsonl" in proc.stdout.split("[2/2] cadence seed 42 (to run again: ")[1]


def test_another_compare_in_the_same_directory_is_refused(compared):
    cwd, out, _, _, _ = compared
    other = [word if word != "sync,cadence" else "sync" for word in ARGS]
    assert run_fdl(*other, "--dry-run", cwd=cwd).returncode == 0  # fewer policies: same compare
    proc = run_fdl(*[w if w != "0.2" else "0.3" for w in ARGS], cwd=cwd)
    assert_one_error(proc, 2, f"--out {out} holds another compare", "--lr 0.2")
    assert sorted(p.name for p in out.glob("*-seed*")) == [
        "cadence-seed42", "cadence-seed42.log", "sync-seed42", "sync-seed42.log"]


@pytest.mark.parametrize(("extra", "needle"), [
    (["--policy", "async"], "--policy is fdl compare's to set"),
    (["--run-dir", "x"], "--run-dir is fdl compare's to set"),
    (["--simulate-slowdown", "1,0"], "simulate_slowdown must be one factor in [1, 1000]"),
    (["--seeds", "0"], "--seeds"),
])
def test_bad_input_is_a_usage_error_and_starts_nothing(tmp_path, extra, needle):
    proc = run_fdl("compare", str(SCRIPT), "--out", "cmp", *extra, cwd=tmp_path)
    assert_one_error(proc, 2, needle)
    assert not (tmp_path / "cmp").exists()


def test_a_directory_that_is_no_compare_is_refused(tmp_path):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "notes.txt").write_text("mine")
    proc = run_fdl("compare", str(SCRIPT), "--out", "cmp", cwd=tmp_path)
    assert_one_error(proc, 2, "is not empty and holds no fdl compare")
    assert [p.name for p in (tmp_path / "cmp").iterdir()] == ["notes.txt"]
