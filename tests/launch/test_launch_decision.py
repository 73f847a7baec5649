"""fdl.launch.spec.build_launch_spec: every decision that needs a probe, made once from the
probes' results as plain data (the interpreters named, the torch builds, this node's
network), in-process and without a worker. The probes themselves are tested against real
interpreters and sockets in test_worker_python.py and test_run_inputs.py."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from fdl.errors import UsageError
from fdl.launch.devices import DevicePlan
from fdl.launch.interpreters import Interpreter, WorkerPythons
from fdl.launch.kernels import KernelProblem, Refusal, kernel_problems
from fdl.launch.network import EndpointNotResolved, NodeNetwork
from fdl.launch.request import RunRequest
from fdl.launch.spec import LaunchProbes, LaunchSpec, build_launch_spec, place_workers
from fdl.launch.worker_env import build_rank_env
from fdl.settings import resolve_run_settings
from fdl.system.gpu_info import GpuInfo, GpuSurvey
from fdl.system.torchenv import TorchInfo

NO_GPU = GpuSurvey("none", (), None, None)
# an RTX 5060 Ti (sm_120) and a GTX 1060 (sm_61) on a driver for CUDA 12.8
TWO_CARDS = GpuSurvey("fixture", (GpuInfo(0, "NVIDIA GeForce RTX 5060 Ti", (12, 0), uuid="GPU-a"),
                                  GpuInfo(1, "NVIDIA GeForce GTX 1060 6GB", (6, 1), uuid="GPU-b")),
                      "570.86.15", "12.8")
OTHER = "/envs/cu126/bin/python"
PASCAL = ["sm_50", "sm_60", "sm_61", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
BLACKWELL = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def named(*ranks: int, path: str = OTHER, origin: str = "--worker-python") -> WorkerPythons:
    """The interpreters' probe having found ``path`` for ``ranks``."""
    return WorkerPythons(origin, tuple(Interpreter(rank, path, "3.11", "0.1.0", "2.13.0+cu126")
                                       for rank in ranks))


def build(*, nccl: str | None = "2.21.5", archs: list[str] | None = None,
          cuda: str | None = "12.6", version: str = "2.13.0+cu126") -> TorchInfo:
    """A torch build as the builds' probe reports it."""
    return TorchInfo(installed=True, python="p", version=version, cuda_version=cuda,
                     arch_list=tuple(PASCAL + BLACKWELL if archs is None else archs),
                     nccl_version=nccl)


def decide(*, flags: dict[str, str] | None = None, survey: GpuSurvey = NO_GPU,
           pythons: WorkerPythons | None = None, builds: dict[str, TorchInfo] | None = None,
           network: NodeNetwork | EndpointNotResolved | None = None,
           preview: bool = False) -> LaunchSpec:
    """The spec of ``fdl run [flags] train.py`` after probes that found these results (two
    workers unless ``flags`` says otherwise: one per GPU)."""
    flags = flags if flags is not None else {"nproc_per_node": "2"}
    request = RunRequest("train.py", (), flags)
    settings = resolve_run_settings(flags=flags, env={}, file_values={}, file_path=None)
    placement = place_workers(request, settings=settings, survey=survey, env={},
                              cwd=Path("/project"), now=datetime(2030, 1, 1, tzinfo=timezone.utc),
                              run_id="x", logical_cores=4, taken=lambda path: False)
    probes = LaunchProbes(survey, pythons or WorkerPythons(), builds, network)
    return build_launch_spec(request, settings=settings, placement=placement, probes=probes,
                             env={}, preview=preview)


def backend(spec: LaunchSpec) -> tuple[str, str]:
    setting = spec.settings["backend"]
    return setting.value, setting.source


def test_workers_under_the_launchers_interpreter_keep_the_default_backend():
    spec = decide()
    assert backend(spec) == ("auto", "default")
    assert "FDL_WORKER_PYTHON" not in spec.env and "FDL_BACKEND" not in spec.env
    assert spec.interpreters == () and spec.kernel_check is None  # CPU workers: not checked


def test_a_worker_under_another_interpreter_averages_on_cpu_and_the_env_says_so():
    spec = decide(pythons=named(1))
    assert backend(spec) == ("cpu", "--worker-python: several environments")
    assert spec.env["FDL_BACKEND"] == "cpu"
    assert json.loads(spec.env["FDL_SOURCES"])["backend"] == "--worker-python: several environments"
    assert json.loads(spec.env["FDL_WORKER_PYTHON"]) == {"1": OTHER}
    assert [spec.python_of(rank) for rank in (0, 1)] == [sys.executable, OTHER]


