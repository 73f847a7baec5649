"""Numbers out of range, from every source (issue 29, "a range for every number"): one `error:`
line naming the setting, the value (shortened when huge) and the allowed range, then a `hint:`,
exit 2, before anything starts and before any run directory exists; never an OverflowError or
a traceback. The launcher and `--dry-run` refuse exactly what a worker would refuse.

The parsers are checked in process against hostile values (a 400-digit number, 1e308,
infinity, NaN, a bool); the commands as real `fdl` processes, whose script would write MARKER
if it ever ran."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from helpers import GPU_FIXTURES, assert_one_error, free_port, run_fdl

from fdl.engine.config import resolve_config
from fdl.errors import ConfigError, UsageError
from fdl.launch.devices import check_devices, plan_devices
from fdl.ranges import (
    BATCH_SIZES,
    DIVERGENCE_THRESHOLDS,
    EPOCHS,
    MICRO_BATCHES,
    MOMENTUMS,
    OUTER_LRS,
    OVERHEAD_TARGETS,
    RESTARTS,
    SAMPLES,
    SEEDS,
    SLOWDOWNS,
    STEPS,
    WORKERS_PER_NODE,
)
from fdl.settings import BY_NAME, SETTINGS, resolve_run_settings
from fdl.system.gpus import GpuInfo, GpuSurvey

WORKER = "open('MARKER', 'w').write('a worker ran')\n"
HUGE = "9" * 400
# Each numeric setting and the range its error states; the others take words or paths.
RANGES: dict[str, str] = {
    "epochs": str(EPOCHS), "batch_size": str(BATCH_SIZES), "seed": str(SEEDS),
    "simulate_slowdown": str(SLOWDOWNS), "checkpoint_every": "(0s, 8760h]",
    "micro_batch_size": str(MICRO_BATCHES), "max_steps": str(STEPS),
    "max_samples": str(SAMPLES), "max_time": "(0s, 8760h]",
    "divergence_threshold": str(DIVERGENCE_THRESHOLDS),
    "overhead_target": str(OVERHEAD_TARGETS), "collective_timeout": "(0s, 24h]",
    "outer_lr": str(OUTER_LRS), "outer_momentum": str(MOMENTUMS),
    "nproc_per_node": str(WORKERS_PER_NODE), "max_restarts": str(RESTARTS),
}
WORDS = {"policy", "backend", "precision", "tensorboard", "average_dtype", "outer_optimizer",
         "run_dir"}
HOSTILE: list[Any] = [10**400, HUGE, "1e308", 1e308, math.inf, "inf", math.nan, "nan", True,
                      -(10**400)]


def test_every_setting_is_a_number_with_a_range_or_takes_words() -> None:
    """A setting added to the contract must say here which it is (and a number, its range)."""
    assert set(RANGES) | WORDS == {spec.name for spec in SETTINGS}
    assert not set(RANGES) & WORDS


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("name", sorted(RANGES))
def test_a_hostile_number_is_one_short_usage_error_naming_setting_and_range(name: str,
                                                                            value: Any) -> None:
    with pytest.raises(UsageError) as caught:
        BY_NAME[name].parse(value)
    message = caught.value.message
    assert name in message and RANGES[name] in message, message
    assert len(message) < 200 and "9" * 50 not in message, message
    assert caught.value.hint and caught.value.exit_code == 2


@pytest.mark.parametrize(("name", "inside", "outside"), [
    ("epochs", ["1", "1000000"], ["0", "1000001"]),
    ("batch_size", ["1", str(2**24)], ["0", str(2**24 + 1)]),
    ("seed", ["0", str(2**63 - 1)], ["-1", str(2**63), str(2**64)]),
    ("simulate_slowdown", ["1,1000", "1"], ["0.5,1", "1,1000.5", "1e300,1", [1, True]]),
    ("checkpoint_every", ["1000000", "8760h", "1s"], ["1000001", "8761h", "1e308h", "0s"]),
    ("micro_batch_size", [str(2**20)], [str(2**20 + 1)]),
    ("max_steps", [str(10**12)], [str(10**12 + 1)]),
    ("max_samples", [str(10**15)], [str(10**15 + 1)]),
    ("max_time", ["8760h", "0.001"], ["8760.01h", "0"]),
    ("collective_timeout", ["24h"], ["86401"]),
    ("divergence_threshold", ["1e6", "1e-9"], ["1000001", "0"]),
    ("overhead_target", ["1000", "0.000001"], ["1001", "0"]),
    ("outer_lr", ["10", "0.01"], ["10.5", "0"]),
    ("outer_momentum", ["0", "0.99"], ["1", "-0.1"]),
    ("nproc_per_node", ["1", "1024"], ["0", "1025", "9999999999"]),
    ("max_restarts", ["0", "1000"], ["-1", "1001"]),
])
def test_each_range_holds_at_its_ends(name: str, inside: list[Any], outside: list[Any]) -> None:
    parse = BY_NAME[name].parse
    for value in inside:
        parse(value)
    for value in outside:
        with pytest.raises(UsageError, match=f"^{name} must be"):
            parse(value)


def test_the_largest_seed_seeds_torch_with_every_epoch_and_rank_offset() -> None:
    """Why seeds stop at 2**63 - 1: torch takes at most 2**64 - 1, and the engine seeds it with
    seed + epoch and seed + 1_000_003 x rank."""
    import torch

    from fdl.engine.data import epoch_permutation
    from fdl.engine.loop import rank_seed

    epoch_permutation(seed=int(SEEDS.high), epoch=int(EPOCHS.high) - 1, size=3)
    torch.manual_seed(rank_seed(int(SEEDS.high), 1024 * 1024))
    with pytest.raises((RuntimeError, ValueError)):
        torch.manual_seed(2**64)


@pytest.mark.parametrize(("name", "value"), [
    ("seed", str(2**64)), ("simulate_slowdown", "1e300,1"), ("checkpoint_every", "1e308h"),
    ("epochs", HUGE), ("divergence_threshold", "x"), ("overhead_target", "1e400"),
    ("max_time", "inf"), ("micro_batch_size", "0"),
])
def test_the_launcher_refuses_an_env_value_exactly_as_a_worker_does(name: str, value: str) -> None:
    env = {BY_NAME[name].env: value}
    with pytest.raises(ConfigError) as launcher:
        resolve_run_settings(flags={}, env=env, file_values={}, file_path=None)
    with pytest.raises(UsageError) as worker:
        resolve_config(script={}, env=env)
    assert launcher.value.message == worker.value.message
    assert launcher.value.message.startswith(f"{BY_NAME[name].env}: {name} must be")
    assert launcher.value.hint == worker.value.hint and launcher.value.hint


def _devices(survey: GpuSurvey):
    """Two workers: one per GPU of ``survey``, or two CPU workers."""
    return plan_devices(survey=survey, devices=None, nproc="auto", logical_cores=4, env={})


A100S = GpuSurvey("fixture", tuple(GpuInfo(i, "NVIDIA A100", (8, 0)) for i in range(2)), None,
                  None)
CPUS = GpuSurvey("none", (), None, None)


@pytest.mark.parametrize(("survey", "backend", "precision", "one_node", "refused"), [
    (A100S, "nccl", ("bf16", "fp16"), True, None),
    (A100S, "auto", ("auto",), True, None),
    (CPUS, "cpu", ("bf16", "fp32"), True, None),
    (CPUS, "nccl", ("auto",), True, "backend 'nccl' needs a CUDA GPU"),
    (CPUS, "auto", ("fp32", "fp16"), True, "precision fp16 is not supported on the CPU"),
    (CPUS, "auto", ("fp16",), False, "precision fp16 is not supported on the CPU"),
    (CPUS, "auto", ("fp32", "fp16"), False, None),  # which ranks are this node's: unknown here
])
def test_the_launcher_applies_the_workers_device_rules(survey, backend, precision, one_node,
                                                       refused):
    devices = _devices(survey)
    if refused is None:
        check_devices(devices, backend=backend, precision=precision, one_node=one_node)
        return
    with pytest.raises(UsageError, match=refused):
        check_devices(devices, backend=backend, precision=precision, one_node=one_node)


# --- fdl run, with and without --dry-run --------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(WORKER)
    return tmp_path


def assert_refused(project: Path, proc, *needles: str) -> None:
    """Exit 2, `error:` then `hint:`, no traceback, no huge number printed whole, nothing
    started, no run directory."""
    assert_one_error(proc, 2, *needles)
    assert "9" * 50 not in proc.stderr, proc.stderr
    assert not (project / "MARKER").exists(), "a worker ran"
    assert not (project / "runs").exists(), "a run directory was created"


RUN_CASES = {
    "seed 2**64": (["--seed", str(2**64)], ["--seed", str(SEEDS)]),
    "seed of 400 digits": (["--seed", HUGE], ["--seed", "(400 characters)"]),
    "slowdown 1e300": (["--simulate-slowdown", "1e300,1"], ["--simulate-slowdown", "[1, 1000]"]),
    "checkpoint 1e308h": (["--checkpoint-every", "1e308h"], ["--checkpoint-every", "8760h]"]),
    "epochs 20 digits": (["--epochs", "99999999999999999999"], ["--epochs", str(EPOCHS)]),
    "nproc 9999999999": (["--nproc-per-node", "9999999999"], ["--nproc-per-node", "[1, 1024]"]),
    "nnodes 20 digits": (["--nnodes", "99999999999999999999", "--rdzv-endpoint", "127.0.0.1:9"],
                         ["--nnodes", "MAX <= 10000"]),
    "batch 1e308": (["--batch-size", "1e308"], ["--batch-size", str(BATCH_SIZES)]),
    "max time inf": (["--max-time", "inf"], ["--max-time", "(0s, 8760h]"]),
    "outer lr 1e400": (["--outer-lr", "1e400"], ["--outer-lr", str(OUTER_LRS)]),
    # what the workers refused after the run directory existed, while --dry-run approved it
    "nccl on CPU workers": (["--backend", "nccl"], ["backend 'nccl' needs a CUDA GPU"]),
    "fp16 on the CPU": (["--precision", "fp16"], ["precision fp16", "CPU"]),
    "fp16 on one CPU rank": (["--precision", "fp32,fp16"], ["precision fp16", "CPU"]),
    "budget below a batch": (["--max-samples", "10", "--batch-size", "64"],
                             ["max_samples 10", "2 x batch_size 64 = 128"]),
}


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_fdl_run_refuses_before_anything_starts(project, case, dry_run):
    args, needles = RUN_CASES[case]
    proc = run_fdl("run", *(["--dry-run"] if dry_run else []), *args, "train.py", cwd=project,
                   timeout=60)
    assert_refused(project, proc, *needles)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_list_per_worker_with_an_open_node_count_is_refused(project, dry_run):
    proc = run_fdl("run", *(["--dry-run"] if dry_run else []), "--nnodes", "1:2",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "1",
                   "--simulate-slowdown", "1,2", "train.py", cwd=project, timeout=60)
    assert_refused(project, proc, "--simulate-slowdown", "--nnodes 1:2", "(1 to 2)")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_bf16_on_a_gpu_older_than_ampere_is_refused(project, dry_run):
    survey = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "gtx1060_rtx5060ti.json")}
    proc = run_fdl("run", *(["--dry-run"] if dry_run else []), "--precision", "bf16",
                   "train.py", cwd=project, env=survey, timeout=60)
    assert_refused(project, proc, "precision bf16", "GTX 1060", "has 6.1")


@pytest.mark.parametrize(("env", "needles"), [
    ({"FDL_SEED": str(2**64)}, ["FDL_SEED", str(SEEDS)]),
    ({"FDL_NPROC_PER_NODE": "9999999999"}, ["FDL_NPROC_PER_NODE", "[1, 1024]"]),
    ({"FDL_OVERHEAD_TARGET": "x"}, ["FDL_OVERHEAD_TARGET", str(OVERHEAD_TARGETS), "e.g. 0.02"]),
    ({"FDL_DIVERGENCE_THRESHOLD": "1e400"}, ["FDL_DIVERGENCE_THRESHOLD", "e.g. 16"]),
    ({"FDL_RESUME": "1"}, ["FDL_RESUME", "--resume"]),
])
def test_a_bad_environment_is_refused(project, env, needles):
    proc = run_fdl("run", "train.py", cwd=project, env=env, timeout=60)
    assert_refused(project, proc, *needles)


@pytest.mark.parametrize(("text", "needles"), [
    ("simulate_slowdown = [1, true]\n", ["simulate_slowdown", "[1, True]", "[1, 1000]"]),
    ("nproc_per_node = 9999999999\n", ["nproc_per_node", "[1, 1024]"]),
    (f"seed = {2**64}\n", ["seed", str(SEEDS)]),
    ('checkpoint_every = "1e308h"\n', ["checkpoint_every", "8760h]"]),
    ("epochs = 1e308\n", ["epochs", str(EPOCHS)]),
    (f"batch_size = {HUGE}\n", ["batch_size", "(400 digits)"]),
])
def test_a_bad_fdl_toml_number_is_refused(project, text, needles):
    (project / "fdl.toml").write_text(text)
    proc = run_fdl("run", "--dry-run", "train.py", cwd=project, timeout=60)
    assert_refused(project, proc, "fdl.toml", *needles)


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_fdl_debug_off_shows_no_traceback(project, value):
    proc = run_fdl("run", "--epochs", "0", "train.py", cwd=project, env={"FDL_DEBUG": value})
    assert_refused(project, proc, "--epochs")


def test_fdl_debug_on_still_shows_the_traceback(project):
    proc = run_fdl("run", "--epochs", "0", "train.py", cwd=project, env={"FDL_DEBUG": "1"})
    assert proc.returncode == 2 and "Traceback" in proc.stderr, proc.stderr


# --- fdl bench and fdl compare: counts ----------------------------------------------------------


@pytest.mark.parametrize(("args", "needles"), [
    (["bench", "--seeds", "10000000", "--dry-run"], ["--seeds", "1<=x<=1000"]),
    (["bench", "--seeds", "99999999999999999999", "--dry-run"], ["--seeds", "1<=x<=1000"]),
    (["bench", "--epochs", "99999999999999999999", "--dry-run"], ["--epochs", "1<=x<=1000000"]),
    (["bench", "--simulate-slowdown", "1e300,1", "--dry-run"], ["[1, 1000]"]),
    (["compare", "train.py", "--seeds", "200000", "--dry-run"], ["--seeds", "1<=x<=1000"]),
    (["compare", "--seeds", "99999999999999999999", "train.py", "--dry-run"], ["--seeds"]),
    (["compare", "train.py", "--epochs", "99999999999999999999", "--dry-run"], ["--epochs"]),
    (["compare", "train.py", "--seed", str(2**63 - 1), "--seeds", "2", "--dry-run"],
     ["--seeds 2", "reaches seed 9223372036854775808", str(SEEDS)]),
])
def test_bench_and_compare_counts_are_bounded(project, args, needles):
    proc = run_fdl(*args, cwd=project, timeout=60)
    assert_refused(project, proc, *needles)


def test_bench_report_on_a_directory_that_is_no_sweep_is_a_usage_error(project):
    proc = run_fdl("bench", "report", str(project), cwd=project)
    assert_refused(project, proc, "no benchmark results")
