"""`fdl report` at 80 and 200 columns: nothing cut, nothing past the edge, every figure there.

The run directory is hand-made to stress the widths: four ranks on four different GPUs in
three precisions, a run of hours with a million samples per rank, seven anchor changes with long
reasons, several metrics, two tips (averages costly in bf16, a rank loading data 16% of the run),
a trace.json. The
text is compared with `fdl report --json` of the same directory: each figure, rounded as the
text rounds it, must be in its rank's table rows or, for run-wide figures, in the text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_fdl

from fdl.rundir.timeline_trace import trace_note

WALL_S = 12345.678
BATCH = 64
HEADERS = [["rank", "device", "precision"],
           ["rank", "samples", "steps", "samples/s", "share", "ms/step", "idle"],
           ["rank", "compute", "emulated", "sync", "epoch ends", "data", "other"]]
TITLES = ["devices", "throughput", "where the time went, in seconds"]
DEVICES = ["cuda:0 NVIDIA H100 80GB HBM3", "cuda:1 NVIDIA GeForce RTX 4070",
           "cuda:2 Tesla V100-SXM2-16GB", "cuda:3 NVIDIA GeForce GTX 1060 6GB"]
PRECISIONS = ["bf16", "bf16", "fp16", "fp32"]
ANCHORS = [[4 * i, 2 ** i, f"overhead {0.1 * i:.2f} > 0.05 (measured over the last rounds)"]
           for i in range(1, 8)]


def rank_events(rank: int) -> list[dict]:
    """Two epochs of one round each; rank r is (r + 1) times slower than rank 0."""
    events, t = [{"t": 1000.0, "kind": "start", "attempt": 0}], 1000.0
    for epoch in (0, 1):
        steps = 8000 // (rank + 1)
        t += 2000.0
        events.append({"t": t, "kind": "round", "round": epoch, "epoch": epoch, "steps": steps,
                       "samples": steps * BATCH, "compute_s": 1900.0 - 10 * rank,
                       "data_s": 1000.456 + rank})
        t += 3.5
        events += [{"t": t, "kind": "sync", "round": epoch, "wait_s": 3.25 * (rank + 1)},
                   {"t": t + 1.0, "kind": "epoch", "epoch": epoch + 1}]
    return [*events, {"t": t + 2.0, "kind": "final"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("report") / "20260101T000000Z-train-cadence"
    (run / "timeline").mkdir(parents=True)
    samples = []
    for rank in range(4):
        events = rank_events(rank)
        samples.append(sum(e.get("samples", 0) for e in events))
        (run / "timeline" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    (run / "timeline" / "trace.json").write_text('{"traceEvents": []}\n', encoding="utf-8")
    summary = {"policy": "cadence", "backend": "cpu", "world_size": 4,
               "devices": DEVICES, "precision": PRECISIONS,
               "emulated_slowdown": [1.0, 2.0, 3.0, 4.0],
               "wall_s": WALL_S,
               "throughput": {"samples_per_s": sum(samples) / WALL_S,
                              "per_rank_samples_per_s": [s / WALL_S for s in samples]},
               "sync": {"rounds": 2, "mean_ms": 1234.5, "overhead": 0.123},
               "average_dtype": "bf16",
               "anchor_history": ANCHORS, "final_loss": 0.012345,
               "eval": {"accuracy": 0.98765, "top5_accuracy": 0.99991, "loss": 0.04321}}
    (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    (run / "config.json").write_text(json.dumps({"engine": {"batch_size": {"value": BATCH}}}),
                                     encoding="utf-8")
    return run


@pytest.fixture(scope="module")
def report_json(run_dir) -> dict:
    proc = run_fdl("report", str(run_dir), "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return json.loads(proc.stdout)


def report_text(run_dir: Path, *, columns: int) -> str:
    proc = run_fdl("report", str(run_dir), env={"COLUMNS": str(columns)})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


def table_cells(text: str) -> tuple[list[list[str]], dict[int, set[str]]]:
    """The header rows of the tables, and each rank's cells over every table."""
    headers, by_rank = [], {}
    for line in text.splitlines():
        if line.startswith("┃"):
            headers.append([cell.strip() for cell in line.strip("┃").split("┃")])
        elif line.startswith("│"):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            by_rank.setdefault(int(cells[0]), set()).update(cells[1:])
    return headers, by_rank


