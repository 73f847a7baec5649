"""GPU survey: which NVIDIA GPUs this host has, numbered the way CUDA will number them.

``probe_gpus()`` asks three sources in turn and keeps the first that answers:

1. ``FDL_GPU_SURVEY=<file.json>``: a recorded survey, the documented test seam that lets tests
   and CI describe a two-GPU host without owning one (format and rules in
   fdl/system/gpu_fixture.py; a file that breaks them raises ``SurveyError``).
2. NVML, through the ``pynvml`` module of the nvidia-ml-py distribution (imported lazily).
3. ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``, when NVML cannot be used.

If none answers the survey has ``source == "none"``. An empty survey is never silent: every
failed source and every missing value leaves a line in ``GpuSurvey.notes`` saying why.

CUDA_VISIBLE_DEVICES (read from ``env``) is applied to every source with the rules torch.cuda
reads it by: a comma list of indices, or of UUIDs (``GPU-...``, a unique prefix is enough) when
the first entry is one; the GPUs are kept in the order given and renumbered 0..n-1; the list
ends at the first entry that names no GPU; a repeated GPU leaves none visible; ``""`` and
``"-1"`` hide every GPU; unset shows all.

Index order: NVML and nvidia-smi number GPUs in PCI bus order, CUDA by default fastest first
(CUDA_DEVICE_ORDER=FASTEST_FIRST), which differ on a host with mixed GPUs. ``fdl run`` sets
CUDA_DEVICE_ORDER=PCI_BUS_ID for its workers so that the indices here are the ones they see.

The survey's types, ``GpuInfo`` and ``GpuSurvey``, are defined in :mod:`fdl.system.gpu_info`
(below this module and the fixture reader alike) and imported from here by the rest of fdl.

Example::

    >>> survey = probe_gpus(env={"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    >>> [(gpu.index, gpu.name, gpu.arch) for gpu in survey.gpus]
    [(0, 'NVIDIA GeForce GTX 1060 6GB', 'sm_61')]
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fdl.errors import SurveyError
from fdl.system.gpu_fixture import SURVEY_ENV, load_survey_fixture
from fdl.system.gpu_info import GpuInfo, GpuSurvey, parse_compute_capability

_SMI_FIELDS = (
    "index", "name", "uuid", "pci.bus_id", "compute_cap", "memory.total", "driver_version",
)


class _Unavailable(Exception):
    """A survey source cannot answer; the message is the note that says why."""


def probe_gpus(
    *, env: Mapping[str, str] | None = None, nvidia_smi: str = "nvidia-smi", timeout_s: float = 10.0
) -> GpuSurvey:
    """Survey the GPUs: FDL_GPU_SURVEY fixture, else NVML, else nvidia-smi, else ``"none"``.

    ``env`` defaults to ``os.environ``; CUDA_VISIBLE_DEVICES from it is applied to the result.
    ``nvidia_smi`` is the command (name or path) and ``timeout_s`` bounds each run of it.
    Raises ``SurveyError`` only for an unusable FDL_GPU_SURVEY file.
    """
    env = os.environ if env is None else env
    fixture = env.get(SURVEY_ENV)
    if fixture:
        survey = load_survey_fixture(Path(fixture))
    else:
        survey = _probe_hardware(nvidia_smi=nvidia_smi, timeout_s=timeout_s)
    value = env.get("CUDA_VISIBLE_DEVICES")
    gpus, visible_note = apply_visible_devices(survey.gpus, value)
    extra = (visible_note, _device_order_note(gpus, env))
    notes = survey.notes + tuple(note for note in extra if note)
    return replace(survey, gpus=gpus, notes=notes, visible_devices=value)


def _probe_hardware(*, nvidia_smi: str, timeout_s: float) -> GpuSurvey:
    try:
        return _probe_nvml()
    except _Unavailable as exc:
        nvml_note = str(exc)
    try:
        survey = _probe_smi(nvidia_smi=nvidia_smi, timeout_s=timeout_s)
    except _Unavailable as exc:
        notes = (nvml_note, str(exc), "no GPU could be surveyed, so this host counts as CPU-only")
        return GpuSurvey("none", (), None, None, notes)
    return replace(survey, notes=(nvml_note, *survey.notes))


def _no_gpu_note(driver_version: str | None) -> str:
    driver = f"NVIDIA driver {driver_version}" if driver_version else "the NVIDIA driver"
    return f"{driver} is loaded but no NVIDIA GPU was found"


def _device_order_note(gpus: Sequence[GpuInfo], env: Mapping[str, str]) -> str | None:
    if len({gpu.name for gpu in gpus}) < 2 or env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return None
    return (
        "indices are in PCI bus order; CUDA numbers mixed GPUs fastest first unless "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID is set (fdl run sets it for its workers)"
    )


def apply_visible_devices(
    gpus: Sequence[GpuInfo], value: str | None
) -> tuple[tuple[GpuInfo, ...], str | None]:
    """Return the GPUs CUDA shows under CUDA_VISIBLE_DEVICES=``value``, renumbered, and a note.

    ``gpus`` carry their physical (PCI order) indices. The note (None when nothing changed)
    says which GPUs are hidden or reordered and which entry, if any, CUDA stops at.
    """
    if value is None:
        return tuple(gpus), None
    if value.strip().startswith("MIG-"):
        return tuple(gpus), f"CUDA_VISIBLE_DEVICES={value!r} selects MIG instances; all GPUs shown"
    chosen, problem = _select_visible(gpus, value)
    visible = tuple(replace(gpu, index=i) for i, gpu in enumerate(chosen))
    if problem is None and [g.index for g in chosen] == [g.index for g in gpus]:
        return visible, None
    if not chosen:
        note = f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU"
    else:
        shown = ", ".join(f"{i} = GPU {gpu.index} ({gpu.name})" for i, gpu in enumerate(chosen))
        note = f"CUDA_VISIBLE_DEVICES={value!r} shows {len(chosen)} of {len(gpus)} GPU(s): {shown}"
    if problem and value.strip() not in ("", "-1"):
        note += f"; {problem}"
    return visible, note


def _select_visible(gpus: Sequence[GpuInfo], value: str) -> tuple[list[GpuInfo], str | None]:
    uuid_mode = value.startswith("GPU-")
    chosen: list[GpuInfo] = []
    for entry in value.split(","):
        gpu = _match_uuid(gpus, entry) if uuid_mode else _match_ordinal(gpus, entry)
        if gpu is None:
            what = "the UUID (or unique UUID prefix) of one GPU" if uuid_mode else "a GPU index"
            return chosen, f"entry {entry!r} is not {what}, so CUDA ignores it and all after it"
        if gpu in chosen:
            return [], f"entry {entry!r} repeats a GPU, and CUDA then shows none"
        chosen.append(gpu)
    return chosen, None


def _match_ordinal(gpus: Sequence[GpuInfo], entry: str) -> GpuInfo | None:
    # CUDA reads each entry like strtoul: leading digits count, "1gpu" means 1.
    match = re.match(r"[+-]?\d+", entry.strip())
    number = int(match.group()) if match else -1
    return next((gpu for gpu in gpus if gpu.index == number), None) if number >= 0 else None


def _match_uuid(gpus: Sequence[GpuInfo], entry: str) -> GpuInfo | None:
    if not entry.startswith("GPU-"):
        return None
    found = [gpu for gpu in gpus if gpu.uuid and gpu.uuid.startswith(entry)]
    return found[0] if len(found) == 1 else None


def _probe_nvml() -> GpuSurvey:
    try:
        import pynvml
    except ImportError:
        raise _Unavailable("NVML: nvidia-ml-py (the pynvml module) is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise _Unavailable(f"NVML: {_nvml_init_reason(exc)}") from None
    try:
        return _read_nvml(pynvml)
    except Exception as exc:  # NVMLError, or bindings older than the calls: fall back either way
        raise _Unavailable(f"NVML: reading the GPUs failed ({_text(exc)})") from None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


_NVML_INIT_REASONS = {
    "NVMLError_LibraryNotFound": (
        "the NVML library (libnvidia-ml) was not found: no NVIDIA driver is installed, or this "
        "container was started without GPU access (docker run --gpus all)"
    ),
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is installed but not loaded (kernel module)",
    "NVMLError_NoPermission": "no permission to talk to the NVIDIA driver (check /dev/nvidia*)",
}


def _nvml_init_reason(exc: Exception) -> str:
    return _NVML_INIT_REASONS.get(type(exc).__name__, f"initialisation failed ({_text(exc)})")


def _read_nvml(nvml: Any) -> GpuSurvey:
    gpus = tuple(_nvml_gpu(nvml, index) for index in range(nvml.nvmlDeviceGetCount()))
    driver = _nvml_optional(nvml, lambda: _text(nvml.nvmlSystemGetDriverVersion()))
    cuda = None
    for getter in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
        value = _nvml_optional(nvml, getattr(nvml, getter, lambda: None))
        if cuda is None and value:
            cuda = parse_cuda_version_int(int(value))
    notes = [] if gpus else [_no_gpu_note(driver)]
    if driver is None:
        notes.append("NVML did not report the driver version")
    if cuda is None:
        notes.append("NVML did not report the highest CUDA version the driver supports")
    return GpuSurvey("nvml", gpus, driver, cuda, tuple(notes))


def _nvml_gpu(nvml: Any, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        compute_capability=(int(major), int(minor)),
        memory_mib=_nvml_optional(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total >> 20),
        uuid=_nvml_optional(nvml, lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        pci_bus_id=_nvml_optional(nvml, lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
    )


def _nvml_optional(nvml: Any, read: Callable[[], Any]) -> Any:
    """``read()``, or None where this GPU or driver does not support the query."""
    try:
        return read()
    except nvml.NVMLError:
        return None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def parse_cuda_version_int(value: int) -> str:
    """NVML's integer CUDA version as text: ``12080`` -> ``"12.8"``, ``13000`` -> ``"13.0"``."""
    if value <= 0:
        raise ValueError(f"CUDA version must be a positive integer such as 12080, got {value}")
    return f"{value // 1000}.{value % 1000 // 10}"


