"""`logs/rank<r>.crash.json`: which frame is the user's, what the record holds, what a reader
accepts, and which of several failed ranks `fdl run` blames. Pure functions, no processes (the
real crash is tests/launch/test_run_end.py)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest

from fdl.launch.elastic import root_rank
from fdl.rundir.crash import (
    MAX_ERROR_LINES,
    TAIL_LINES,
    Crash,
    crash_path,
    describe_crash,
    own_frame,
    read_crash,
    write_crash,
)

FDL = Path(__file__).resolve().parents[2] / "fdl"


def frames(*files: str) -> traceback.StackSummary:
    return traceback.StackSummary.from_list([(name, 10 + i, f"f{i}", "x = 1")
                                             for i, name in enumerate(files)])


@pytest.mark.parametrize(("files", "expected"), [
    # the last frame under the script's directory wins, torch's frames below it skipped
    (["/p/train.py", "/p/model.py", "/venv/lib/site-packages/torch/nn/functional.py"],
     "/p/model.py"),
    # a virtual environment inside the project is installed code, not the user's
    (["/p/train.py", "/p/.venv/lib/python3.11/site-packages/torch/x.py"], "/p/train.py"),
    (["/p/train.py", "/usr/lib/python3/dist-packages/numpy/x.py"], "/p/train.py"),
    (["<frozen runpy>", "/p/train.py", "<string>"], "/p/train.py"),
    (["<frozen runpy>", "/elsewhere/lib.py"], None),
])
def test_the_users_frame_is_the_last_one_in_their_own_code(files, expected):
    found = own_frame(frames(*files), home=Path("/p"))
    assert (found.filename if found else None) == expected


def test_fdls_own_frames_are_not_the_users_even_beside_the_script():
    """A script at the root of an fdl checkout: fdl/ is under its directory."""
    script = str(FDL.parent / "train.py")
    found = own_frame(frames(script, str(FDL / "engine" / "rounds.py")), home=FDL.parent)
    assert found is not None and found.filename == script


def test_a_crash_is_the_frame_whole_then_the_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def step(batch):\n    return batch[0] + int('not a number')\n")
    namespace: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    try:
        namespace["step"]([1])
    except ValueError as exc:
        crash = describe_crash(exc, home=tmp_path, pid=7, t=1.5)
    assert crash.frame[:2] == (f'File "{script}", line 2, in step',
                               "  return batch[0] + int('not a number')")
    assert set(crash.frame[2].strip()) == {"^"}, crash.frame
    assert crash.error == ("ValueError: invalid literal for int() with base 10: 'not a number'",)


def test_a_long_error_message_is_cut_the_log_keeps_it(tmp_path):
    exc = RuntimeError("\n".join(f"line {i}" for i in range(40)))
    crash = describe_crash(exc, home=tmp_path, pid=1, t=0.0)
    assert crash.frame == ()  # raised nowhere: no frame
    assert len(crash.error) == MAX_ERROR_LINES + 1
    assert crash.error[:-TAIL_LINES - 1] == tuple(
        ["RuntimeError: line 0"] + [f"line {i}" for i in range(1, MAX_ERROR_LINES - TAIL_LINES)])
    assert crash.error[-TAIL_LINES - 1] == f"... ({40 - MAX_ERROR_LINES} more lines)"
    assert crash.error[-TAIL_LINES:] == tuple(f"line {i}" for i in range(40 - TAIL_LINES, 40))


def test_a_dataloader_worker_s_error_keeps_the_line_that_explains_it(tmp_path):
    """A collate_fn that raised in a DataLoader worker: torch re-raises it in the main process
    with the worker's whole traceback in the message, and the explaining line, last, was cut."""
    import torch

    def check(sample, depth):  # a collate that calls helpers, as a real one does
        if depth:
            return check(sample, depth - 1)
        raise ValueError("sample 3 has 7 tokens, the batch 8")

    def collate(samples):
        return [check(sample, 3) for sample in samples]

    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=1,
                                         collate_fn=collate)
    with pytest.raises(ValueError) as raised:
        next(iter(loader))
    crash = describe_crash(raised.value, home=tmp_path, pid=1, t=0.0)
    assert len(str(raised.value).splitlines()) > MAX_ERROR_LINES  # long enough to be cut
    assert crash.error[-1] == "ValueError: sample 3 has 7 tokens, the batch 8"


def test_a_record_is_read_back_only_for_the_process_that_wrote_it(tmp_path):
    crash = Crash(pid=42, t=3.0, frame=("File x",), error=("ValueError: v",))
    write_crash(tmp_path, 1, crash)
    assert read_crash(tmp_path, 1, pid=42) == crash
    assert read_crash(tmp_path, 1, pid=43) is None  # an earlier attempt's worker
    assert read_crash(tmp_path, 0, pid=42) is None  # none for that rank


@pytest.mark.parametrize("content", [
    "not json", "[]", '{"pid": 42}', '{"pid": 42, "t": -1, "frame": [], "error": []}',
    '{"pid": 42, "t": 1, "frame": "File x", "error": []}',
    '{"pid": 42, "t": 1, "frame": [], "error": [3]}', '{"pid": true, "t": 1}',
])
def test_a_damaged_record_is_no_record(tmp_path, content):
    crash_path(tmp_path, 0).write_text(content)
    assert read_crash(tmp_path, 0, pid=42) is None


def crash_at(t: float) -> Crash:
    return Crash(pid=1, t=t, frame=(), error=("E",))


@pytest.mark.parametrize(("first", "crashes", "expected"), [
    # rank 1 raised first; rank 0 raised later (a peer's death) but torch noticed it first
    (0, {0: crash_at(2.0), 1: crash_at(1.0)}, 1),
    (1, {0: crash_at(2.0), 1: crash_at(1.0)}, 1),
    # torch's first failure was killed or exited: no record, its order stands
    (0, {0: None, 1: crash_at(1.0)}, 0),
    (2, {0: None, 1: None, 2: None}, 2),
    # a tie goes to the lower rank
    (1, {0: crash_at(1.0), 1: crash_at(1.0)}, 0),
])
def test_the_root_cause_is_the_rank_that_raised_first(first, crashes, expected):
    assert root_rank(first, crashes) == expected


@pytest.mark.parametrize(("first", "crashes", "stopped", "expected"), [
    # every rank raises; the agent stopped rank 1 (SIGTERM) before it could, and torch
    # reported it first: the rank that raised is the cause (it was "killed by SIGTERM", exit 143)
    (1, {0: crash_at(1.0), 1: None}, {1}, 0),
    (2, {0: None, 1: crash_at(2.0), 2: None}, {0, 2}, 1),
    # stopped, but no rank raised: torch's order is all there is
    (1, {0: None, 1: None}, {1}, 1),
    # killed by something else (the OOM killer's SIGKILL): that rank stays the cause
    (1, {0: crash_at(1.0), 1: None}, set(), 1),
])
def test_a_rank_the_agent_stopped_is_not_the_cause_when_another_raised(first, crashes, stopped,
                                                                        expected):
    assert root_rank(first, crashes, stopped=stopped) == expected


def test_the_record_is_json_a_person_can_read(tmp_path):
    write_crash(tmp_path, 3, Crash(pid=5, t=1.0, frame=("a",), error=("b",)))
    assert json.loads(crash_path(tmp_path, 3).read_text()) == {
        "pid": 5, "t": 1.0, "frame": ["a"], "error": ["b"]}
