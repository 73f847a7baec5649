"""The FDL_GPU_SURVEY seam: loading a recorded survey, its validation, and probe_gpus using it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fdl.errors import SurveyError
from fdl.system.gpu_fixture import load_survey_fixture
from fdl.system.gpus import GpuInfo, probe_gpus

TWO_GPUS = {
    "driver_version": "570.86.15",
    "cuda_driver_version": "12.8",
    "gpus": [
        {"name": "NVIDIA GeForce RTX 5060 Ti", "compute_capability": "12.0", "memory_mib": 16311},
        {"name": "NVIDIA GeForce GTX 1060 6GB", "compute_capability": "6.1", "memory_mib": 6144},
    ],
}
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def write_json(tmp_path: Path, data: Any, name: str = "survey.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_fixture_loads_gpus_in_order_with_arch_and_versions(tmp_path: Path) -> None:
    path = write_json(tmp_path, TWO_GPUS)
    survey = load_survey_fixture(path)
    assert survey.source == "fixture"
    assert [(g.index, g.name, g.arch, g.cc, g.memory_mib) for g in survey.gpus] == [
        (0, "NVIDIA GeForce RTX 5060 Ti", "sm_120", "12.0", 16311),
        (1, "NVIDIA GeForce GTX 1060 6GB", "sm_61", "6.1", 6144),
    ]
    assert survey.gpus[0].compute_capability == (12, 0)
    assert (survey.driver_version, survey.cuda_driver_version) == ("570.86.15", "12.8")
    assert any(str(path) in note for note in survey.notes)


def test_fixture_reads_optional_keys_and_ignores_extra_ones(tmp_path: Path) -> None:
    gpu = {
        "name": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "memory_mib": None,
        "index": 3,
        "uuid": "GPU-abc",
        "pci_bus_id": "00000000:41:00.0",
        "comment": "x",
    }
    survey = load_survey_fixture(write_json(tmp_path, {**TWO_GPUS, "gpus": [gpu], "host": "h"}))
    assert survey.gpus == (
        GpuInfo(3, "NVIDIA H100 80GB HBM3", (9, 0), None, "GPU-abc", "00000000:41:00.0"),
    )


def test_fixture_without_driver_or_gpus_explains_the_absence(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"driver_version": None, "cuda_driver_version": None, "gpus": []})
    survey = load_survey_fixture(path)
    assert survey.gpus == ()
    assert survey.driver_version is None
    assert any("no GPU" in note and "no NVIDIA driver" in note for note in survey.notes)


def test_probe_gpus_uses_the_fixture_and_applies_cuda_visible_devices(tmp_path: Path) -> None:
    path = write_json(tmp_path, TWO_GPUS)
    survey = probe_gpus(env={"FDL_GPU_SURVEY": str(path), "CUDA_VISIBLE_DEVICES": "1", **PCI_ORDER})
    assert survey.source == "fixture"
    assert [(g.index, g.name) for g in survey.gpus] == [(0, "NVIDIA GeForce GTX 1060 6GB")]
    assert survey.visible_devices == "1"
    assert any("CUDA_VISIBLE_DEVICES='1'" in note and "1 of 2" in note for note in survey.notes)


def test_mixed_gpus_without_pci_bus_order_get_a_note(tmp_path: Path) -> None:
    survey = probe_gpus(env={"FDL_GPU_SURVEY": str(write_json(tmp_path, TWO_GPUS))})
    assert any("CUDA_DEVICE_ORDER=PCI_BUS_ID" in note for note in survey.notes)


def _gpu(**changes: Any) -> dict[str, Any]:
    return {**TWO_GPUS["gpus"][0], **changes}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "the top level must be a JSON object; got [1, 2]"),
        (
            {"cuda_driver_version": "12.8", "gpus": []},
            "driver_version must be a string or null; it is missing",
        ),
        ({**TWO_GPUS, "driver_version": 570}, "driver_version must be a string or null; got 570"),
        (
            {**TWO_GPUS, "cuda_driver_version": ["12.8"]},
            "cuda_driver_version must be a string or null",
        ),
        ({**TWO_GPUS, "gpus": {"name": "x"}}, "gpus must be a list of GPU objects"),
        (
            {"driver_version": None, "cuda_driver_version": None},
            "gpus must be a list of GPU objects; it is missing",
        ),
        ({**TWO_GPUS, "gpus": ["RTX 4090"]}, 'gpus[0] must be a JSON object; got "RTX 4090"'),
        (
            {**TWO_GPUS, "gpus": [{"compute_capability": "8.9", "memory_mib": 1}]},
            "gpus[0].name must be a non-empty string; it is missing",
        ),
        (
            {**TWO_GPUS, "gpus": [_gpu(), _gpu(compute_capability="sm_61")]},
            'gpus[1].compute_capability must be a "MAJOR.MINOR" string',
        ),
        (
            {**TWO_GPUS, "gpus": [_gpu(compute_capability=8.6)]},
            'gpus[0].compute_capability must be a "MAJOR.MINOR" string such as "8.6"; got 8.6',
        ),
        (
            {**TWO_GPUS, "gpus": [{"name": "x", "compute_capability": "8.9"}]},
            "gpus[0].memory_mib must be a whole number of MiB or null; it is missing",
        ),
        (
            {**TWO_GPUS, "gpus": [_gpu(memory_mib="16GB")]},
            "gpus[0].memory_mib must be a whole number",
        ),
        (
            {**TWO_GPUS, "gpus": [_gpu(memory_mib=True)]},
            "gpus[0].memory_mib must be a whole number",
        ),
        (
            {**TWO_GPUS, "gpus": [_gpu(index=-1)]},
            "gpus[0].index must be a whole number >= 0; got -1",
        ),
        ({**TWO_GPUS, "gpus": [_gpu(uuid=5)]}, "gpus[0].uuid must be a string or null; got 5"),
    ],
)
def test_bad_fixture_raises_survey_error_naming_file_and_key(
    tmp_path: Path, data: Any, expected: str
) -> None:
    path = write_json(tmp_path, data)
    with pytest.raises(SurveyError) as caught:
        probe_gpus(env={"FDL_GPU_SURVEY": str(path)})
    message = caught.value.message
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message
    assert caught.value.hint and "FDL_GPU_SURVEY" in caught.value.hint


def test_missing_fixture_file_raises_survey_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(SurveyError, match=r"nope\.json: cannot read the GPU survey"):
        load_survey_fixture(missing)
