"""`fdl report`: numbers from a hand-made run directory, and the CLI around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_fdl

from fdl.errors import UsageError
from fdl.rundir.report import build_report, load_run, run_report

SUMMARY = {"policy": "cadence", "backend": "cpu", "world_size": 2, "devices": ["cpu", "cpu"],
           "emulated_slowdown": [1.0, 2.5], "epochs": 1, "samples": 400, "wall_s": 10.0,
           "throughput": {"samples_per_s": 40.0, "per_rank_samples_per_s": [30.0, 10.0]},
           "sync": {"rounds": 2, "mean_ms": 100.0, "overhead": 0.02}, "idle_fraction": [0, 0],
           "eval": {"accuracy": 0.9}, "final_loss": 0.25,
           "anchor_history": [[1, 8, "overhead 0.2 > 0.05"]]}
# rank 0: 30 steps of 10 samples in 8 s (0.2667 s/step) ... all times hand-chosen; rank 1's
# second round spent 0.5 s of its 4.5 s fetching batches (rank 0's rounds predate data_s)
TIMELINES = [
    [{"t": 104.0, "kind": "round", "steps": 15, "samples": 150, "compute_s": 4.0},
     {"t": 105.0, "kind": "sync", "wait_s": 1.0},
     {"t": 105.5, "kind": "epoch"},
     {"t": 110.0, "kind": "round", "steps": 15, "samples": 150, "compute_s": 4.0},
     {"t": 110.5, "kind": "sync", "wait_s": 0.5},
     {"t": 110.6, "kind": "final"}],
    [{"t": 104.5, "kind": "round", "steps": 5, "samples": 50, "compute_s": 4.5},
     {"t": 105.0, "kind": "sync", "wait_s": 0.5},
     {"t": 105.5, "kind": "epoch"},
     {"t": 110.5, "kind": "round", "steps": 5, "samples": 50, "compute_s": 4.5, "data_s": 0.5},
     {"t": 110.5, "kind": "sync", "wait_s": 0.0},
     {"t": 110.6, "kind": "final"}],
]


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "config.json").write_text(json.dumps({"engine": {"batch_size": {"value": 10}}}))
    for rank, events in enumerate(TIMELINES):
        (run / "timeline" / f"rank{rank}.jsonl").write_text(
            "\n".join(json.dumps(e) for e in events) + "\n")
    return run


def test_report_numbers_from_a_hand_made_run(tmp_path):
    summary, timelines, _ = load_run(make_run(tmp_path))
    doc = build_report(summary, timelines, batch_size=10)
    fast, slow = doc["ranks"]
    assert fast["samples"] == 300 and slow["samples"] == 100
    assert fast["share"] == pytest.approx(0.75) and slow["share"] == pytest.approx(0.25)
    assert fast["step_ms"] == pytest.approx(8000 / 30) and slow["step_ms"] == pytest.approx(850)
    assert fast["time_s"] == pytest.approx({"compute": 8.0, "emulated": 0.0, "sync_wait": 1.5,
                                            "epoch_boundary": 0.5, "data_loading": 0.0,
                                            "unexplained": 0.0})
    # rank 1's second round started at 110.5 - 4.5 = 106.0, half a second after its epoch event
    assert slow["time_s"] == pytest.approx({"compute": 8.5, "emulated": 0.0, "sync_wait": 0.5,
                                            "epoch_boundary": 0.5, "data_loading": 0.5,
                                            "unexplained": 0.0})
    assert fast["idle_fraction"] == pytest.approx(0.2)
    assert slow["idle_fraction"] == pytest.approx(0.15)
    ideal = 10 / (8 / 30) + 10 / 0.85
    assert doc["ideal_samples_per_s"] == pytest.approx(ideal)
    assert doc["efficiency"] == pytest.approx(40 / ideal)
    assert doc["anchor_history"] == [[1, 8, "overhead 0.2 > 0.05"]]
    assert doc["incomplete"] == []


def test_ddp_communication_is_sync_and_the_emulated_sleep_its_own_part(tmp_path):
    """A sync run at 1,2.5 (hand-made): each step computes 10 ms on both ranks, the slow rank
    sleeps 15 ms after it, and the fast rank spends the slow one's sleep in DDP's all-reduce,
    waiting. That wait is sync, not step time: both ranks' solo-equivalent rates are their own
    (10 and 25 ms a step), and the efficiency is what sync's lock step gives, 2 / 3.5 of the
    ideal — not ~1, as when the wait counted as the fast rank's compute."""
    summary = {**SUMMARY, "policy": "sync", "samples": 200, "wall_s": 2.6,
               "throughput": {"samples_per_s": 200 / 2.6, "per_rank_samples_per_s":
                              [100 / 2.6, 100 / 2.6]}}
    fast = {"t": 102.5, "kind": "round", "steps": 100, "samples": 100, "compute_s": 2.5,
            "sleep_s": 0.0, "comm_s": 1.6}
    slow = {**fast, "sleep_s": 1.5, "comm_s": 0.1}
    run = make_run(tmp_path)
    (run / "summary.json").write_text(json.dumps(summary))
    for rank, event in enumerate([fast, slow]):
        (run / "timeline" / f"rank{rank}.jsonl").write_text(
            json.dumps(event) + "\n" + json.dumps({"t": 102.6, "kind": "final"}) + "\n")
    doc = build_report(*load_run(run)[:2], batch_size=1)
    times = [rank["time_s"] for rank in doc["ranks"]]
    assert times[0] == pytest.approx({"compute": 0.9, "emulated": 0.0, "sync_wait": 1.6,
                                      "epoch_boundary": 0.0, "data_loading": 0.0,
                                      "unexplained": 0.1})
    assert times[1] == pytest.approx({"compute": 0.9, "emulated": 1.5, "sync_wait": 0.1,
                                      "epoch_boundary": 0.0, "data_loading": 0.0,
                                      "unexplained": 0.1})
    assert [r["step_ms"] for r in doc["ranks"]] == pytest.approx([9.0, 24.0])
    assert doc["ideal_samples_per_s"] == pytest.approx(1000 / 9 + 1000 / 24)
    assert doc["efficiency"] == pytest.approx((200 / 2.6) / (1000 / 9 + 1000 / 24))
    assert doc["efficiency"] < 0.6