def _probe_smi(*, nvidia_smi: str, timeout_s: float) -> GpuSurvey:
    exe = shutil.which(nvidia_smi)
    if exe is None:
        raise _Unavailable(f"nvidia-smi: {nvidia_smi!r} not found (it comes with the driver)")
    query = [exe, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    done = _run_smi(query, timeout_s=timeout_s)
    said = f"{done.stdout}\n{done.stderr}".strip()
    if done.returncode != 0 and "No devices were found" in said:
        return GpuSurvey("nvidia-smi", (), None, None, (_no_gpu_note(None),))
    if done.returncode != 0:
        old = " (drivers older than 510 cannot report compute_cap)" if "compute_cap" in said else ""
        why = f"{_first_line(said)}{old}"
        raise _Unavailable(f"nvidia-smi: exited with code {done.returncode}: {why}")
    try:
        rows = _smi_rows(done.stdout)
        gpus = tuple(_smi_gpu(row, position=i) for i, row in enumerate(rows))
    except SurveyError as exc:
        raise _Unavailable(f"nvidia-smi: {exc.message}") from None
    driver = rows[0]["driver_version"] if rows else None
    notes = [] if gpus else [_no_gpu_note(driver)]
    try:
        cuda = parse_smi_cuda_version(_run_smi([exe], timeout_s=timeout_s).stdout)
    except _Unavailable as exc:
        cuda, notes = None, [*notes, str(exc)]
    if cuda is None:
        notes.append("nvidia-smi did not show the highest CUDA version the driver supports")
    return GpuSurvey("nvidia-smi", gpus, driver, cuda, tuple(notes))


def _run_smi(argv: list[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        why = f"no answer within {timeout_s:g} s (is the driver hung?)"
        raise _Unavailable(f"nvidia-smi: {why}") from None
    except OSError as exc:
        raise _Unavailable(f"nvidia-smi: could not run {argv[0]} ({exc.strerror or exc})") from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def parse_smi_cuda_version(text: str) -> str | None:
    """The ``CUDA Version: 12.8`` of plain ``nvidia-smi`` output, or None when absent."""
    match = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", text)
    return match.group(1) if match else None


def parse_nvidia_smi_csv(text: str) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,compute_cap,memory.total,
    driver_version --format=csv,noheader,nounits`` output.

    ``[N/A]``-style fields become None. Raises ``SurveyError`` for a row with the wrong number of
    fields or without a name or compute capability.
    """
    return [_smi_gpu(row, position=i) for i, row in enumerate(_smi_rows(text))]


def _smi_rows(text: str) -> list[dict[str, str | None]]:
    rows = []
    for fields in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not any(field.strip() for field in fields):
            continue
        if len(fields) != len(_SMI_FIELDS):
            raise SurveyError(
                f"nvidia-smi printed {len(fields)} fields where {len(_SMI_FIELDS)} were asked for: "
                f"{', '.join(fields)!r}"
            )
        rows.append(dict(zip(_SMI_FIELDS, map(_smi_value, fields), strict=True)))
    return rows


def _smi_value(field: str) -> str | None:
    field = field.strip()
    unknown = not field or field == "N/A" or (field.startswith("[") and field.endswith("]"))
    return None if unknown else field


def _smi_gpu(row: Mapping[str, str | None], *, position: int) -> GpuInfo:
    name, cc, index = row["name"], parse_compute_capability(row["compute_cap"] or ""), _smi_int(row["index"])
    if name is None or cc is None:
        missing = "name" if name is None else f"compute capability ({name})"
        raise SurveyError(f"nvidia-smi gave no {missing} for GPU {position}")
    return GpuInfo(
        index=position if index is None else index,
        name=name,
        compute_capability=cc,
        memory_mib=_smi_int(row["memory.total"]),
        uuid=row["uuid"],
        pci_bus_id=row["pci.bus_id"],
    )


def _smi_int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None
