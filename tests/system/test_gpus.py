"""GPU survey: CUDA_VISIBLE_DEVICES, NVML, nvidia-smi and "none" (the FDL_GPU_SURVEY seam is
in test_gpu_fixture.py)."""

from __future__ import annotations

import stat
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from fdl.errors import SurveyError
from fdl.system.gpus import (
    GpuInfo,
    apply_visible_devices,
    parse_cuda_version_int,
    parse_nvidia_smi_csv,
    parse_smi_cuda_version,
    probe_gpus,
)

PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
QUERY = "--query-gpu=index,name,uuid,pci.bus_id,compute_cap,memory.total,driver_version"
SMI_CSV = """\
0, NVIDIA GeForce RTX 5060 Ti, GPU-0b7f5d3e-6f0a-4a5e-9f3c-3a2b1c0d9e8f, 00000000:01:00.0, 12.0, 16311, 570.86.15
1, NVIDIA GeForce GTX 1060 6GB, GPU-8c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f, 00000000:02:00.0, 6.1, 6144, 570.86.15
"""
SMI_BANNER = """\
Fri Nov 21 11:14:02 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
"""
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------

THREE = (
    GpuInfo(0, "NVIDIA GeForce RTX 4090", (8, 9), uuid="GPU-aaaa1111-0000-4000-8000-000000000000"),
    GpuInfo(1, "NVIDIA GeForce RTX 3090", (8, 6), uuid="GPU-aaaa2222-0000-4000-8000-000000000000"),
    GpuInfo(
        2, "NVIDIA GeForce GTX 1060 6GB", (6, 1), uuid="GPU-bbbb3333-0000-4000-8000-000000000000"
    ),
)


@pytest.mark.parametrize(
    ("value", "physical"),
    [
        ("0,1,2", [0, 1, 2]),
        ("1", [1]),
        ("2,0", [2, 0]),
        (" 2, 1 ", [2, 1]),
        ("1gpu", [1]),  # CUDA reads entries like strtoul
        ("1,7,0", [1]),  # 7 names no GPU: CUDA stops there
        ("0,x,1", [0]),
        ("0,-1,1", [0]),
        ("", []),
        ("-1", []),
        ("0,0", []),  # a repeated GPU leaves none visible
        ("GPU-bbbb3333-0000-4000-8000-000000000000", [2]),
        ("GPU-bbbb,GPU-aaaa2", [2, 1]),  # unique prefixes
        ("GPU-aaaa", []),  # ambiguous prefix: not a GPU
        ("GPU-aaaa1,GPU-ffff,GPU-bbbb", [0]),
        ("0,GPU-bbbb", [0]),  # indices and UUIDs do not mix
    ],
)
def test_cuda_visible_devices_follows_cuda_rules(value: str, physical: list[int]) -> None:
    visible, _ = apply_visible_devices(THREE, value)
    assert [gpu.name for gpu in visible] == [THREE[i].name for i in physical]
    assert [gpu.index for gpu in visible] == list(range(len(physical)))


def test_unset_or_identity_cuda_visible_devices_changes_nothing() -> None:
    assert apply_visible_devices(THREE, None) == (THREE, None)
    assert apply_visible_devices(THREE, "0,1,2") == (THREE, None)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("1", ["shows 1 of 3", "0 = GPU 1 (NVIDIA GeForce RTX 3090)"]),
        ("2,0", ["shows 2 of 3", "0 = GPU 2", "1 = GPU 0"]),
        ("", ["hides every GPU"]),
        ("-1", ["hides every GPU"]),
        ("1,7", ["shows 1 of 3", "entry '7' is not a GPU index"]),
        ("0,0", ["hides every GPU", "repeats a GPU"]),
        ("GPU-aaaa", ["hides every GPU", "unique UUID prefix"]),
    ],
)
def test_cuda_visible_devices_note_explains_what_is_hidden(value: str, words: list[str]) -> None:
    _, note = apply_visible_devices(THREE, value)
    assert note is not None
    for word in words:
        assert word in note


def test_mig_selection_keeps_all_gpus_and_says_so() -> None:
    visible, note = apply_visible_devices(THREE, "MIG-4f7e1a2b-0000-5000-8000-000000000000")
    assert visible == THREE
    assert note and "MIG" in note


# --- nvidia-smi parsing --------------------------------------------------------------------


def test_parse_nvidia_smi_csv_reads_every_field() -> None:
    gpus = parse_nvidia_smi_csv(SMI_CSV)
    assert gpus == [
        GpuInfo(
            0,
            "NVIDIA GeForce RTX 5060 Ti",
            (12, 0),
            16311,
            "GPU-0b7f5d3e-6f0a-4a5e-9f3c-3a2b1c0d9e8f",
            "00000000:01:00.0",
        ),
        GpuInfo(
            1,
            "NVIDIA GeForce GTX 1060 6GB",
            (6, 1),
            6144,
            "GPU-8c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f",
            "00000000:02:00.0",
        ),
    ]


