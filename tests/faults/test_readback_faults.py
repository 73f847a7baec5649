"""Files fdl reads back that are not what it wrote, made for real in the test: a FIFO (which
would block a plain ``open`` forever), a link to ``/dev/zero`` (which would fill the memory), a
link planted where fdl wrote a file, JSON nested 200,000 deep (a ``RecursionError`` for plain
``json``), a 400-digit integer and ``1e308`` where a figure belongs (an ``OverflowError`` in the
report's arithmetic).

Every command ends within the guard (a hang fails the test through ``run_fdl``'s timeout) in
one ``error:`` line naming the file and what was wrong, or, where fdl can go on (a rank's
timeline), a warning and the report of what is left. The primitives of ``fdl.readback`` are
tested first, then each command that reads such a file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, assert_one_error, install_variant, run_fdl

from fdl import readback
from fdl.libtorch.store import Store

DEEP = "[" * 200_000 + "]" * 200_000
BIG = "1" * 400
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "mlp_synthetic.py"


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def deep(path: Path) -> None:
    path.write_text(DEEP)


HOSTILE = {"fifo": (fifo, "is a FIFO, not a regular file"),
           "dev-zero": (zero, "is a symbolic link"),
           "deep": (deep, "nested deeper than 64 levels")}


# ---- the primitives -------------------------------------------------------------------------

@pytest.mark.parametrize("make", ["fifo", "dev-zero", "deep"])
def test_read_json_refuses_what_would_hang_fill_memory_or_recurse(tmp_path, make):
    path = tmp_path / "summary.json"
    maker, problem = HOSTILE[make]
    maker(path)
    with pytest.raises(readback.ReadBackError, match=problem) as caught:
        readback.read_json(path)
    assert caught.value.path == path


def test_a_device_or_a_directory_is_not_read_even_when_links_are_followed(tmp_path):
    with pytest.raises(readback.ReadBackError, match="is a character device"):
        readback.read_bytes(Path("/dev/zero"), limit=10, follow=True)
    with pytest.raises(readback.ReadBackError, match="is a directory"):
        readback.read_bytes(tmp_path, limit=10)


def test_a_link_is_refused_unless_followed_and_a_missing_file_is_file_not_found(tmp_path):
    target = tmp_path / "target.json"
    target.write_text('{"a": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(readback.ReadBackError, match="is a symbolic link"):
        readback.read_json(link)
    assert readback.read_json(link, follow=True) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        readback.read_json(tmp_path / "absent.json")


def test_a_file_beyond_its_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"pad": "x" * 100}))
    with pytest.raises(readback.ReadBackError, match="more than"):
        readback.read_json(path, limit=64)
    assert readback.read_json(path, limit=1024)["pad"] == "x" * 100


@pytest.mark.parametrize(("text", "problem"), [
    (DEEP, "nested deeper than 64 levels"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested deeper than 64 levels"),
    (f'{{"wall_s": {BIG}}}', "integer of 400 digits"),
    (str(1 << 64), "beyond 64 bits"),
    ('{"wall_s": 1e400}', "does not fit a double"),
])
def test_parse_json_refuses_nesting_and_numbers_no_field_can_hold(text, problem):
    with pytest.raises(ValueError, match=problem):
        readback.parse_json(text)


def test_parse_json_takes_what_fdl_writes(tmp_path):
    """64 levels, brackets inside strings, a diverged loss (NaN), the widest seed."""
    nested = '{"a": ' * 63 + "1" + "}" * 63
    assert readback.parse_json(nested)
    assert readback.parse_json('{"name": "' + "[" * 500 + '"}') == {"name": "[" * 500}
    loss = readback.parse_json('{"train_loss": NaN, "seed": 18446744073709551615}')
    assert loss["train_loss"] != loss["train_loss"] and loss["seed"] == (1 << 64) - 1


# ---- fdl report -----------------------------------------------------------------------------

SUMMARY = {"policy": "cadence", "backend": "cpu", "world_size": 1, "devices": ["cpu"],
           "emulated_slowdown": None, "epochs": 1, "samples": 100, "wall_s": 10.0,
           "throughput": {"samples_per_s": 10.0, "per_rank_samples_per_s": [10.0]},
           "sync": {"rounds": 1, "mean_ms": 5.0, "overhead": 0.01}, "idle_fraction": [0],
           "eval": {"accuracy": 0.9}, "final_loss": 0.25, "anchor_history": []}
EVENTS = [{"t": 100.0, "kind": "start", "attempt": 0},
          {"t": 101.0, "kind": "round", "round": 0, "steps": 10, "samples": 100,
           "compute_s": 1.0, "data_s": 0.1},
          {"t": 101.5, "kind": "sync", "round": 0, "wait_s": 0.05},
          {"t": 110.0, "kind": "final"}]


def make_run(root: Path, *, summary: str | None = None, config: str | None = None) -> Path:
    run = root / "run"
    (run / "timeline").mkdir(parents=True)
    (run / "summary.json").write_text(summary or json.dumps(SUMMARY))
    (run / "config.json").write_text(
        config or json.dumps({"engine": {"batch_size": {"value": 10}}}))
    (run / "timeline" / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    return run


@pytest.mark.parametrize("name", ["summary.json", "config.json"])
@pytest.mark.parametrize("make", ["fifo", "dev-zero", "deep"])
def test_report_of_a_hostile_run_file_is_one_error(tmp_path, name, make):
    run = make_run(tmp_path)
    maker, problem = HOSTILE[make]
    maker(run / name)
    assert_one_error(run_fdl("report", str(run)), 2, f"{name} ", problem)


@pytest.mark.parametrize(("field", "value", "why"), [
    ("wall_s", "1e308", "wall_s is 1e+308, expected a number in [0, 1e+09]"),
    ("wall_s", BIG, "integer of 400 digits"),
    ("samples_per_s", "NaN", "throughput.samples_per_s is NaN, expected a number in [0, "),
    ("samples_per_s", "-5", "throughput.samples_per_s is -5, expected a number in [0, "),
    ("mean_ms", "-1", "sync.mean_ms is -1, expected a number in [0, "),
    ("accuracy", "1e308", "eval.accuracy is 1e+308, expected a number at most 1e+15"),
    ("final_loss", "1e308", "final_loss is 1e+308"),
])
def test_an_impossible_figure_in_summary_json_is_named_not_printed(tmp_path, field, value, why):
    text = json.dumps(SUMMARY).replace('"@', "")
    holders = {"samples_per_s": '"samples_per_s": 10.0', "mean_ms": '"mean_ms": 5.0',
               "accuracy": '"accuracy": 0.9', "wall_s": '"wall_s": 10.0',
               "final_loss": '"final_loss": 0.25'}
    text = text.replace(holders[field], holders[field].split(":")[0] + ": " + value)
    run = make_run(tmp_path, summary=text)
    assert_one_error(run_fdl("report", str(run)), 2, why)


def test_a_huge_batch_size_in_config_json_is_named(tmp_path):
    run = make_run(tmp_path, config='{"engine": {"batch_size": {"value": 1e308}}}')
    assert_one_error(run_fdl("report", str(run)), 2, "engine.batch_size is 1e+308")


@pytest.mark.parametrize(("make", "why"), [
    (fifo, "is unreadable (is a FIFO, not a regular file)"),
    (zero, "is unreadable (is a symbolic link"),
    (lambda p: p.write_text(json.dumps(EVENTS[0]) + "\n" + '{"kind": "round", "x": '
                            + DEEP + "}\n" + json.dumps(EVENTS[-1]) + "\n"),
     "line(s) that are not JSON records (first: line 2)"),
    (lambda p: p.write_text("".join(json.dumps({**e, "compute_s": 1e308} if e["kind"] ==
                                               "round" else e) + "\n" for e in EVENTS)),
     "'compute_s' is 1e+308, expected a number in [0, 1e+09]"),
], ids=["fifo", "dev-zero", "deep-line", "huge-duration"])
def test_a_hostile_timeline_is_a_warning_and_the_report_goes_on(tmp_path, make, why):
    run = make_run(tmp_path)
    make(run / "timeline" / "rank0.jsonl")
    proc = run_fdl("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warning = " ".join(proc.stderr.split())
    assert "warning: rank 0's timeline is incomplete" in warning and why in warning, warning
    assert "throughput" in proc.stdout  # the report itself came out


def test_slowdown_strings_in_an_old_config_are_left_out_of_a_partial_report(tmp_path):
    """A run stopped before its summary: the report rebuilds it from the timelines and
    config.json, whose simulate_slowdown an older fdl (or a hand) wrote as strings."""
    run = make_run(tmp_path, config=json.dumps(
        {"fdl_version": "0.1.0", "engine": {"batch_size": {"value": 10},
                                            "simulate_slowdown": {"value": ["2", "x"]}}}))
    (run / "summary.json").unlink()
    proc = run_fdl("report", "--json", str(run))
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["complete"] is False and document["emulated_slowdown"] is None
    shown = run_fdl("report", str(run))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "warning: config.json's simulate_slowdown is not a list of factors" in shown.stderr


@pytest.mark.parametrize("make", [fifo, zero, lambda p: p.write_text(f'{{"epoch": {BIG}}}\n')],
                         ids=["fifo", "dev-zero", "400-digits"])
def test_a_partial_report_says_what_of_a_hostile_metrics_file_it_leaves_out(tmp_path, make):
    run = make_run(tmp_path, config=json.dumps({"fdl_version": "0.1.0"}))
    (run / "summary.json").unlink()
    make(run / "metrics.jsonl")
    proc = run_fdl("report", str(run))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "warning: metrics.jsonl " in proc.stderr and "left out" in proc.stderr, proc.stderr
    assert "throughput" in proc.stdout


def test_a_diverged_loss_is_named_not_printed_as_a_figure(tmp_path):
    text = json.dumps({**SUMMARY, "eval": {"accuracy": 0.5, "loss": 1.0}})
    text = text.replace('"final_loss": 0.25', '"final_loss": NaN').replace('"loss": 1.0',
                                                                          '"loss": Infinity')
    proc = run_fdl("report", str(make_run(tmp_path, summary=text)))
    assert proc.returncode == 0, proc.stderr
    assert "final loss  NaN (diverged)" in proc.stdout and "loss infinite (diverged)" in \
        proc.stdout, proc.stdout
    assert not re.search(r"\bnan\b|\binf\b", proc.stdout), proc.stdout


def test_summary_json_that_is_a_directory_is_named(tmp_path):
    run = make_run(tmp_path)
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    assert_one_error(run_fdl("report", str(run)), 2, "summary.json is a directory")


def test_an_anchor_change_that_is_not_one_is_named(tmp_path):
    run = make_run(tmp_path, summary=json.dumps({**SUMMARY, "anchor_history": [[1, "x", "r"]]}))
    assert_one_error(run_fdl("report", str(run)), 2, "anchor_history is list")


# ---- fdl run --resume / --overwrite-run-dir, fdl compare, fdl bench report ---------------------

def planted(folder: Path, name: str, make: str) -> tuple[Path, str]:
    """``folder`` made, with a hostile ``name`` in it (``HOSTILE[make]``); the folder and the
    problem the refusal must name."""
    folder.mkdir()
    maker, problem = HOSTILE[make]
    maker(folder / name)
    return folder, problem


@pytest.mark.parametrize("make", ["fifo", "dev-zero", "deep"])
def test_resume_of_a_run_whose_config_is_hostile_is_one_error(tmp_path, make):
    run, problem = planted(tmp_path / "run", "config.json", make)
    proc = run_fdl("run", "--resume", str(run), str(SCRIPT))
    assert_one_error(proc, 2, "config.json", problem)


@pytest.mark.parametrize("make", ["fifo", "dev-zero"])
def test_overwrite_of_a_directory_whose_config_is_hostile_is_refused_not_read(tmp_path, make):
    run, _ = planted(tmp_path / "run", "config.json", make)
    proc = run_fdl("run", "--run-dir", str(run), "--overwrite-run-dir", str(SCRIPT))
    assert_one_error(proc, 2, "holds no fdl run")
    assert (run / "config.json").is_symlink() or (run / "config.json").exists()


@pytest.mark.parametrize("make", ["fifo", "dev-zero", "deep"])
def test_compare_into_an_out_whose_plan_is_hostile_is_one_error(tmp_path, make):
    out, problem = planted(tmp_path / "out", "plan.json", make)
    proc = run_fdl("compare", str(SCRIPT), "--out", str(out), "--dry-run")
    assert_one_error(proc, 2, "plan.json cannot be read as fdl compare's plan", problem)


RESULT = {"model": "mlp", "mode": "solo", "wall_s": 1.0, "samples_per_s": 100.0}


def test_bench_report_with_a_sweep_json_that_is_a_fifo_is_one_error(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps(RESULT) + "\n")
    fifo(tmp_path / "sweep.json")
    proc = run_fdl("bench", "report", str(tmp_path))
    assert_one_error(proc, 2, "sweep.json is a FIFO, not a regular file")


@pytest.mark.parametrize(("lines", "why"), [
    (None, "results.jsonl is a FIFO, not a regular file"),
    ([json.dumps(RESULT)[:-1] + ', "x": ' + DEEP + "}", json.dumps(RESULT)],
     "results.jsonl:1: not a JSON record"),
    ([json.dumps({**RESULT, "wall_s": 1e308})], "field 'wall_s' must be a number in [0, "),
    ([json.dumps(RESULT).replace('"wall_s": 1.0', f'"wall_s": {BIG}'), json.dumps(RESULT)],
     "results.jsonl:1: not a JSON record"),
], ids=["fifo", "deep", "huge", "400-digits"])
def test_bench_report_of_hostile_results_is_one_error(tmp_path, lines, why):
    path = tmp_path / "results.jsonl"
    if lines is None:
        fifo(path)
    else:
        path.write_text("".join(line + "\n" for line in lines))
    proc = run_fdl("bench", "report", str(tmp_path))
    assert_one_error(proc, 2, why)


# ---- the files a user names: fdl.toml, the survey, the store's variant.json -------------------

@pytest.mark.parametrize(("make", "why"), [
    (fifo, "fdl.toml is not a file"),
    (lambda p: p.write_text("[tool.fdl]\nx = " + DEEP + "\n"), "nested too deep"),
], ids=["fifo", "deep"])
def test_a_hostile_fdl_toml_is_one_error(tmp_path, make, why):
    make(tmp_path / "fdl.toml")
    proc = run_fdl("run", "--dry-run", str(SCRIPT), cwd=tmp_path)
    assert_one_error(proc, 2, why)


@pytest.mark.parametrize("make", ["fifo", "deep"])
def test_a_hostile_survey_file_is_one_error(tmp_path, make):
    survey = tmp_path / "survey.json"
    maker, problem = HOSTILE[make]
    maker(survey)
    proc = run_fdl("diagnose", env={"FDL_GPU_SURVEY": str(survey)})
    assert_one_error(proc, 1, "survey.json: the GPU survey", problem)


def test_a_deep_variant_json_is_one_warning_and_the_variant_skipped(tmp_path):
    home = tmp_path / "home"
    install_variant(Store(home / "libtorch"), "deep")
    (home / "libtorch" / "precompiled" / "deep" / "variant.json").write_text(DEEP)
    proc = run_fdl("libtorch", "list", env={"FLODL_HOME": str(home),
                                            "FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "precompiled/deep: variant.json is nested deeper than 64 levels: skipped" in \
        proc.stderr, proc.stderr


def test_the_tail_of_a_worker_log_that_is_a_fifo_or_a_device_is_empty_not_a_hang(tmp_path):
    """What a failed run's root-cause block and `fdl bench report` quote from a worker's log."""
    from fdl.launch.child import log_tail

    log = tmp_path / "rank0.log"
    fifo(log)
    assert log_tail(log) == []
    zero(log)
    assert log_tail(log) == []
    log.unlink()
    log.write_text("".join(f"line {i}\n" for i in range(200_000)))
    assert log_tail(log, count=2) == ["line 199998", "line 199999"]
