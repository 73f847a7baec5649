"""What fdl run's launcher does as an attempt's workers start: torch's agent asks fdl's
LogsSpecs for the workers' logs (fdl.launch.elastic.run_logs_specs), and ``on_workers`` is
called then, once per attempt, the logs made; the curves' matplotlib is imported meanwhile
only on a node with a core to spare beyond its workers (fdl.cli.run)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from fdl.cli import run as run_cli
from fdl.launch.elastic import run_logs_specs


def envs(attempt: int) -> dict[int, dict[str, str]]:
    return {local: {"RANK": str(local), "TORCHELASTIC_RESTART_COUNT": str(attempt)}
            for local in (0, 1)}


def test_on_workers_is_called_once_per_attempt_after_the_logs_are_made(tmp_path):
    logs = tmp_path / "logs"
    seen: list[list[str]] = []
    specs = run_logs_specs(logs, quiet=True,
                           on_workers=lambda: seen.append(sorted(p.name for p in logs.iterdir())))
    specs.reify(envs(0))
    assert seen == [["rank0.log", "rank1.log"]]
    specs.reify(envs(1))  # a restart: the first attempt's logs are kept aside
    assert seen[1] == ["rank0.attempt0.log", "rank0.log", "rank1.attempt0.log", "rank1.log"]
    assert len(seen) == 2


def test_without_on_workers_the_logs_are_made_as_before(tmp_path):
    specs = run_logs_specs(tmp_path / "logs", quiet=False)  # held by torch's agent in a run
    dest = specs.reify(envs(0))
    for local in (0, 1):
        assert os.path.samefile(dest.stdouts[local], tmp_path / "logs" / f"rank{local}.log")
        assert dest.tee_stdouts[local] == dest.stdouts[local]


def test_a_link_swapped_in_after_the_logs_are_made_is_not_written_through(tmp_path):
    """Between fdl making a worker's log (never through a link) and torch opening it, someone
    who can write in logs/ replaces it with a link to another file: torch's open, as its
    subprocess handler does it, still reaches the log fdl made, never the link's target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    logs = tmp_path / "logs"
    specs = run_logs_specs(logs, quiet=True)
    dest = specs.reify(envs(0))
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    os.replace(planted, logs / "rank0.log")  # atomic: the log's name is now the link
    with open(dest.stdouts[0], "w") as torch_opens:  # torch's SubprocessHandler: open(path, "w")
        torch_opens.write("worker output\n")
    assert victim.read_text() == "keep me\n"


@pytest.mark.parametrize(("cores", "workers", "spare"),
                         [(2, 1, True), (2, 2, False), (16, 2, True), (1, 1, False)])
def test_the_import_waits_for_a_core_to_spare(monkeypatch, cores, workers, spare):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    assert run_cli._core_to_spare(SimpleNamespace(nproc_per_node=workers)) is spare