def test_parse_nvidia_smi_csv_turns_unavailable_fields_into_none() -> None:
    text = (
        "0, NVIDIA GB10, [N/A], 0000000F:01:00.0, 12.1, [N/A], 580.95.05\n\n"
        "1, NVIDIA A100-SXM4-40GB, GPU-1d2c, [Not Supported], 8.0, 40960, 580.95.05\n"
    )
    gpus = parse_nvidia_smi_csv(text)
    assert [(g.index, g.arch, g.memory_mib, g.uuid, g.pci_bus_id) for g in gpus] == [
        (0, "sm_121", None, None, "0000000F:01:00.0"),
        (1, "sm_80", 40960, "GPU-1d2c", None),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0, NVIDIA GeForce GTX 1060 6GB, 6.1, 6144\n", "printed 4 fields where 7 were asked for"),
        (
            "0, Tesla K80, GPU-1, 00000000:04:00.0, [N/A], 11441, 470.256.02\n",
            "no compute capability (Tesla K80) for GPU 0",
        ),
        ("0, [N/A], GPU-1, 00000000:04:00.0, 8.6, 11441, 470.256.02\n", "no name for GPU 0"),
    ],
)
def test_parse_nvidia_smi_csv_rejects_unusable_rows(text: str, expected: str) -> None:
    with pytest.raises(SurveyError) as caught:
        parse_nvidia_smi_csv(text)
    assert expected in caught.value.message


def test_parse_smi_cuda_version_reads_the_banner() -> None:
    assert parse_smi_cuda_version(SMI_BANNER) == "12.8"
    assert (
        parse_smi_cuda_version(
            "| NVIDIA-SMI 580.95.05  Driver Version: 580.95.05  CUDA Version: 13.0 |"
        )
        == "13.0"
    )
    assert parse_smi_cuda_version("No devices were found") is None


@pytest.mark.parametrize(
    ("value", "text"),
    [(12080, "12.8"), (13000, "13.0"), (12020, "12.2"), (11040, "11.4"), (10010, "10.1")],
)
def test_parse_cuda_version_int(value: int, text: str) -> None:
    assert parse_cuda_version_int(value) == text


def test_parse_cuda_version_int_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="12080"):
        parse_cuda_version_int(0)


# --- NVML ------------------------------------------------------------------------------------
# NVML is the hardware boundary: these tests put a fake `pynvml` module into sys.modules that
# answers like nvidia-ml-py does (bytes from older releases, NVMLError subclasses), so the
# NVML path is exercised on machines without an NVIDIA driver.


