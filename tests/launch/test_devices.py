"""Device plans: one worker per chosen GPU, else CPU workers with their share of the cores."""

from __future__ import annotations

from typing import Any

import pytest

from fdl.errors import UsageError
from fdl.launch.devices import DEFAULT_CPU_WORKERS, DevicePlan, plan_devices
from fdl.system.gpus import GpuInfo, GpuSurvey

RTX_5060 = GpuInfo(0, "NVIDIA GeForce RTX 5060 Ti", (12, 0), 16311, "GPU-0b7f5d3e", "0000:01:00.0")
GTX_1060 = GpuInfo(1, "NVIDIA GeForce GTX 1060 6GB", (6, 1), 6144, "GPU-8c1d2e3f", "0000:02:00.0")
NO_UUID = (
    GpuInfo(0, "NVIDIA A100-SXM4-40GB", (8, 0)),
    GpuInfo(1, "NVIDIA A100-SXM4-40GB", (8, 0)),
    GpuInfo(2, "NVIDIA A100-SXM4-40GB", (8, 0)),
)


def survey(*gpus: GpuInfo) -> GpuSurvey:
    return GpuSurvey("fixture" if gpus else "none", gpus, None, None)


def plan(
    gpus: tuple[GpuInfo, ...] = (),
    *,
    devices: str | None = None,
    nproc: int | str | None = None,
    logical_cores: int = 16,
    env: dict[str, str] | None = None,
) -> DevicePlan:
    return plan_devices(
        survey=survey(*gpus),
        devices=devices,
        nproc=nproc,
        logical_cores=logical_cores,
        env=env or {},
    )


# --- CPU workers -----------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [None, "auto"])
def test_without_gpus_two_cpu_workers_share_the_cores(nproc: Any) -> None:
    result = plan(nproc=nproc, logical_cores=16)
    assert result == DevicePlan(
        "cpu", DEFAULT_CPU_WORKERS, (), 8, None, "no NVIDIA GPU: 2 CPU workers"
    )
    assert DEFAULT_CPU_WORKERS == 2
    assert [result.device_name(r) for r in range(2)] == ["cpu", "cpu"]
    assert result.describe(1) == "cpu (8 threads)"


@pytest.mark.parametrize(("cores", "threads"), [(7, 3), (2, 1), (1, 1)])
def test_cpu_threads_are_the_cores_divided_by_workers_at_least_one(
    cores: int, threads: int
) -> None:
    assert plan(logical_cores=cores).threads_per_worker == threads


def test_nproc_count_without_gpus_sets_the_cpu_worker_count() -> None:
    result = plan(nproc=4, logical_cores=16)
    assert (result.kind, result.nproc, result.threads_per_worker) == ("cpu", 4, 4)
    assert result.cuda_visible_devices is None


@pytest.mark.parametrize("gpus", [(), (RTX_5060, GTX_1060)])
def test_nproc_cpu_forces_one_cpu_worker_per_logical_core(gpus: tuple[GpuInfo, ...]) -> None:
    result = plan(gpus, nproc="cpu", logical_cores=12)
    assert (result.kind, result.nproc, result.gpus) == ("cpu", 12, ())
    assert result.threads_per_worker == 1
    assert result.cuda_visible_devices is None
    assert result.device_name(11) == "cpu"


def test_nproc_cpu_with_gpus_says_why() -> None:
    assert plan((RTX_5060,), nproc="cpu", logical_cores=4).reason == (
        "--nproc-per-node cpu: 4 CPU workers"
    )