def rank_figures(row: dict) -> list[str]:
    time_s = row["time_s"]
    return [row["device"], row["precision"], str(row["samples"]), str(row["steps"]), f"{row['samples_per_s']:.0f}",
            f"{row['share']:.1%}", f"{row['step_ms']:.1f}", f"{row['idle_fraction']:.1%}",
            *(f"{time_s[key]:.2f}" for key in ("compute", "emulated", "sync_wait",
                                               "epoch_boundary", "data_loading", "unexplained"))]


def run_figures(doc: dict) -> list[str]:
    """Run-wide figures as the text rounds them (anchor changes: the last five, and how many)."""
    sync = doc["sync"]
    return [f"on {doc['world_size']} worker(s)", f"{doc['samples_per_s']:.0f} samples/s",
            f"over {doc['wall_s']:.2f} s", f"{doc['ideal_samples_per_s']:.0f} samples/s",
            *(f"{r['solo_samples_per_s']:.0f}" for r in doc["ranks"]), f"{doc['efficiency']:.1%}",
            f"{sync['rounds']} averages", f"mean {sync['mean_ms']:.1f} ms",
            f"overhead {sync['overhead']:.1%}", f"{len(doc['anchor_history'])} changes",
            *(f"round {r}: {a} ({why})" for r, a, why in doc["anchor_history"][-5:]),
            ",".join(f"{f:g}" for f in doc["emulated_slowdown"]),
            *(f"{name} {value:.4f}" for name, value in doc["eval"].items()),
            f"{doc['final_loss']:.4f}", *doc["advice"]]


@pytest.mark.parametrize("columns", [80, 200])
def test_the_report_fits_the_terminal_and_cuts_nothing(run_dir, report_json, columns):
    text = report_text(run_dir, columns=columns)
    assert max(len(line) for line in text.splitlines()) <= columns
    assert "…" not in text and "..." not in text
    headers, by_rank = table_cells(text)
    assert headers == HEADERS
    assert all(title in text.splitlines() for title in TITLES)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, row in enumerate(report_json["ranks"]):
        missing = [f for f in rank_figures(row) if f not in by_rank[rank]]
        assert missing == [], (rank, missing, by_rank[rank])
    flowing = " ".join(text.split())  # a run-wide line may wrap at 80 columns
    missing = [f for f in run_figures(report_json) if f not in flowing]
    assert missing == [], missing
    assert len(report_json["advice"]) == 2  # the averages' encoding and rank 3's data loading


def test_the_last_line_says_where_the_trace_is_and_how_to_open_it(run_dir):
    wide = report_text(run_dir, columns=200).splitlines()
    assert wide[-1] == f"  trace       {trace_note(run_dir / 'timeline' / 'trace.json')}"
    narrow = report_text(run_dir, columns=80).splitlines()
    start = max(i for i, line in enumerate(narrow) if line.startswith("  trace "))
    assert all(line.startswith(" " * 14) for line in narrow[start + 1:])  # under the value
    unwrapped = "".join("".join(narrow[start:]).split())
    assert unwrapped == "trace" + "".join(trace_note(run_dir / "timeline" / "trace.json").split())


def test_no_trace_line_without_a_trace(run_dir, tmp_path):
    copy = tmp_path / "run"
    (copy / "timeline").mkdir(parents=True)
    for name in ("summary.json", "config.json", *(f"timeline/rank{r}.jsonl" for r in range(4))):
        (copy / name).write_text((run_dir / name).read_text(encoding="utf-8"), encoding="utf-8")
    assert "trace" not in report_text(copy, columns=200)
