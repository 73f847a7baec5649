"""`fdl diagnose` end to end: the real entry point, real host survey and torch probe, with the
GPU survey replaced by FDL_GPU_SURVEY fixtures (this machine has no GPU)."""

from __future__ import annotations

import json

import pytest
from helpers import GPU_FIXTURES, run_fdl


def diagnose(*args: str, fixture: str | None = None):
    env = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / f"{fixture}.json")} if fixture else {}
    return run_fdl("diagnose", *args, env=env)


def test_diagnose_here_runs_and_reports_every_section():
    proc = diagnose()
    assert proc.returncode == 0, proc.stderr
    for section in ("Context", "System", "GPUs", "Python torch", "Compatibility", "verdict:"):
        assert section in proc.stdout
    assert "2.13.0" in proc.stdout  # the torch wheel of this venv


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