# --- GPU workers -----------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [None, "auto", "gpu"])
def test_one_worker_per_visible_gpu(nproc: Any) -> None:
    result = plan((RTX_5060, GTX_1060), nproc=nproc, logical_cores=16)
    assert (result.kind, result.nproc, result.gpus) == ("cuda", 2, (RTX_5060, GTX_1060))
    assert result.threads_per_worker == 8
    assert [result.device_name(r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert result.describe(1) == "cuda:1 NVIDIA GeForce GTX 1060 6GB (sm_61)"
    assert result.cuda_visible_devices == "GPU-0b7f5d3e,GPU-8c1d2e3f"
    assert result.reason == "2 GPU worker(s)"


def test_nproc_count_takes_the_first_gpus() -> None:
    result = plan(NO_UUID, nproc=2)
    assert (result.nproc, result.gpus, result.cuda_visible_devices) == (2, NO_UUID[:2], "0,1")


def test_more_workers_than_gpus_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as caught:
        plan((RTX_5060, GTX_1060), nproc=3)
    assert caught.value.message == (
        "--nproc-per-node 3 asks for more workers than GPUs (2 visible)"
    )
    assert caught.value.hint and "--nproc-per-node cpu" in caught.value.hint
    assert caught.value.exit_code == 2


def test_nproc_is_checked_against_the_devices_picked() -> None:
    with pytest.raises(UsageError, match=r"more workers than GPUs \(1 visible\)"):
        plan(NO_UUID, devices="2", nproc=2)


# --- --devices -------------------------------------------------------------------------------


def test_devices_picks_a_gpu_and_names_it_by_uuid() -> None:
    result = plan((RTX_5060, GTX_1060), devices="1", env={"CUDA_VISIBLE_DEVICES": "5,6"})
    assert (result.kind, result.nproc, result.gpus) == ("cuda", 1, (GTX_1060,))
    assert result.device_name(0) == "cuda:0"  # local rank 0 sees only the picked GPU
    assert result.cuda_visible_devices == "GPU-8c1d2e3f"


def test_devices_keep_the_order_given() -> None:
    result = plan((RTX_5060, GTX_1060), devices="1,0")
    assert result.gpus == (GTX_1060, RTX_5060)
    assert result.cuda_visible_devices == "GPU-8c1d2e3f,GPU-0b7f5d3e"


def test_without_uuid_the_parents_cuda_visible_devices_is_mapped() -> None:
    # The parent sees physical GPUs 2 and 3 as 0 and 1; picking 1 means physical GPU 3.
    result = plan(NO_UUID[:2], devices="1", env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert result.cuda_visible_devices == "3"


def test_without_uuid_or_parent_list_the_index_is_used() -> None:
    assert plan(NO_UUID, devices="2,0").cuda_visible_devices == "2,0"
    assert plan(NO_UUID, devices="1", env={"CUDA_VISIBLE_DEVICES": ""}).cuda_visible_devices == "1"


@pytest.mark.parametrize(
    ("gpus", "devices", "message"),
    [
        (
            (RTX_5060, GTX_1060),
            "2",
            "--devices names GPU 2, which does not exist (visible GPUs: 0, 1)",
        ),
        (
            (RTX_5060, GTX_1060),
            "0,5",
            "--devices names GPU 5, which does not exist (visible GPUs: 0, 1)",
        ),
        ((), "0", "--devices names GPU 0, which does not exist (visible GPUs: none)"),
    ],
)
def test_devices_naming_a_missing_gpu_is_a_usage_error(
    gpus: tuple[GpuInfo, ...], devices: str, message: str
) -> None:
    with pytest.raises(UsageError) as caught:
        plan(gpus, devices=devices)
    assert caught.value.message == message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("devices", ["0,0", "1,0,1", "first", "0,x", "", ","])
def test_devices_must_be_distinct_gpu_indices(devices: str) -> None:
    with pytest.raises(UsageError) as caught:
        plan((RTX_5060, GTX_1060), devices=devices)
    assert caught.value.message == f"--devices {devices!r} is not a list of distinct GPU indices"
    assert caught.value.hint == "e.g. --devices 0,1 (visible GPUs: 0, 1)"


def test_gpu_workers_without_a_gpu_is_an_error():
    from fdl.errors import UsageError
    from fdl.system.gpus import GpuSurvey

    with pytest.raises(UsageError, match="no NVIDIA GPU"):
        plan_devices(survey=GpuSurvey("none", (), None, None), devices=None, nproc="gpu",
                     logical_cores=2, env={})
