"""One environment per device class (fdl.libtorch.environments) for the pairs people own, against
the catalog of official builds and their architecture lists, and what fdl setup and fdl
diagnose make of it on the surveyed GTX 1060 + RTX 5060 Ti host."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fdl.libtorch.catalog import official_builds
from fdl.libtorch.coverage import check_build
from fdl.libtorch.environments import plan_environments
from fdl.system.gpus import GpuInfo, GpuSurvey

HOME = Path("/home/me/.flodl")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "gpus" / "gtx1060_rtx5060ti.json"
CARDS = {"1060": ("NVIDIA GeForce GTX 1060 6GB", (6, 1)),
         "5060ti": ("NVIDIA GeForce RTX 5060 Ti", (12, 0)),
         "980": ("NVIDIA GeForce GTX 980", (5, 2)), "4070": ("NVIDIA GeForce RTX 4070", (8, 9)),
         "v100": ("Tesla V100-PCIE-16GB", (7, 0)), "2080": ("NVIDIA GeForce RTX 2080", (7, 5))}
#: (driver, the CUDA it supports): 570 stops at CUDA 12.8, 580 runs CUDA 13
DRIVER_570, DRIVER_580 = ("570.86.15", "12.8"), ("580.65.06", "13.0")


def survey(*cards: str, driver: tuple[str, str] = DRIVER_580) -> GpuSurvey:
    gpus = tuple(GpuInfo(i, CARDS[c][0], CARDS[c][1], 8192, uuid=f"GPU-{c}-{i}")
                 for i, c in enumerate(cards))
    return GpuSurvey("fixture", gpus, driver[0], driver[1])


def plan(found: GpuSurvey):
    return plan_environments(found, home=HOME, fdl_requirement="fdl==0.1.0")


@pytest.mark.parametrize(("driver", "release", "variants"), [
    (DRIVER_570, "2.11.0", {"5060ti": "cu128", "1060": "cu126"}),  # CUDA 13 needs driver 580
    (DRIVER_580, "2.14.0", {"5060ti": "cu130", "1060": "cu126"})])
def test_pascal_beside_blackwell_gets_one_release_in_two_environments(driver, release,
                                                                      variants):
    found = survey("5060ti", "1060", driver=driver)
    result = plan(found)
    assert result is not None and result.release == release
    assert {g.uuid.split("-")[1]: env.build.variant for env in result.environments
            for g in env.gpus} == variants
    assert len({env.build.version for env in result.environments}) == 1  # the same release
    for env in result.environments:  # each build runs its GPUs, by the coverage rules
        alone = GpuSurvey("fixture", env.gpus, found.driver_version, found.cuda_driver_version)
        assert check_build(alone, label=env.name, archs=env.build.archs,
                           cuda=env.build.cuda).covers_all
    # no release newer than the one chosen runs both GPUs in some build
    for newer in {b.version for b in official_builds()} - {release}:
        if tuple(map(int, newer.split("."))) > tuple(map(int, release.split("."))):
            assert not all(any(check_build(
                GpuSurvey("f", (gpu,), *driver), label=b.label, archs=b.archs,
                cuda=b.cuda).covers_all for b in official_builds(version=newer)
                if not b.experimental) for gpu in found.gpus)


def test_the_plan_names_paths_commands_the_device_map_and_the_run_flag():
    result = plan(survey("5060ti", "1060", driver=DRIVER_570))
    doc = result.to_dict()
    fast, _ = doc["environments"]
    assert fast["name"] == "2.11.0-cu128" and fast["torch"] == "2.11.0+cu128"
    assert fast["path"] == str(HOME / "envs" / "2.11.0-cu128")
    assert fast["commands"] == [
        f"python3 -m venv {HOME}/envs/2.11.0-cu128",
        f"{HOME}/envs/2.11.0-cu128/bin/python -m pip install torch==2.11.0 --index-url "
        "https://download.pytorch.org/whl/cu128",
        f"{HOME}/envs/2.11.0-cu128/bin/python -m pip install fdl==0.1.0"]
    assert doc["device_map"] == {"GPU-5060ti-0": "2.11.0-cu128", "GPU-1060-1": "2.11.0-cu126"}
    assert doc["worker_python"] == (f"0={HOME}/envs/2.11.0-cu128/bin/python,"
                                    f"1={HOME}/envs/2.11.0-cu126/bin/python")
    assert result.summary() == ("two environments, same torch 2.11.0: cu128 for GPU 0, cu126 "
                                "for GPU 1")
    assert doc["train_today"] == ("train today on GPU 0 (NVIDIA GeForce RTX 5060 Ti) alone, on "
                                  "2.11.0+cu128: fdl run --devices 0 train.py")
    for command in fast["commands"]:  # they paste into a shell as they are
        assert shlex.split(command)


@pytest.mark.parametrize("cards", [("980", "4070"), ("2080", "5060ti"), ("v100", "5060ti"),
                                   ("5060ti",), ("1060",)])
def test_where_one_build_runs_every_gpu_there_is_one_environment(cards):
    """Maxwell + Ada (cu126 runs both), Turing + Blackwell (cu130), Volta + Blackwell (2.10's
    cu128), a single GPU: no environments per device class."""
    found = survey(*cards)
    assert plan(found) is None
    assert any(check_build(found, label=b.label, archs=b.archs, cuda=b.cuda).covers_all
               for b in official_builds())


def test_setup_and_diagnose_propose_it_on_the_surveyed_host(tmp_path):
    env = {"FDL_GPU_SURVEY": str(FIXTURE), "FLODL_HOME": str(tmp_path / "flodl"),
           "PATH": "/usr/bin:/bin"}
    setup = subprocess.run([sys.executable, "-m", "fdl", "setup", "--dry-run", "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert setup.returncode == 0, setup.stderr
    doc = json.loads(setup.stdout)
    envs = doc["environments"]
    assert [e["torch"] for e in envs["environments"]] == ["2.11.0+cu128", "2.11.0+cu126"]
    assert doc["notes"][0].startswith("proposed: two environments, same torch 2.11.0")
    assert not any("downloading the libtorch archive" in note for note in doc["notes"])
    assert not (tmp_path / "flodl").exists()  # a dry run makes nothing
    diagnose = subprocess.run([sys.executable, "-m", "fdl", "diagnose", "--json"],
                              capture_output=True, text=True, env=env, timeout=120)
    verdict = json.loads(diagnose.stdout)["verdict"]
    assert verdict["message"].endswith("fdl's option: two environments, same torch 2.11.0: "
                                       "cu128 for GPU 0, cu126 for GPU 1")
    assert verdict["command"] == "fdl setup --dry-run"