class FakeNvml(types.ModuleType):
    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(
        self,
        devices: list[dict[str, Any]],
        *,
        init_error: str | None = None,
        driver: Any = b"570.86.15",
        cuda: int = 12080,
    ) -> None:
        super().__init__("pynvml")
        self.devices, self.init_error, self.driver, self.cuda = devices, init_error, driver, cuda
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error:
            raise getattr(self, self.init_error)("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> Any:
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> Any:
        return handle["uuid"]

    def nvmlDeviceGetPciInfo(self, handle: dict[str, Any]) -> Any:
        return types.SimpleNamespace(busId=handle["bus"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: dict[str, Any]) -> tuple[int, int]:
        if handle["cc"] is None:
            raise self.NVMLError("Unknown Error")
        return handle["cc"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> Any:
        if handle["memory"] is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return types.SimpleNamespace(total=handle["memory"], free=0, used=0)

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda


RTX_5060 = {
    "name": b"NVIDIA GeForce RTX 5060 Ti",
    "uuid": b"GPU-0b7f5d3e",
    "bus": b"00000000:01:00.0",
    "cc": (12, 0),
    "memory": 16311 * 2**20,
}
GTX_1060 = {
    "name": "NVIDIA GeForce GTX 1060 6GB",
    "uuid": "GPU-8c1d2e3f",
    "bus": "00000000:02:00.0",
    "cc": (6, 1),
    "memory": None,
}


def install_nvml(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvml_survey_reads_every_gpu_and_shuts_nvml_down(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_nvml(monkeypatch, FakeNvml([RTX_5060, GTX_1060]))
    survey = probe_gpus(env=PCI_ORDER)
    assert survey.source == "nvml"
    assert survey.gpus == (
        GpuInfo(
            0, "NVIDIA GeForce RTX 5060 Ti", (12, 0), 16311, "GPU-0b7f5d3e", "00000000:01:00.0"
        ),
        GpuInfo(1, "NVIDIA GeForce GTX 1060 6GB", (6, 1), None, "GPU-8c1d2e3f", "00000000:02:00.0"),
    )
    assert (survey.driver_version, survey.cuda_driver_version) == ("570.86.15", "12.8")
    assert survey.notes == ()
    assert fake.calls == ["init", "shutdown"]


def test_nvml_with_no_device_explains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    install_nvml(monkeypatch, FakeNvml([]))
    survey = probe_gpus(env={})
    assert (survey.source, survey.gpus) == ("nvml", ())
    assert survey.notes == ("NVIDIA driver 570.86.15 is loaded but no NVIDIA GPU was found",)


def test_nvml_read_failure_falls_back_and_still_shuts_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = install_nvml(monkeypatch, FakeNvml([{**RTX_5060, "cc": None}]))
    survey = probe_gpus(env={}, nvidia_smi=str(tmp_path / "nvidia-smi"))
    assert survey.source == "none"
    assert "NVML: reading the GPUs failed (Unknown Error)" in survey.notes
    assert fake.calls == ["init", "shutdown"]


# --- nvidia-smi, with a fake executable ------------------------------------------------------


def fake_smi(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


WORKING_SMI = f"""\
if [ "$1" = "{QUERY}" ] && [ "$2" = "--format=csv,noheader,nounits" ]; then
cat <<'EOF'
{SMI_CSV}EOF
elif [ "$#" = 0 ]; then
cat <<'EOF'
{SMI_BANNER}EOF
else
echo "unexpected arguments: $*" >&2; exit 2
fi
"""


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    return install_nvml(monkeypatch, FakeNvml([], init_error="NVMLError_LibraryNotFound"))


@pytest.mark.usefixtures("no_nvml")
def test_nvidia_smi_is_used_when_nvml_is_unavailable(tmp_path: Path) -> None:
    survey = probe_gpus(
        env={**PCI_ORDER, "CUDA_VISIBLE_DEVICES": "1,0"}, nvidia_smi=fake_smi(tmp_path, WORKING_SMI)
    )
    assert survey.source == "nvidia-smi"
    assert [(g.index, g.name, g.uuid) for g in survey.gpus] == [
        (0, "NVIDIA GeForce GTX 1060 6GB", "GPU-8c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f"),
        (1, "NVIDIA GeForce RTX 5060 Ti", "GPU-0b7f5d3e-6f0a-4a5e-9f3c-3a2b1c0d9e8f"),
    ]
    assert (survey.driver_version, survey.cuda_driver_version) == ("570.86.15", "12.8")
    assert survey.notes[0].startswith("NVML: the NVML library (libnvidia-ml) was not found")
    assert "no NVIDIA driver" in survey.notes[0]
    assert "CUDA_VISIBLE_DEVICES='1,0' shows 2 of 2" in survey.notes[1]


@pytest.mark.usefixtures("no_nvml")
def test_nvidia_smi_without_devices_explains_it(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, 'echo "No devices were found"; exit 6\n')
    survey = probe_gpus(env={}, nvidia_smi=smi)
    assert (survey.source, survey.gpus) == ("nvidia-smi", ())
    assert "the NVIDIA driver is loaded but no NVIDIA GPU was found" in survey.notes


@pytest.mark.usefixtures("no_nvml")
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (f'echo "{NO_DRIVER}"; exit 9\n', f"nvidia-smi: exited with code 9: {NO_DRIVER}"),
        (
            "echo 'Field \"compute_cap\" is not a valid field to query.' >&2; exit 2\n",
            "drivers older than 510",
        ),
        ("exec sleep 5\n", "nvidia-smi: no answer within 0.5 s"),
        (
            'echo "0, NVIDIA GeForce GTX 1060 6GB"\n',
            "nvidia-smi: nvidia-smi printed 2 fields where 7",
        ),
    ],
)
def test_failing_nvidia_smi_leaves_source_none_with_both_reasons(
    tmp_path: Path, body: str, expected: str
) -> None:
    survey = probe_gpus(env={}, nvidia_smi=fake_smi(tmp_path, body), timeout_s=0.5)
    assert (survey.source, survey.gpus, survey.driver_version) == ("none", (), None)
    assert survey.notes[0].startswith("NVML: ")
    assert any(expected in note for note in survey.notes), survey.notes
    assert "CPU-only" in survey.notes[-1]


def test_missing_nvml_and_nvidia_smi_are_both_explained(no_nvml: FakeNvml, tmp_path: Path) -> None:
    survey = probe_gpus(env={}, nvidia_smi=str(tmp_path / "nvidia-smi"))
    assert survey.source == "none"
    assert survey.notes == (
        "NVML: the NVML library (libnvidia-ml) was not found: no NVIDIA driver is installed, or "
        "this container was started without GPU access (docker run --gpus all)",
        f"nvidia-smi: '{tmp_path / 'nvidia-smi'}' not found (it comes with the driver)",
        "no GPU could be surveyed, so this host counts as CPU-only",
    )
    assert no_nvml.calls == ["init"]


def test_missing_pynvml_module_is_explained(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    survey = probe_gpus(env={}, nvidia_smi=str(tmp_path / "nvidia-smi"))
    assert survey.notes[0] == "NVML: nvidia-ml-py (the pynvml module) is not installed"
