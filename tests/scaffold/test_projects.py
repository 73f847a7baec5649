"""Each template, rendered and run for real: its smoke test, `python train.py` solo, and
`fdl run` on two CPU workers with the async policy (one epoch each, to keep the suite short)."""

from __future__ import annotations

import json
import math
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, clean_env, run_fdl

from fdl.launch.config_file import load_config_file
from fdl.scaffold import create_project
from fdl.scaffold.render import TEMPLATES


@pytest.fixture(scope="module", params=list(TEMPLATES))
def project(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"project-{request.param}")
    proc = run_fdl("init", "demo", "--template", request.param, cwd=root,
                   env={"FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")})
    assert proc.returncode == 0, proc.stderr
    return root / "demo"


def python(*args: str, cwd: Path, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(env),
                          capture_output=True, text=True, timeout=timeout)


def test_the_smoke_test_passes(project):
    proc = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_train.py",
                  cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_train_py_runs_solo(project):
    """It trained: one epoch takes the eval loss well below chance's (a uniform guess over the
    model's outputs, about what an untrained model scores), and what train.py prints is that
    final evaluation."""
    proc = python("train.py", cwd=project, env={"FDL_EPOCHS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epoch = re.search(r"^epoch 1/1  loss (\S+)  [\d,]+ samples/s  eval: (.+)$", proc.stderr,
                      re.M)
    assert epoch, proc.stderr
    metrics = {name: float(value) for name, value in
               (metric.split(" ") for metric in epoch[2].split(", "))}
    settings = runpy.run_path(str(project / "train.py"))  # the model's outputs, not the run
    outputs = settings["NUM_CLASSES"] if "NUM_CLASSES" in settings else len(settings["VOCAB"])
    assert metrics["loss"] < 0.75 * math.log(outputs), (metrics, outputs)
    printed = re.match(r"eval (\w+) ([\d.]+), [\d]+ samples/s\n", proc.stdout)
    assert printed, proc.stdout
    assert float(printed[2]) == pytest.approx(metrics[printed[1]], abs=6e-4)  # .3f of .4f
    assert not (project / "runs").exists()  # solo runs keep no run directory


def test_train_py_points_stray_flags_to_fdl_run(tmp_path):
    create_project(tmp_path / "demo", template="mlp", docker=False)  # the same code in each
    proc = python("train.py", "--policy", "async", cwd=tmp_path / "demo")
    assert proc.returncode == 1
    assert "fdl run train.py --policy async" in proc.stderr


def test_fdl_run_trains_on_two_workers_with_async(project):
    run_dir = project / "runs" / "check"
    # the command, word for word (plus a run directory to find the results)
    proc = run_fdl("run", "train.py", "--nproc-per-node", "2", "--policy", "async", "--epochs",
                   "1", "--run-dir", str(run_dir), cwd=project, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["policy"], summary["world_size"], summary["epochs"]) == ("async", 2, 1)
    assert summary["eval"]["loss"] > 0 and summary["throughput"]["samples_per_s"] > 0
    assert (run_dir / "model.pt").is_file()


def test_the_rendered_python_is_lint_clean(project):
    pytest.importorskip("ruff")
    proc = python("-m", "ruff", "check", "--no-cache", "--isolated", "--line-length", "100",
                  "--select", "E,F,W,I,B,UP,SIM", ".", cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_make_compare_is_an_fdl_compare_that_plans_every_policy(project):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    proc = subprocess.run([make, "-s", "-n", "compare", "FDL=fdl"], cwd=project,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    epochs = load_config_file(project)[0]["epochs"]  # the template's, as in fdl.toml
    assert words == ["fdl", "compare", "train.py", "--policies", "sync,cadence,async",
                     "--epochs", str(epochs), "--seeds", "1", "--quiet-ranks"]
    plan = run_fdl(*words[1:], "--dry-run", "--json", cwd=project)
    assert plan.returncode == 0, plan.stderr
    cells = json.loads(plan.stdout)["cells_planned"]
    assert [cell["policy"] for cell in cells] == ["sync", "cadence", "async"]
    assert all(cell["argv"][4:6] == ["--epochs", str(epochs)] for cell in cells)
    assert not list(project.glob("runs/compare-*"))  # a dry run starts nothing


# --- the loop template: its own loop on fdl.init's API ------------------------------------------
@pytest.fixture(scope="module")
def loop_project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project-own-loop")
    return create_project(root / "demo", template="loop", docker=False).written.target


def test_the_loop_template_trains_to_its_step_budget_in_each_worker_s_precision(loop_project):
    """No --epochs: the script's MAX_STEPS ends the run (global steps of 2 workers x BATCH_SIZE x
    ACCUMULATE samples), before its EPOCHS; run.evaluate ran at every epoch's end, each worker
    trained in the precision fdl run gave it, and the steps accumulated ACCUMULATE batches."""
    settings = runpy.run_path(str(loop_project / "train.py"))
    run_dir = loop_project / "runs" / "budget"
    proc = run_fdl("run", "train.py", "--nproc-per-node", "2", "--policy", "async",
                   "--precision", "bf16,fp32", "--run-dir", str(run_dir), cwd=loop_project,
                   timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    step = 2 * settings["BATCH_SIZE"] * settings["ACCUMULATE"]
    assert summary["samples_planned"] == settings["MAX_STEPS"] * step
    assert summary["accumulate"] == settings["ACCUMULATE"]
    assert summary["precision"] == ["bf16", "fp32"]
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_size = len(settings["load_data"]()[0])
    assert len(epochs) == math.ceil(summary["samples_planned"] / train_size)
    assert len(epochs) < settings["EPOCHS"]
    chance = math.log(len(settings["VOCAB"]))
    assert all(epoch["eval"]["loss"] < chance for epoch in epochs)
    assert epochs[-1]["eval"]["loss"] < epochs[0]["eval"]["loss"]
    assert summary["eval"] == epochs[-1]["eval"]


def test_the_loop_template_s_learning_rate_warms_up_then_decays_to_its_floor(loop_project):
    settings = runpy.run_path(str(loop_project / "train.py"))
    rate, warmup = settings["learning_rate"], settings["WARMUP"]
    assert rate(0.0) == 0.0
    assert rate(warmup) == pytest.approx(settings["LEARNING_RATE"])
    assert rate(1.0) == pytest.approx(settings["MIN_LR"])
    rising = [rate(warmup * i / 10) for i in range(11)]
    falling = [rate(warmup + (1 - warmup) * i / 10) for i in range(11)]
    assert rising == sorted(rising) and falling == sorted(falling, reverse=True)


@pytest.mark.slow
def test_the_loop_template_compiles_once_with_compile_1(loop_project):
    """COMPILE=1 trains a torch.compile'd model, and batches of different sizes (an odd batch
    size and the epoch's short last step) reuse its one graph: no recompile."""
    proc = python("train.py", cwd=loop_project, timeout=600,
                  env={"COMPILE": "1", "TORCH_LOGS": "recompiles,graph_code",
                       "FDL_BATCH_SIZE": "15", "FDL_MAX_STEPS": "60"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "__compiled_fn" in proc.stderr  # it compiled
    assert "Recompiling" not in proc.stderr
    assert re.match(r"eval loss [\d.]+, ", proc.stdout), proc.stdout