def test_a_wait_in_the_step_loop_is_not_compute(tmp_path):
    """An async run's slow rank whose calibration round waited 0.2 s for its peer to start (the
    pool's end) inside its step loop: 0.26 s of loop, 0.06 s of timed steps (busy_s). The wait
    is not step time, so it neither lowers the rank's solo-equivalent rate (the ideal) nor
    counts as compute; it is left to 'unexplained'. Counting it made a run's efficiency 104%."""
    run = make_run(tmp_path)
    rank1 = [{"t": 100.26, "kind": "round", "steps": 18, "samples": 180, "compute_s": 0.26,
              "busy_s": 0.06, "data_s": 0.005, "sleep_s": 0.035, "comm_s": 0.0},
             {"t": 110.6, "kind": "final"}]
    (run / "timeline" / "rank1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rank1))
    summary = {**SUMMARY, "throughput": {"samples_per_s": 48.0,
                                         "per_rank_samples_per_s": [30.0, 18.0]}}
    (run / "summary.json").write_text(json.dumps(summary))
    slow = build_report(*load_run(run)[:2], batch_size=10)["ranks"][1]
    assert slow["time_s"]["compute"] == pytest.approx(0.02)
    assert slow["time_s"]["emulated"] == pytest.approx(0.035)
    assert slow["step_ms"] == pytest.approx(1000 * 0.055 / 18)
    assert slow["time_s"]["unexplained"] == pytest.approx(10.0 - 0.055 - 0.005)


def test_cli_report_json_and_text(tmp_path):
    run = make_run(tmp_path)
    proc = run_fdl("report", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ranks"][0]["samples"] == 300
    text = run_fdl("report", str(run)).stdout
    assert "efficiency" in text and "accuracy 0.9000" in text
    assert "emulated" in text.split("where the time went")[1].splitlines()[2]


def test_report_of_a_directory_without_summary(tmp_path):
    with pytest.raises(UsageError, match=r"no summary\.json"):
        load_run(tmp_path)
    proc = run_fdl("report", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")


def make_partial_run(tmp_path: Path) -> Path:
    """The hand-made run stopped in its second epoch: no summary.json, no final events, a
    config.json as fdl run and the engine write it, the first epoch in metrics.jsonl."""
    run = tmp_path / "partial"
    (run / "timeline").mkdir(parents=True)
    engine = {"policy": {"value": "cadence"}, "batch_size": {"value": 10},
              "epochs": {"value": 3}, "simulate_slowdown": {"value": [1.0, 2.5]},
              "resolved_backend": "cpu"}
    (run / "config.json").write_text(json.dumps({"fdl_version": "0", "engine": engine}))
    for rank, events in enumerate(TIMELINES):
        rounds = iter(range(2))
        kept = []
        for event in events:
            if event["kind"] == "final":
                continue
            if event["kind"] == "round":
                index = next(rounds)
                event = {**event, "round": index, "epoch": index}
            if event["kind"] == "sync":  # each average took 0.1 s
                event = {**event, "start": event["t"] - 0.1, "end": event["t"]}
            if event["kind"] == "epoch":
                event = {**event, "epoch": 1}
            kept.append(event)
        (run / "timeline" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in kept))
    (run / "metrics.jsonl").write_text(json.dumps(
        {"epoch": 1, "train_loss": 0.5, "eval": {"accuracy": 0.8}}) + "\n")
    return run


def test_a_run_that_did_not_finish_is_reported_from_its_timelines_marked_incomplete(tmp_path):
    doc = run_report(make_partial_run(tmp_path))
    assert doc["complete"] is False
    assert doc["reason"] == ("the run did not finish (no summary.json): it stopped in epoch 2 of "
                             "3 (after round 1), interrupted, crashed or still running; the "
                             "figures cover what its timelines hold")
    assert (doc["policy"], doc["backend"], doc["world_size"]) == ("cadence", "cpu", 2)
    assert doc["emulated_slowdown"] == [1.0, 2.5]
    assert [r["samples"] for r in doc["ranks"]] == [300, 100]
    assert doc["wall_s"] == pytest.approx(110.5 - 104.0)  # first event to last, any rank
    assert doc["samples_per_s"] == pytest.approx(400 / 6.5)
    assert doc["sync"]["rounds"] == 2 and doc["sync"]["mean_ms"] == pytest.approx(100)
    assert (doc["eval"], doc["final_loss"]) == ({"accuracy": 0.8}, 0.5)
    assert doc["incomplete"] == [], "no final event is the run's state, said once in reason"


def test_cli_report_of_a_partial_run_says_incomplete_first_within_80_columns(tmp_path):
    run = make_partial_run(tmp_path)
    proc = run_fdl("report", str(run), env={"COLUMNS": "80"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("  incomplete  the run did not finish (no summary.json)")
    assert max(len(line) for line in lines) <= 80, proc.stdout
    assert json.loads(run_fdl("report", str(run), "--json").stdout)["complete"] is False


def test_a_finished_run_is_complete(tmp_path):
    doc = run_report(make_run(tmp_path))
    assert doc["complete"] is True and doc["reason"] is None


def test_a_run_that_left_no_timeline_has_nothing_to_report(tmp_path):
    """A plain DDP script's run: config.json and logs, nothing of fdl's engine."""
    (tmp_path / "config.json").write_text(json.dumps({"fdl_version": "0"}))
    proc = run_fdl("report", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path} holds an fdl run with no summary.json "
                                  "and no timeline")


# --- each rank's device and precision ----------------------------------------------------------


def devices_table(text: str) -> list[list[str]]:
    """The rows of the text's devices table (rank, device, precision), or []."""
    lines = text.splitlines()
    if "devices" not in lines:
        return []
    rows = []
    for line in lines[lines.index("devices") + 1:]:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def test_each_rank_shows_its_precision_beside_its_device(tmp_path):
    run = make_run(tmp_path)
    summary = {**SUMMARY, "devices": ["cuda:0 NVIDIA H100 80GB HBM3", "cuda:1 Tesla T4"],
               "precision": ["bf16", "fp16"]}
    (run / "summary.json").write_text(json.dumps(summary))
    doc = run_report(run)
    assert [(r["device"], r["precision"]) for r in doc["ranks"]] == [
        ("cuda:0 NVIDIA H100 80GB HBM3", "bf16"), ("cuda:1 Tesla T4", "fp16")]
    proc = run_fdl("report", str(run), env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert devices_table(proc.stdout) == [["0", "cuda:0 NVIDIA H100 80GB HBM3", "bf16"],
                                          ["1", "cuda:1 Tesla T4", "fp16"]]


def test_a_summary_from_before_precision_is_still_reported(tmp_path):
    """summary.json of an older fdl has no precision: shown unknown, not refused."""
    run = make_run(tmp_path)
    assert "precision" not in json.loads((run / "summary.json").read_text())
    doc = run_report(run)
    assert [(r["device"], r["precision"]) for r in doc["ranks"]] == [("cpu", None), ("cpu", None)]
    proc = run_fdl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert devices_table(proc.stdout) == [["0", "cpu", "-"], ["1", "cpu", "-"]]


@pytest.mark.parametrize(("precision", "message"), [
    (["bf16"], "world_size is 2 but precision has 1 entries"),
    ("bf16", 'precision is "bf16", expected a list of strings, one per rank, or null'),
    ([16, 32], "precision is list, expected a list of strings, one per rank, or null"),
])
def test_a_precision_fdl_did_not_write_is_an_error_naming_it(tmp_path, precision, message):
    run = make_run(tmp_path)
    (run / "summary.json").write_text(json.dumps({**SUMMARY, "precision": precision}))
    proc = run_fdl("report", str(run))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == f"error: {run / 'summary.json'}: {message}"


def test_a_run_that_did_not_finish_has_no_devices_table(tmp_path):
    """Its devices and precisions are in no file it left (summary.json has them)."""
    run = make_partial_run(tmp_path)
    assert [(r["device"], r["precision"]) for r in run_report(run)["ranks"]] == [(None, None)] * 2
    text = run_fdl("report", str(run)).stdout
    assert "throughput" in text.splitlines() and devices_table(text) == []


@pytest.mark.parametrize(("accumulate", "factor"), [(2, 2), (None, 1), ("2", 1), (True, 1),
                                                    (0, 1), (10**12, 1)])
def test_a_step_of_an_accumulating_loop_counts_its_batches(tmp_path, accumulate, factor):
    """A loop with accumulate=k times steps of k batches: a rank's solo-equivalent rate is
    k x batch_size per step time. What summary.json says is checked, not trusted."""
    summary, timelines, _ = load_run(make_run(tmp_path))
    plain = build_report(summary, timelines, batch_size=10)
    if accumulate is not None:
        summary["accumulate"] = accumulate
    doc = build_report(summary, timelines, batch_size=10)
    for mine, before in zip(doc["ranks"], plain["ranks"], strict=True):
        assert mine["solo_samples_per_s"] == pytest.approx(factor * before["solo_samples_per_s"])


def test_the_link_shows_an_averages_bytes_and_the_rate_the_blocking_ones_got(tmp_path):
    """Issue 27 D7: bytes per average as sent, the blocking averages' median time and the
    rate it makes; for sync, the gradients per step and their all-reduce's rate where timed.
    An older summary without the figures shows none, never a traceback."""
    run = make_run(tmp_path)
    syncs = [{"t": 105.0 + i, "kind": "sync", "wait_s": 0.9, "round": i, "start": 100.0 + i,
              "end": 100.0 + i + ms / 1000, "blocking": blocking, "bytes": 4_000_000}
             for i, (ms, blocking) in enumerate([(800, True), (900, True), (50, False),
                                                 (1000, True)])]
    (run / "timeline" / "rank0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in [TIMELINES[0][0], *syncs, TIMELINES[0][-1]]))
    summary = {**SUMMARY, "average_bytes": 4_000_000, "average_dtype": "bf16",
               "gradient_bytes": 8_000_000}
    (run / "summary.json").write_text(json.dumps(summary))
    link = run_report(run)["link"]
    assert link["average_bytes"] == 4_000_000 and link["average_dtype"] == "bf16"
    assert link["averages"] == 4
    assert link["blocking_average_ms"] == pytest.approx(900)  # the median of the blocking ones
    assert link["blocking_mb_per_s"] == pytest.approx(4 / 0.9)
    assert link["gradient_bytes"] is None  # cadence: no gradients cross the link
    text = run_fdl("report", str(run)).stdout
    assert "link" in text and "4.00 MB per average (bf16), blocking ones 900 ms: 4.4 MB/s" in text
    assert link["interface_share"] is None and "rated" not in text  # one node: no interface
    config = json.loads((run / "config.json").read_text())
    network = {"several_nodes": True, "interface": "eth7", "link_mbit": 100}
    (run / "config.json").write_text(json.dumps({**config, "network": network}))
    link = run_report(run)["link"]  # 4.44 MB/s of 100 Mbit/s (12.5 MB/s)
    assert (link["interface"], link["interface_mbit"]) == ("eth7", 100)
    assert link["interface_share"] == pytest.approx(4 / 0.9 / 12.5)
    assert "4.4 MB/s (35.6% of eth7's rated 100 Mbit/s)" in run_fdl("report", str(run)).stdout
    for hostile in ({**network, "interface": "eth7\x1b]0;owned\x07"},
                    {**network, "link_mbit": 1e308}, {**network, "link_mbit": True},
                    {**network, "link_mbit": "100"},
                    {**network, "interface": ["eth7"]}, "eth7"):
        (run / "config.json").write_text(json.dumps({**config, "network": hostile}))
        link = run_report(run)["link"]
        assert link["interface_share"] is None and link["interface_mbit"] is None, hostile
        assert "\x1b" not in run_fdl("report", str(run)).stdout
    sync = {**summary, "policy": "sync", "ddp_comm_s": [2.0, 0.5]}
    (run / "summary.json").write_text(json.dumps(sync))
    link = run_report(run)["link"]  # rank 0: 15 steps, 2 s in the gradients' all-reduce
    assert link["gradient_bytes"] == 8_000_000
    assert link["gradient_ms_per_step"] == pytest.approx(2000 / 15)
    assert link["gradient_mb_per_s"] == pytest.approx(8 / (2 / 15))
    (run / "summary.json").write_text(json.dumps(SUMMARY))  # before the figures existed
    make_run(tmp_path / "old")
    old = run_report(tmp_path / "old" / "run")["link"]
    assert old["average_bytes"] is None and old["blocking_mb_per_s"] is None


def test_a_run_whose_communication_or_waits_cost_a_tenth_is_told_what_to_try(tmp_path):
    """A cadence run across a slow link whose averages cost 38% of its compute time (bench-lan's
    at 100 Mbit/s) is told, in the text and the JSON, which --average-dtype sends fewer bytes
    than the one it used; a sync run whose rank spent a tenth of the run or more in the
    all-reduces (the link, or a slower rank: however little the link cost), of cadence and
    async; a run under the threshold, on one worker, already in int4, whose averages are too
    small for their bytes to matter, or whose summary lacks the figure is told nothing."""
    run = make_run(tmp_path)

    def advice(**changes):
        (run / "summary.json").write_text(json.dumps({**SUMMARY, **changes}))
        return run_report(run)["advice"]

    slow = {"sync": {"rounds": 6, "mean_ms": 865.0, "overhead": 0.38}, "average_dtype": "fp32"}
    assert advice(**slow) == ["the averages cost 38% of the compute time, sent in fp32: "
                              "--average-dtype bf16 50%, int8 25%, int4 12% of its bytes "
                              '(docs/run.md "Slow links")']
    text = run_fdl("report", str(run)).stdout
    assert "tip" in text and "--average-dtype" in text
    assert "in bf16: --average-dtype int8 50%, int4 25% of its bytes" in \
        advice(**{**slow, "average_dtype": "bf16"})[0]
    assert "in int8: --average-dtype int4 50% of its bytes" in \
        advice(**{**slow, "policy": "async", "average_dtype": "int8"})[0]
    # four ranks: fp32 is all-reduced (1.5 buffers sent), the encodings gathered (3 each)
    four = {"world_size": 4, "devices": ["cpu"] * 4, "emulated_slowdown": None,
            "throughput": {"samples_per_s": 40.0, "per_rank_samples_per_s": [10.0] * 4}}
    assert "in fp32: --average-dtype int8 50%, int4 25% of its bytes" in \
        advice(**slow, **four)[0]
    assert advice(**{**slow, "sync": {"rounds": 6, "mean_ms": 90.0, "overhead": 0.05}}) == []
    # averages of under 64 kB: their time is the link's round trips, not bytes (a
    # Linear(4, 2)'s 152 B read 12% on loopback)
    assert advice(**slow, average_bytes=64 * 1024 - 1) == []
    assert advice(**slow, average_bytes=64 * 1024) == advice(**slow)
    # under sync: rank 0 of the hand-made run spent 1.5 s of 10 in the all-reduces
    assert advice(**{**slow, "policy": "sync"}) == [
        "rank 0 spent 15% of the run in sync's gradient all-reduces, waiting for the link and "
        "for slower ranks' steps: cadence and async let each rank step at its own speed and "
        "average once a round (--policy auto picks one after calibration; fdl compare "
        "measures them on your script)"]
    assert advice(**{**slow, "policy": "sync", "sync": {"rounds": 6, "mean_ms": 1.0,
                                                        "overhead": 0.01}}) != []
    # the same 1.5 s in a run of 20 s: under a tenth, nothing
    longer = {"wall_s": 20.0, "throughput": {"samples_per_s": 20.0,
                                             "per_rank_samples_per_s": [15.0, 5.0]}}
    assert advice(**{**slow, "policy": "sync", **longer}) == []
    for quiet in ({"average_dtype": "int4"}, {"average_dtype": None},
                  {"sync": {"rounds": 6, "mean_ms": None, "overhead": None}},
                  {"world_size": 1, "devices": ["cpu"], "emulated_slowdown": [1.0],
                   "throughput": {"samples_per_s": 40.0, "per_rank_samples_per_s": [40.0]}}):
        assert advice(**{**slow, **quiet}) == [], quiet
    assert "tip" not in run_fdl("report", str(run)).stdout


def test_a_rank_that_spent_a_sixth_of_the_run_loading_data_is_told_of_loader_workers(tmp_path):
    """Rank 1 of the hand-made run fetched batches 0.5 s of its 10 (5%): nothing. Made 2 s
    (20%), the report names rank 1 and loader workers, in the text and the JSON."""
    run = make_run(tmp_path)
    assert run_report(run)["advice"] == []
    events = [dict(e) for e in TIMELINES[1]]
    events[3]["data_s"] = 2.0
    (run / "timeline" / "rank1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    advice = run_report(run)["advice"]
    assert advice == ["rank 1 spent 20% of the run fetching and collating batches: loader "
                      "workers fetch them while the step computes (run.batches("
                      "num_workers=N) or the DataLoader's); with workers already, more where "
                      "the CPU has cores to spare, a cheaper collate_fn, or data stored as "
                      "tensors"]
    assert "loader workers" in " ".join(run_fdl("report", str(run)).stdout.split())


def test_an_averages_time_is_the_last_arriving_ranks_not_the_wait_of_the_first(tmp_path):
    """Rank 0 came to each blocking average first and waited 800-1000 ms in it; rank 1 came
    last and spent 100-300 ms, the transfer: the link's figure is each round's shorter time
    (median 200 ms: 20 MB/s for 4 MB), not rank 0's wait. A round only rank 0 recorded, and an
    older event without a round, count as rank 0 saw them."""
    run = make_run(tmp_path)

    def syncs(times):
        return [{"t": 105.0 + i, "kind": "sync", "wait_s": 0.1, "round": key,
                 "start": 100.0 + i, "end": 100.0 + i + ms / 1000, "blocking": True,
                 "bytes": 4_000_000} for i, (key, ms) in enumerate(times)]

    for rank, times in ((0, [(0, 800), (1, 900), (2, 1000)]),
                        (1, [(0, 300), (1, 100), (2, 200), (3, 50)])):
        (run / "timeline" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps(e) + "\n" for e in [TIMELINES[rank][0], *syncs(times),
                                            TIMELINES[rank][-1]]))
    (run / "summary.json").write_text(json.dumps({**SUMMARY, "average_bytes": 4_000_000}))
    link = run_report(run)["link"]
    assert link["blocking_average_ms"] == pytest.approx(200)
    assert link["blocking_mb_per_s"] == pytest.approx(20)
    (run / "timeline" / "rank0.jsonl").write_text("".join(  # rounds rank 1 lacks, or none
        json.dumps(e) + "\n" for e in [TIMELINES[0][0], *syncs([(7, 800), (None, 900),
                                                                     (2, 1000)]),
                                        TIMELINES[0][-1]]))
    assert run_report(run)["link"]["blocking_average_ms"] == pytest.approx(800)  # 200 800 900


def test_the_link_reads_a_few_bytes_as_bytes_not_as_zero_megabytes(tmp_path):
    """A sync run's epoch-end average of a model's few buffers (112 bytes in the bench MLP's)
    and its gradients under a megabyte are shown in B and kB, not as "0.00 MB"."""
    run = make_run(tmp_path)
    syncs = [{"t": 105.0, "kind": "sync", "wait_s": 0.003, "round": 0, "start": 100.0,
              "end": 100.003, "blocking": True, "bytes": 112}]
    (run / "timeline" / "rank0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in [TIMELINES[0][0], *syncs, TIMELINES[0][-1]]))
    (run / "summary.json").write_text(json.dumps(
        {**SUMMARY, "policy": "sync", "average_bytes": 112, "gradient_bytes": 340_000,
         "ddp_comm_s": [0.045, 0.04]}))
    text = run_fdl("report", str(run)).stdout
    assert "112 B per average, blocking ones 3 ms: 37.3 kB/s; 340.0 kB of gradients" in text
    assert "MB/s" in text and "0.00 MB" not in text  # 340 kB in 3 ms a step: 113.3 MB/s


def test_the_link_names_the_encoding_an_average_was_sent_in(tmp_path):
    """int8 on the wire is named as bf16 is; a dtype fdl does not know is shown as none."""
    run = make_run(tmp_path)
    summary = {**SUMMARY, "average_bytes": 1_004_000, "average_dtype": "int8"}
    (run / "summary.json").write_text(json.dumps(summary))
    assert run_report(run)["link"]["average_dtype"] == "int8"
    assert "1.00 MB per average (int8)" in run_fdl("report", str(run)).stdout
    (run / "summary.json").write_text(json.dumps({**summary, "average_dtype": "fp8"}))
    assert run_report(run)["link"]["average_dtype"] is None
