"""summary.json's ``precision``: each rank's, as the engine gives it to RunSummary, written
and read back checked; a summary without it (an older run's, or one built without it) stays
readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.errors import UsageError
from fdl.rundir.summary import RankSummary, RunSummary, load_summary, write_summary


def summary(precisions: list[str] | None = None, **overrides) -> dict:
    devices = ["cuda:0 NVIDIA H100", "cuda:1 Tesla T4"]
    ranks = [RankSummary(device=device, precision=precision, samples=samples, busy_s=busy)
             for device, precision, samples, busy in zip(
                 devices, precisions or [None, None], [600, 400], [8.0, 9.0], strict=True)]
    return RunSummary(policy="cadence", backend="auto", emulated_slowdown=None, epochs=1,
                      wall_s=10.0, ranks=ranks, syncs=1, comm_ms=[20.0],
                      final_loss=0.25).to_dict() | overrides


def test_each_ranks_precision_is_written_and_read_back(tmp_path: Path) -> None:
    document = summary(precisions=["bf16", "fp32"])
    assert document["precision"] == ["bf16", "fp32"]
    write_summary(tmp_path, document)
    assert load_summary(tmp_path)["precision"] == ["bf16", "fp32"]


def test_without_precisions_the_field_is_null_and_still_valid(tmp_path: Path) -> None:
    document = summary()
    assert document["precision"] is None
    write_summary(tmp_path, document)
    assert load_summary(tmp_path)["precision"] is None


def test_a_summary_that_predates_the_field_loads(tmp_path: Path) -> None:
    document = summary()
    del document["precision"]
    write_summary(tmp_path, document)
    assert "precision" not in load_summary(tmp_path)


def test_devices_of_another_length_than_the_world_are_refused(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(summary(devices=["cpu"])))
    with pytest.raises(UsageError, match="world_size is 2 but devices has 1 entries"):
        load_summary(tmp_path)


@pytest.mark.parametrize(("loss", "said"), [(float("nan"), "NaN"), (float("inf"), "infinite"),
                                            (0.25, None), (None, None)])
def test_a_summary_s_diverged_loss_is_read_one_way_for_run_bench_and_compare(tmp_path: Path,
                                                                             loss, said) -> None:
    """fdl run exits 1 for a diverged run; fdl bench and fdl compare still record it as a
    result (its NaN loss is what they compare), all through this one reading."""
    from fdl.rundir.summary import diverged_loss

    assert diverged_loss(tmp_path) is None  # no summary
    write_summary(tmp_path, summary(final_loss=loss))
    assert diverged_loss(tmp_path) == said
    (tmp_path / "summary.json").write_text("{torn")
    assert diverged_loss(tmp_path) is None  # unreadable: the report says why
