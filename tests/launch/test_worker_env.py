"""fdl.launch.worker_env: every variable fdl adds to a worker's environment, from one pure
function, and the rules that let a user's own value stand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.launch.devices import DevicePlan
from fdl.launch.network import NodeNetwork
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
            launcher_pid: int | None = None, worker_pythons: dict[int, str] | None = None,
            network: NodeNetwork | None = None) -> dict[str, str]:
    return build_worker_env(defaults() if settings is None else settings, devices=devices,
                            run_dir=RUN_DIR, parent=parent or {}, resume=resume, live=live,
                            launcher_pid=launcher_pid, worker_pythons=worker_pythons or {},
                            network=network)


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


def test_workers_under_another_interpreter_are_named_in_one_variable():
    env = planned(worker_pythons={1: "/envs/b/bin/python", 0: "/envs/a/bin/python"})
    assert json.loads(env["FDL_WORKER_PYTHON"]) == {"0": "/envs/a/bin/python",
                                                    "1": "/envs/b/bin/python"}
    assert "FDL_WORKER_PYTHON" not in planned()  # every worker under the launcher's


def test_the_nodes_network_variables_reach_every_worker():
    exported = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                "FDL_NODE_ADDR": "10.0.0.2"}
    network = NodeNetwork("ipv4", "10.0.0.1", False, "10.0.0.2", "eth0", exported)
    env = planned(network=network)
    assert {name: env[name] for name in exported} == exported
    assert not set(exported) & set(planned())  # no network decided: none of them


def test_the_module_docstring_names_every_variable_fdl_adds():
    """worker_env's docstring is the manual of the worker environment: each variable either
    function adds is in it (the engine settings' FDL_* come from one table, fdl.settings)."""
    import fdl.launch.worker_env as module
    from fdl.launch.worker_env import build_rank_env
    from fdl.settings import engine_env

    gpus = (GpuInfo(0, "GPU 0", (9, 0), uuid="GPU-0"),)
    network = NodeNetwork("ipv4", "10.0.0.1", True, "10.0.0.1", "eth0",
                          {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                           "FDL_NODE_ADDR": "10.0.0.1"})
    settings = defaults(max_restarts=Setting(1, "flag"))
    env = planned(settings, devices=DevicePlan("cuda", 1, gpus, 4, "GPU-0", "1 GPU worker(s)"),
                  resume=True, live=True, launcher_pid=1, worker_pythons={0: "/py"},
                  network=network) | build_rank_env(RUN_DIR / "logs", rank=0)
    named = set(env) - set(engine_env(settings))
    assert named == {"FDL_RUN_DIR", "OMP_NUM_THREADS", "FDL_RESUME", "FDL_PROGRESS",
                     "FDL_LAUNCHER_PID", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "FDL_WORKER_PYTHON",
                     "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "FDL_NODE_ADDR",
                     "TORCHELASTIC_ERROR_FILE"}
    assert [name for name in sorted(named) if f"``{name}" not in module.__doc__] == []