def test_every_worker_under_one_other_interpreter_is_one_environment():
    spec = decide(pythons=named(0, 1))
    assert backend(spec) == ("auto", "default")
    assert json.loads(spec.env["FDL_WORKER_PYTHON"]) == {"0": OTHER, "1": OTHER}


@pytest.mark.parametrize("chosen", ["auto", "nccl", "cpu"])
def test_a_backend_the_user_chose_stands_whatever_the_interpreters(chosen):
    survey = TWO_CARDS if chosen == "nccl" else NO_GPU
    builds = {sys.executable: build(nccl="2.26.2"), OTHER: build()} if chosen == "nccl" else None
    spec = decide(flags={"backend": chosen, "nproc_per_node": "2"}, survey=survey,
                  pythons=named(1), builds=builds)
    assert backend(spec) == (chosen, "flag")


@pytest.mark.parametrize(("nccls", "expected"), [
    (("2.21.5", "2.21.5"), ("auto", "default")),  # one NCCL in both wheels: the usual choice
    (("2.21.5", "2.26.2"), ("cpu", "device map: several environments")),
    ((None, None), ("cpu", "device map: several environments"))])  # no NCCL known: host memory
def test_gpu_workers_under_two_environments_average_on_nccl_only_when_they_share_one(nccls,
                                                                                   expected):
    builds = {sys.executable: build(nccl=nccls[0]), OTHER: build(nccl=nccls[1])}
    spec = decide(flags={}, survey=TWO_CARDS,
                  pythons=named(1, origin="device map"), builds=builds)
    assert backend(spec) == expected
    assert ("FDL_BACKEND" in spec.env) == (expected[0] == "cpu")
    assert json.loads(spec.env["FDL_SOURCES"])["backend"] == expected[1]
    assert spec.kernel_check == ()  # each card's torch has its kernels


def test_a_worker_whose_torch_cannot_run_on_its_gpu_is_refused_and_previewed():
    builds = {sys.executable: build(archs=BLACKWELL, cuda="12.8", version="2.13.0+cu128")}
    with pytest.raises(UsageError) as refused:
        decide(flags={}, survey=TWO_CARDS, builds=builds)
    assert refused.value.message.startswith(
        "local rank 1 (GPU 1 NVIDIA GeForce GTX 1060 6GB, sm_61): torch 2.13.0+cu128 under ")
    assert "(and" not in refused.value.message  # one problem
    assert "fdl diagnose" in refused.value.hint
    spec = decide(flags={}, survey=TWO_CARDS, builds=builds, preview=True)
    assert [(p.local_rank, p.refusal) for p in spec.kernel_check] == [(1, Refusal.NO_KERNEL)]
    assert spec.to_dict()["kernel_check"] == [refused.value.message]


def test_several_refused_workers_are_one_line_naming_the_first():
    builds = {sys.executable: build(cuda=None, archs=[], version="2.13.0+cpu")}
    with pytest.raises(UsageError) as refused:
        decide(flags={}, survey=TWO_CARDS, builds=builds)
    assert refused.value.message.endswith("is a CPU-only build (and 1 more)")


def test_the_network_found_is_the_specs_and_its_variables_reach_the_workers():
    network = NodeNetwork("ipv4", "127.0.0.1", None, "127.0.0.1", "lo",
                          {"GLOO_SOCKET_IFNAME": "lo"}, several_nodes=False)
    spec = decide(network=network)
    assert spec.network == network and spec.network_problem is None
    assert spec.env["GLOO_SOCKET_IFNAME"] == "lo"


def test_an_endpoint_that_does_not_resolve_is_refused_or_shown_by_a_dry_run():
    unresolved = EndpointNotResolved("cannot resolve the rendezvous host 'n1'", hint="check it")
    with pytest.raises(EndpointNotResolved):
        decide(network=unresolved)
    spec = decide(network=unresolved, preview=True)
    assert spec.network is None and spec.network_problem == unresolved.message
    assert spec.to_dict()["network"] == {"problem": unresolved.message}
    assert not any(name.endswith("SOCKET_IFNAME") for name in spec.env)


