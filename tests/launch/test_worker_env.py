"""fdl.launch.worker_env: every variable fdl adds to a worker's environment, from one pure
function, and the rules that let a user's own value stand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.launch.devices import DevicePlan
from fdl.launch.worker_env import build_worker_env
from fdl.settings import SETTINGS, Setting
from fdl.system.gpu_info import GpuInfo

CPU = DevicePlan("cpu", 2, (), 3, None, "no NVIDIA GPU: 2 CPU workers")
RUN_DIR = Path("/runs/x")


def defaults(**given: Setting) -> dict[str, Setting]:
    """Every run setting at its default, but ``given``."""
    return {spec.name: Setting(spec.default, "default") for spec in SETTINGS} | given


def planned(settings: dict[str, Setting] | None = None, *, devices: DevicePlan = CPU,
            parent: dict[str, str] | None = None, resume: bool = False, live: bool = False,
            launcher_pid: int | None = None) -> dict[str, str]:
    return build_worker_env(defaults() if settings is None else settings, devices=devices,
                            run_dir=RUN_DIR, parent=parent or {}, resume=resume, live=live,
                            launcher_pid=launcher_pid)


def test_a_plain_plan_gives_the_run_dir_sources_and_threads_only():
    env = planned()
    assert set(env) == {"FDL_SOURCES", "FDL_RUN_DIR", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}
    assert env["FDL_RUN_DIR"] == str(RUN_DIR)
    assert env["OMP_NUM_THREADS"] == "3"  # the worker's share of the cores
    assert set(json.loads(env["FDL_SOURCES"])) == {s.name for s in SETTINGS if s.engine}


def test_everything_a_launch_adds():
    settings = defaults(policy=Setting("async", "flag"), max_restarts=Setting(2, "flag"))
    env = planned(settings, resume=True, live=True, launcher_pid=4242)
    assert env["FDL_POLICY"] == "async"
    assert json.loads(env["FDL_SOURCES"])["policy"] == "flag"
    assert env["FDL_RESUME"] == "1"
    assert env["FDL_PROGRESS"] == "0.25"
    assert env["FDL_LAUNCHER_PID"] == "4242"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "FDL_MAX_RESTARTS" not in env  # the launcher's setting, not the engine's


@pytest.mark.parametrize("value", ["0", "1"])
def test_a_users_own_store_sharing_choice_is_left_to_stand(value):
    env = planned(defaults(max_restarts=Setting(1, "flag")),
                  parent={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": value})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env  # the parent's reaches the workers


@pytest.mark.parametrize("parent", [{}, {"CUDA_VISIBLE_DEVICES": "0"}])
def test_cpu_workers_see_no_gpu_even_on_a_gpu_host(parent):
    """A CPU plan on a box with a GPU: the workers must not train on it while the plan, the
    dry run and config.json say cpu (a user's own CUDA_VISIBLE_DEVICES included)."""
    cpu_on_gpu_host = DevicePlan("cpu", 32, (), 1, None, "--nproc-per-node cpu: 32 CPU workers")
    assert planned(devices=cpu_on_gpu_host, parent=parent)["CUDA_VISIBLE_DEVICES"] == ""


def test_a_users_own_omp_num_threads_wins():
    assert planned(parent={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    assert planned(parent={"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "3"  # empty: unset


def test_gpu_workers_see_exactly_their_gpus_in_bus_order():
    gpus = tuple(GpuInfo(index, f"GPU {index}", (9, 0), uuid=f"GPU-{index}") for index in (0, 1))
    devices = DevicePlan("cuda", 2, gpus, 4, "GPU-1,GPU-0", "2 GPU worker(s)")
    env = planned(devices=devices)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1,GPU-0"
    assert planned()["CUDA_VISIBLE_DEVICES"] == ""  # CPU workers see none
