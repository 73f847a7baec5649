"""fdl bench's sweep report: aggregation over seeds, speedup and efficiency, impossible figures
flagged as measurement errors, Markdown, files."""

from __future__ import annotations

import json
import math
import sys

import pytest

from fdl.bench.results import load_results
from fdl.bench.sweep_report import build_report, loss_curve, render_markdown, write_report
from fdl.errors import FdlError

ROW_KEYS = ["model", "mode", "policy", "backend", "seeds", "eval", "eval_std", "reference",
            "wall_s", "samples_per_s", "speedup_vs_fast_solo", "efficiency_vs_ideal",
            "efficiency_by_seed", "measurement_error", "syncs", "sync_overhead", "idle_fraction"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MACHINE = {"cpu_model": "Test CPU 9000", "logical_cores": 8, "gpus": [], "date": "2026-01-02"}


def cell(model, mode, seed, *, eval_, sps, wall=10.0, syncs=None, overhead=None, idle=None,
         losses=(1.0, 0.5), reference=0.98):
    policy = "solo" if mode.startswith("solo") else mode.split("-")[0]
    if mode.startswith("solo@gpu"):
        slowdown, world_size = None, 1
    elif mode.startswith("solo@"):
        slowdown, world_size = [float(mode[5:-1])], 1
    elif mode.endswith("-nccl"):
        slowdown, world_size = None, 2
    else:
        slowdown, world_size = [1.0, 2.5], 2
    return {"model": model, "dataset": "digits", "mode": mode, "policy": policy,
            "backend": None if policy == "solo" else mode.split("-")[1], "seed": seed,
            "world_size": world_size, "slowdown": slowdown, "metric": "accuracy",
            "higher_is_better": True, "eval": eval_, "reference": reference,
            "reference_source": "test" if reference else None, "wall_s": wall,
            "samples": int(sps * wall), "samples_per_s": sps, "syncs": syncs,
            "sync_overhead": overhead, "idle_fraction": idle, "ideal_samples_per_s": None,
            "history": [{"epoch": e, "train_loss": loss, "eval": {"accuracy": 0.5}}
                        for e, loss in enumerate(losses, start=1)],
            "emulated": bool(slowdown) and any(f != 1.0 for f in slowdown),
            "run_dir": f"runs/{model}-{mode}-{seed}"}


def mlp_records():
    """Two seeds of every CPU mode, deliberately out of order (async first, solo last)."""
    return [
        cell("mlp", "async-cpu", 0, eval_=0.93, sps=1300.0, syncs=40, overhead=0.01, idle=0.0),
        cell("mlp", "async-cpu", 1, eval_=0.95, sps=1472.0, syncs=41, overhead=0.01, idle=0.02),
        cell("mlp", "sync-cpu", 0, eval_=0.96, sps=700.0, wall=20.0, syncs=100, overhead=0.1,
             idle=0.4),
        cell("mlp", "sync-cpu", 1, eval_=0.96, sps=840.0, wall=22.0, syncs=100, overhead=0.2,
             idle=0.5),
        cell("mlp", "cadence-cpu", 0, eval_=0.90, sps=1100.0, syncs=40, overhead=0.02, idle=0.05),
        cell("mlp", "cadence-cpu", 1, eval_=0.94, sps=1210.0, syncs=42, overhead=0.04, idle=0.07),
        cell("mlp", "solo@2.5x", 0, eval_=0.94, sps=400.0, wall=25.0),
        cell("mlp", "solo@2.5x", 1, eval_=0.96, sps=480.0, wall=27.0),
        cell("mlp", "solo@1x", 0, eval_=0.95, sps=1000.0, wall=10.0, losses=(1.0, 0.5)),
        cell("mlp", "solo@1x", 1, eval_=0.97, sps=1200.0, wall=12.0, losses=(0.8, 0.3)),
    ]


def rows_by_mode(report, model="mlp"):
    return {row["mode"]: row for row in report["rows"] if row["model"] == model}


def test_rows_are_ordered_solo_then_sync_cadence_async():
    report = build_report(mlp_records(), machine=MACHINE)
    assert [row["mode"] for row in report["rows"]] == [
        "solo@1x", "solo@2.5x", "sync-cpu", "cadence-cpu", "async-cpu"]
    assert [row["policy"] for row in report["rows"]] == ["solo", "solo", "sync", "cadence", "async"]
    assert all(list(row) == ROW_KEYS for row in report["rows"])
    assert list(report) == ["schema", "machine", "rows"] and report["schema"] == 1


def test_solo_rows_aggregate_over_seeds():
    rows = rows_by_mode(build_report(mlp_records(), machine=MACHINE))
    fast, slow = rows["solo@1x"], rows["solo@2.5x"]
    assert (fast["seeds"], fast["backend"], fast["reference"]) == (2, None, 0.98)
    assert fast["eval"] == pytest.approx(0.96, abs=1e-15)
    assert fast["eval_std"] == pytest.approx(0.01 * math.sqrt(2), rel=1e-9)  # sample std
    assert (fast["wall_s"], fast["samples_per_s"], fast["speedup_vs_fast_solo"]) == (
        11.0, 1100.0, 1.0)
    assert (slow["wall_s"], slow["samples_per_s"]) == (26.0, 440.0)
    assert slow["speedup_vs_fast_solo"] == 0.4
    for row in (fast, slow):  # figures that only exist with two workers
        assert [row[k] for k in ("efficiency_vs_ideal", "syncs", "sync_overhead",
                                 "idle_fraction")] == [None] * 4


def test_multi_worker_rows_speedup_and_efficiency_against_1x_plus_2_5x():
    rows = rows_by_mode(build_report(mlp_records(), machine=MACHINE))
    ideal = 1100.0 + 440.0  # solo@1x + solo@2.5x
    sync, cadence, run_async = rows["sync-cpu"], rows["cadence-cpu"], rows["async-cpu"]
    assert (sync["samples_per_s"], sync["wall_s"], sync["backend"]) == (770.0, 21.0, "cpu")
    assert sync["efficiency_vs_ideal"] == 770.0 / ideal == 0.5
    assert sync["speedup_vs_fast_solo"] == pytest.approx(0.7, rel=1e-12)
    assert (sync["eval"], sync["eval_std"]) == (0.96, 0.0)
    assert sync["syncs"] == 100.0
    assert sync["sync_overhead"] == pytest.approx(0.15, rel=1e-12)
    assert sync["idle_fraction"] == pytest.approx(0.45, rel=1e-12)
    assert cadence["samples_per_s"] == 1155.0 and cadence["efficiency_vs_ideal"] == 0.75
    assert cadence["speedup_vs_fast_solo"] == pytest.approx(1.05, rel=1e-12)
    assert cadence["eval"] == pytest.approx(0.92, rel=1e-12)
    assert cadence["eval_std"] == pytest.approx(0.02 * math.sqrt(2), rel=1e-9)
    assert (cadence["syncs"], cadence["sync_overhead"]) == (41.0, pytest.approx(0.03))
    assert run_async["samples_per_s"] == 1386.0
    assert run_async["efficiency_vs_ideal"] == pytest.approx(0.9, rel=1e-12)
    assert run_async["speedup_vs_fast_solo"] == pytest.approx(1.26, rel=1e-12)
    assert (run_async["syncs"], run_async["idle_fraction"]) == (40.5, pytest.approx(0.01))
    # each seed against its own seed's solo runs: 1000 + 400, then 1200 + 480
    assert sync["efficiency_by_seed"] == [0.5, 0.5]
    assert cadence["efficiency_by_seed"] == pytest.approx([1210 / 1680, 1100 / 1400], rel=1e-12)
    assert run_async["efficiency_by_seed"] == pytest.approx([1472 / 1680, 1300 / 1400],
                                                            rel=1e-12)
    assert rows["solo@1x"]["efficiency_by_seed"] is None


def test_a_seed_without_its_own_solo_runs_is_left_out_of_the_spread():
    records = [r for r in mlp_records() if not (r["mode"] == "solo@2.5x" and r["seed"] == 1)]
    records.append(cell("mlp", "cadence-cpu", 2, eval_=0.9, sps=1300.0, syncs=40))
    records += [cell("mlp", "solo@1x", 2, eval_=0.9, sps=1000.0),
                cell("mlp", "solo@2.5x", 2, eval_=0.9, sps=300.0)]
    rows = rows_by_mode(build_report(records, machine={}))
    assert rows["cadence-cpu"]["efficiency_by_seed"] == pytest.approx(
        [1100 / 1400, 1300 / 1300], rel=1e-12)  # seed 1 has no solo@2.5x
    assert rows["sync-cpu"]["efficiency_by_seed"] is None  # seed 0 alone is no spread


def test_an_efficiency_above_the_ideal_is_a_measurement_error_never_a_result():
    """The issue's quick bench: cadence at 102% and async at 108% of solo@1x + solo@2.5x. Each
    row says why in one line, the table shows "measurement error" instead of the figure, and
    the rows within the ideal are left as they are."""
    records = [cell("mlp", "solo@1x", 0, eval_=0.9, sps=1000.0),
               cell("mlp", "solo@2.5x", 0, eval_=0.9, sps=400.0),
               cell("mlp", "sync-cpu", 0, eval_=0.9, sps=700.0, syncs=8),
               cell("mlp", "cadence-cpu", 0, eval_=0.9, sps=1428.0, syncs=20),
               cell("mlp", "async-cpu", 0, eval_=0.9, sps=1512.0, syncs=20)]
    report = build_report(records, machine=MACHINE)
    rows = rows_by_mode(report)
    assert rows["sync-cpu"]["measurement_error"] is None
    assert rows["cadence-cpu"]["measurement_error"] == (
        "efficiency 102.0% of the ideal (the solo rows' samples/s at each worker's factor, "
        "summed) is impossible: the solo baseline or this run was mis-measured; re-run")
    assert rows["async-cpu"]["measurement_error"].startswith("efficiency 108.0% of the ideal")
    assert all(rows[m]["measurement_error"] is None for m in ("solo@1x", "solo@2.5x"))
    text = render_markdown(report, title_note="")
    assert "| cadence-cpu | 0.9000 | 0.9800 | 10.0 | 1,428 | 1.43x | measurement error |" in text
    assert "102.0%" not in text.split("Measurement errors")[0]
    assert ("Measurement errors (not results):\n\n- cadence-cpu: efficiency 102.0% of the "
            "ideal") in text
    assert "| sync-cpu | 0.9000 | 0.9800 | 10.0 | 700 | 0.70x | 50.0% |" in text


def test_a_seed_faster_than_its_own_runs_ideal_is_a_measurement_error():
    records = [cell("mlp", "cadence-cpu", 0, eval_=0.9, sps=1100.0, syncs=20),
               cell("mlp", "cadence-cpu", 1, eval_=0.9, sps=900.0, syncs=20)]
    records[0]["ideal_samples_per_s"], records[1]["ideal_samples_per_s"] = 1000.0, 1000.0
    row = rows_by_mode(build_report(records, machine={}))["cadence-cpu"]
    assert row["efficiency_vs_ideal"] is None  # no solo rows
    assert row["measurement_error"] == ("110.0% of the run's own ideal (its ranks' "
                                        "solo-equivalent rates, summed) is impossible: a "
                                        "measurement error; re-run")


def test_missing_solo_row_one_seed_and_rerun_seed():
    records = [cell("logreg", "solo@1x", 0, eval_=0.9, sps=5000.0, reference=None),
               cell("logreg", "sync-cpu", 0, eval_=0.5, sps=1.0, syncs=9),
               cell("logreg", "sync-cpu", 0, eval_=0.8, sps=4000.0, syncs=10)]  # re-run wins
    rows = rows_by_mode(build_report(records, machine={}), "logreg")
    assert rows["sync-cpu"]["seeds"] == 1
    assert (rows["sync-cpu"]["eval"], rows["sync-cpu"]["eval_std"]) == (0.8, None)
    assert rows["sync-cpu"]["speedup_vs_fast_solo"] == 0.8
    assert rows["sync-cpu"]["efficiency_vs_ideal"] is None  # no solo@2.5x to add up
    assert rows["sync-cpu"]["efficiency_by_seed"] is None
    assert rows["sync-cpu"]["syncs"] == 10.0
    assert rows["solo@1x"]["reference"] is None


def test_real_gpus_are_matched_by_device():
    records = [cell("resnet20", "sync-nccl", 0, eval_=0.9, sps=300.0, syncs=5),
               cell("resnet20", "solo@gpu1", 0, eval_=0.9, sps=100.0),
               cell("resnet20", "solo@gpu0", 0, eval_=0.9, sps=250.0)]
    report = build_report(records, machine={})
    rows = rows_by_mode(report, "resnet20")
    assert list(rows) == ["solo@gpu0", "solo@gpu1", "sync-nccl"]
    assert rows["sync-nccl"]["efficiency_vs_ideal"] == 300.0 / 350.0
    assert rows["sync-nccl"]["speedup_vs_fast_solo"] == 1.2
    assert report["machine"]["emulated_slowdown"] is None


def test_models_keep_their_first_appearance_order():
    records = [cell("lenet5", "solo@1x", 0, eval_=0.9, sps=1.0), *mlp_records()]
    assert [row["model"] for row in build_report(records, machine={})["rows"]][:2] == [
        "lenet5", "mlp"]


def test_loss_curve_is_the_mean_over_seeds_per_epoch():
    solo = [r for r in mlp_records() if r["mode"] == "solo@1x"]
    curve = loss_curve(solo)
    assert [epoch for epoch, _ in curve] == [1, 2]
    assert [loss for _, loss in curve] == pytest.approx([0.9, 0.4], rel=1e-12)


def test_markdown_tables():
    report = build_report(mlp_records(), machine=MACHINE)
    text = render_markdown(report, title_note="quick run, 2 seeds")
    assert text.startswith("# fdl bench report\n\nquick run, 2 seeds\n")
    assert "- machine: Test CPU 9000 (8 cores)" in text
    assert "- GPUs: none" in text and "- date: 2026-01-02" in text
    assert "- emulated slowdown: 1x + 2.5x" in text
    assert "## mlp" in text
    assert ("| mode | eval (mean ± std) | published | wall s | samples/s | speedup vs fast solo "
            "| efficiency vs ideal | syncs | sync overhead | idle % |") in text
    assert ("| solo@1x | 0.9600 ± 0.0141 | 0.9800 | 11.0 | 1,100 | 1.00x | — | — | — "
            "| — |") in text
    assert ("| solo@2.5x | 0.9500 ± 0.0141 | 0.9800 | 26.0 | 440 | 0.40x | — | — | — "
            "| — |") in text
    assert ("| sync-cpu | 0.9600 ± 0.0000 | 0.9800 | 21.0 | 770 | 0.70x | 50.0% [50.0-50.0%] "
            "| 100 | 15.0% | 45.0% |") in text
    assert ("| cadence-cpu | 0.9200 ± 0.0283 | 0.9800 | 10.0 | 1,155 | 1.05x "
            "| 75.0% [72.0-78.6%] | 41 | 3.0% | 6.0% |") in text
    assert ("| async-cpu | 0.9400 ± 0.0141 | 0.9800 | 10.0 | 1,386 | 1.26x "
            "| 90.0% [87.6-92.9%] | 40.5 | 1.0% | 1.0% |") in text
    table = [line.split(" | ")[0][2:] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| mode |")]
    assert table == ["solo@1x", "solo@2.5x", "sync-cpu", "cadence-cpu", "async-cpu"]


def test_markdown_one_seed_and_gpu_names():
    report = build_report([cell("logreg", "solo@gpu0", 0, eval_=0.9, sps=5.0, reference=None)],
                          machine={"gpus": [{"name": "RTX 5060 Ti"}, {"name": "GTX 1060"}]})
    text = render_markdown(report, title_note="")
    assert "| solo@gpu0 | 0.9000 | — | 10.0 | 5 | 1.00x | — | — | — | — |" in text
    assert "- GPUs: RTX 5060 Ti, GTX 1060" in text
    assert "- emulated slowdown: none" in text and "- date: —" in text


def write_sweep(directory, records, *, tail: str = ""):
    lines = "".join(json.dumps(record) + "\n" for record in records)
    (directory / "results.jsonl").write_text(lines + tail, encoding="utf-8")
    (directory / "sweep.json").write_text(json.dumps(
        {"machine": MACHINE | {"date": None}, "started": "2026-03-04T05:06:07Z",
         "args": {"models": "mlp", "seeds": 2}}), encoding="utf-8")


def test_load_results_tolerates_a_truncated_last_line(tmp_path):
    records = mlp_records()
    write_sweep(tmp_path, records, tail=json.dumps(records[0])[:57])
    loaded, meta = load_results(tmp_path)
    assert loaded == records
    assert meta["started"] == "2026-03-04T05:06:07Z"


def test_load_results_rejects_a_bad_line_in_the_middle_and_a_missing_file(tmp_path):
    with pytest.raises(FdlError, match=r"results\.jsonl does not exist"):
        load_results(tmp_path)
    (tmp_path / "results.jsonl").write_text('{"model": \n{"model": "mlp"}\n', encoding="utf-8")
    with pytest.raises(FdlError, match=r"results\.jsonl:1: not a JSON record"):
        load_results(tmp_path)


def test_write_report_files(tmp_path):
    write_sweep(tmp_path, mlp_records(), tail='{"model": "mlp", "mo')
    written = write_report(tmp_path)
    names = [path.name for path in written]
    assert names == ["report.json", "report.md", "loss-mlp.png", "throughput.png"]
    assert all(path.parent == tmp_path for path in written)
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert list(report) == ["schema", "machine", "rows"]
    assert report["machine"]["date"] == "2026-03-04T05:06:07Z"  # from sweep.json's start
    assert report["machine"]["emulated_slowdown"] == [1.0, 2.5]
    assert [list(row) for row in report["rows"]] == [ROW_KEYS] * 5
    assert report == json.loads(json.dumps(build_report(mlp_records(),
                                                        machine=report["machine"])))
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "Sweep: models=mlp, seeds=2" in markdown
    assert "![loss-mlp.png](loss-mlp.png)" in markdown
    for name in ("loss-mlp.png", "throughput.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*names, "results.jsonl", "sweep.json"])  # no temp files left behind


def test_write_report_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    write_sweep(tmp_path, mlp_records())
    written = write_report(tmp_path)
    assert [path.name for path in written] == ["report.json", "report.md"]
    assert "Plots skipped: matplotlib is not installed" in (tmp_path / "report.md").read_text(
        encoding="utf-8")
    assert not list(tmp_path.glob("*.png"))


def test_report_module_is_pure():
    import subprocess

    code = ("import sys, fdl.bench.sweep_report; "
            "print(any(m in sys.modules for m in ('torch', 'matplotlib', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