def test_a_kernel_problem_is_refused_before_an_unresolved_endpoint():
    builds = {sys.executable: build(archs=BLACKWELL, cuda="12.8", version="2.13.0+cu128")}
    with pytest.raises(UsageError) as refused:
        decide(flags={}, survey=TWO_CARDS, builds=builds,
               network=EndpointNotResolved("cannot resolve the rendezvous host 'n1'"))
    assert refused.value.message.startswith("local rank 1 (GPU 1")


GTX_1060 = TWO_CARDS.gpus[1]
A100 = GpuInfo(0, "NVIDIA A100", (8, 0))


@pytest.mark.parametrize(("gpu", "driver", "info", "refusal", "says"), [
    (GTX_1060, ("570.86.15", "12.8"), TorchInfo(installed=False, python="p"),
     Refusal.NO_TORCH, "no usable torch under /py"),
    (GTX_1060, ("570.86.15", "12.8"), TorchInfo(installed=False, python="p", error="hung"),
     Refusal.NO_TORCH, "no usable torch under /py (hung)"),
    (GTX_1060, ("570.86.15", "12.8"), build(cuda=None, archs=[], version="2.13.0+cpu"),
     Refusal.CPU_ONLY, "torch 2.13.0+cpu under /py is a CPU-only build"),
    (GTX_1060, ("570.86.15", "12.8"), build(archs=BLACKWELL, cuda="12.8"),
     Refusal.NO_KERNEL, "cannot run on it (no kernel image for sm_61: the build has sm_75"),
    (TWO_CARDS.gpus[0], ("550.54", "12.4"), build(cuda="12.8"),
     Refusal.GPU_UNKNOWN_TO_DRIVER, "cannot run on it (Blackwell (sm_120) needs a driver"),
    (A100, ("470.57.02", "11.4"), build(cuda="12.8"),
     Refusal.DRIVER_TOO_OLD, "cannot run on it (driver 470.57.02 is too old for CUDA 12.8"),
])
def test_each_reason_a_build_is_refused_is_typed_and_named(gpu, driver, info, refusal, says):
    devices = DevicePlan("cuda", 1, (gpu,), 1, "0", "1 GPU worker(s)")
    survey = GpuSurvey("fixture", (gpu,), *driver)
    (problem,) = kernel_problems(devices, survey, {0: "/py"}, {"/py": info})
    assert isinstance(problem, KernelProblem) and problem.refusal is refusal
    assert problem.message.startswith(f"local rank 0 (GPU {gpu.index} {gpu.name}, {gpu.arch}): ")
    assert says in problem.message


def test_a_workers_error_file_variable_names_its_global_ranks_file():
    assert build_rank_env(Path("/runs/x/logs"), rank="3") == {
        "TORCHELASTIC_ERROR_FILE": "/runs/x/logs/.rank3.error.json"}


def test_the_logs_layout_gives_each_worker_its_ranks_variables(tmp_path):
    """What torch's agent starts each worker with: fdl's logs layout adds build_rank_env's
    variables to the global rank's environment and points the agent at the same file."""
    from fdl.launch.elastic import run_logs_specs

    envs = {0: {"RANK": "2"}, 1: {"RANK": "3"}}
    dest = run_logs_specs(tmp_path / "logs", quiet=False).reify(envs)
    for local_rank, env in envs.items():
        assert env == {"RANK": env["RANK"]} | build_rank_env(tmp_path / "logs", rank=env["RANK"])
        assert dest.error_files[local_rank] == env["TORCHELASTIC_ERROR_FILE"]


@pytest.mark.parametrize(("survey", "imported"), [(None, False), ("gtx1060_rtx5060ti", True)])
def test_only_gpu_workers_pay_for_the_kernel_check(tmp_path, survey, imported):
    """A CPU run neither probes the torch builds nor imports the check (fdl.launch.kernels)."""
    import subprocess

    from helpers import clean_env

    (tmp_path / "train.py").write_text("")
    extra = {} if survey is None else {
        "FDL_GPU_SURVEY": str(Path(__file__).parents[1] / "fixtures" / "gpus" / f"{survey}.json")}
    code = ("import sys; from fdl.launch import plan_run; from fdl.launch.request import "
            "RunRequest; plan_run(RunRequest('train.py'), preview=True); "
            "print('fdl.launch.kernels' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=clean_env(extra), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(imported)
