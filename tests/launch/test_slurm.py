"""Slurm allocations: hostlist expansion and the job read from SLURM_* variables."""

from __future__ import annotations

import pytest

from fdl.errors import UsageError
from fdl.launch.slurm import RDZV_PORT, SlurmJob, expand_nodelist, slurm_job

JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_GPUS_ON_NODE": "4",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: widths follow the numbers
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept to the low bound's width
        ("c[5],d", ["c5", "d"]),
        ("x-1.cluster,x-2.cluster", ["x-1.cluster", "x-2.cluster"]),
    ],
)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text", ["", ",", "gpu[01-03", "gpu[]", "gpu[1-2]-ib", "gpu[a-b]", "n[3-1]"]
)
def test_expand_nodelist_rejects_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(text)


def test_slurm_job_reads_the_allocation() -> None:
    job = slurm_job(JOB)
    assert job == SlurmJob(
        job_id="4242", nnodes=2, node_rank=1, master_host="gpu07", gpus_on_node=4
    )
    assert job is not None and job.endpoint == f"gpu07:{RDZV_PORT}" == "gpu07:29400"


def test_slurm_job_reads_the_older_variable_spellings() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_NODELIST": "node[3-4]", "SLURM_NNODES": "2"}
    assert slurm_job(env) == SlurmJob("7", 2, 0, "node3", None)


def test_newer_spellings_win_over_older_ones() -> None:
    env = {**JOB, "SLURM_NODELIST": "old[1-2]", "SLURM_NNODES": "9"}
    job = slurm_job(env)
    assert job is not None and (job.master_host, job.nnodes) == ("gpu07", 2)


def test_node_rank_defaults_to_zero_and_gpus_to_unknown() -> None:
    env = {k: v for k, v in JOB.items() if k not in ("SLURM_NODEID", "SLURM_GPUS_ON_NODE")}
    job = slurm_job(env)
    assert job is not None and (job.node_rank, job.gpus_on_node) == (0, None)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PATH": "/usr/bin"},
        {k: v for k, v in JOB.items() if k != "SLURM_JOB_ID"},
        {k: v for k, v in JOB.items() if k != "SLURM_JOB_NODELIST"},
        {k: v for k, v in JOB.items() if k != "SLURM_JOB_NUM_NODES"},
        {**JOB, "SLURM_JOB_NODELIST": ""},
    ],
)
def test_outside_slurm_there_is_no_job(env: dict[str, str]) -> None:
    assert slurm_job(env) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"SLURM_JOB_NUM_NODES": "two"},
        {"SLURM_NODEID": "first"},
        {"SLURM_GPUS_ON_NODE": "4(x2)"},
        {"SLURM_JOB_NODELIST": "gpu[07-"},
        {"SLURM_JOB_NODELIST": "gpu[x-y]"},
    ],
)
def test_malformed_allocation_is_a_usage_error(changes: dict[str, str]) -> None:
    with pytest.raises(UsageError) as caught:
        slurm_job({**JOB, **changes})
    assert caught.value.message.startswith("cannot read the Slurm allocation (")
    assert caught.value.exit_code == 2
    assert caught.value.hint and "--rdzv-endpoint" in caught.value.hint
