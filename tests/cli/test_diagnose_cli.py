"""`fdl diagnose` end to end: the real entry point, real host survey and torch probe, with the
GPU survey replaced by FDL_GPU_SURVEY fixtures (this machine has no GPU)."""

from __future__ import annotations

import json
import platform
import re
import sys
from pathlib import Path

import psutil
import pytest
from helpers import GPU_FIXTURES, run_fdl

import fdl


def diagnose(*args: str, fixture: str | None = None):
    env = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / f"{fixture}.json")} if fixture else {}
    return run_fdl("diagnose", *args, env=env)


def report_sections(text: str) -> dict[str, list[str]]:
    """The human report's sections: each heading (``Name ───``) -> the lines under it."""
    sections: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        heading = re.fullmatch(r"(\S.*?) ─+", line)
        if heading:
            lines = sections[heading[1]] = []
        else:
            lines.append(line)
    return sections


def fields(lines: list[str]) -> dict[str, str]:
    """The ``  label  value`` lines of a section (labels may hold single spaces)."""
    return {m[1]: m[2] for line in lines if (m := re.fullmatch(r"  (\S+(?: \S+)*)  +(\S.*)", line))}


def test_diagnose_here_reports_this_host_and_its_torch(tmp_path):
    """The real host survey and torch probe, on a host without GPUs (the fixture): each fact in
    its own field, equal to what this interpreter knows of itself and of the torch it runs."""
    import torch

    home = tmp_path / "home"
    proc = run_fdl("diagnose", env={"FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json"),
                                    "FLODL_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    sections = report_sections(proc.stdout)
    assert list(sections) == ["Context", "System", "GPUs (from fixture)", "Python torch",
                              "libtorch", "Compatibility"], proc.stdout
    context = fields(sections["Context"])
    assert context["fdl version"] == fdl.__version__ and context["flodl home"] == str(home)
    system = fields(sections["System"])
    assert system["python"] == f"{platform.python_version()} ({sys.executable})"
    assert system["cpu"].endswith(f" / {psutil.cpu_count(logical=True)} logical cores)")
    assert "  no NVIDIA GPU" in sections["GPUs (from fixture)"]
    wheel = fields(sections["Python torch"])
    assert wheel["version"] == torch.__version__  # the installed wheel, in its field
    assert wheel["built with"] == (f"CUDA {torch.version.cuda}" if torch.version.cuda
                                   else "CPU only")
    assert wheel["gloo"] == ("yes" if torch.distributed.is_gloo_available() else "no")
    assert wheel["CUDA usable"].startswith("yes" if torch.cuda.is_available() else "no")
    assert wheel["location"] == str(Path(torch.__file__).parent)
    assert fields(sections["libtorch"]) == {"active": "none (fdl setup installs one)"}
    assert sections["Compatibility"][-1] == \
        f"  [ok] verdict: no NVIDIA GPU; torch {torch.__version__} will train on the CPU"


def test_diagnose_json_here_is_one_document():
    proc = diagnose("--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == 1
    assert doc["torch"]["installed"] is True
    assert doc["system"]["logical_cores"] >= 1
    assert {t["name"] for t in doc["system"]["tools"]} >= {"nvcc", "cmake", "git", "gcc"}


@pytest.mark.parametrize(("fixture", "level", "needle"), [
    ("none", "ok", "train on the CPU"),
    ("gtx1060_rtx5060ti", "error", "CPU-only build"),
    ("rtx4090", "error", "CPU-only build"),
    ("h100", "error", "CPU-only build"),
    ("old_driver_rtx5060ti", "error", "570.26"),
])
def test_diagnose_json_verdict_per_fixture(fixture, level, needle):
    proc = diagnose("--json", fixture=fixture)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["gpus"]["source"] == "fixture"
    assert doc["verdict"]["level"] == level
    assert needle in doc["verdict"]["message"]


def test_mixed_gpus_human_report_advises_a_source_build():
    proc = diagnose(fixture="gtx1060_rtx5060ti")
    assert proc.returncode == 0
    out = proc.stdout
    assert "NVIDIA GeForce GTX 1060 6GB" in out and "6.1 (sm_61)" in out
    assert "no official torch build covers" in out
    assert 'TORCH_CUDA_ARCH_LIST="6.1;12.0"' in out
    assert "next:" in out


@pytest.mark.parametrize(("fixture", "code"), [("none", 0), ("rtx4090", 1),
                                               ("gtx1060_rtx5060ti", 1)])
def test_strict_fails_when_a_gpu_is_not_covered(fixture, code):
    assert diagnose("--strict", "--json", fixture=fixture).returncode == code


def test_cuda_visible_devices_applies_to_the_fixture():
    env = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "gtx1060_rtx5060ti.json"),
           "CUDA_VISIBLE_DEVICES": "1"}
    doc = json.loads(run_fdl("diagnose", "--json", env=env).stdout)
    assert [d["name"] for d in doc["gpus"]["devices"]] == ["NVIDIA GeForce GTX 1060 6GB"]
    assert doc["gpus"]["devices"][0]["index"] == 0
