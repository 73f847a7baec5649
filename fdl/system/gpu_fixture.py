"""The FDL_GPU_SURVEY test seam: a recorded GPU survey read from a JSON file.

Tests and CI describe a two-GPU host without owning one by pointing ``FDL_GPU_SURVEY`` at a
file such as::

    {"driver_version": "570.86.15", "cuda_driver_version": "12.8",
     "gpus": [{"name": "NVIDIA GeForce RTX 5060 Ti", "compute_capability": "12.0",
               "memory_mib": 16311},
              {"name": "NVIDIA GeForce GTX 1060 6GB", "compute_capability": "6.1",
               "memory_mib": 6144}]}

``driver_version`` and ``cuda_driver_version`` may be null (no driver), ``gpus`` may be empty,
``memory_mib`` may be null; a GPU may also carry ``index``, ``uuid`` and ``pci_bus_id``. Other
keys are ignored. A file that breaks these rules raises ``SurveyError`` naming file and key.

``probe_gpus`` (fdl/system/gpus.py) reads the file through ``load_survey_fixture`` and then
applies CUDA_VISIBLE_DEVICES to it as it does to a hardware survey. The dependency is one-way:
this module needs only the survey's types (fdl/system/gpu_info.py), never ``gpus``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import SurveyError
from fdl.system.gpu_info import GpuInfo, GpuSurvey, parse_compute_capability

SURVEY_ENV = "FDL_GPU_SURVEY"
_MISSING: Any = object()
_FIXTURE_HINT = (
    f"{SURVEY_ENV} names a recorded GPU survey for tests (format in fdl/system/gpu_fixture.py); "
    "unset it to survey the real GPUs"
)


def load_survey_fixture(path: Path) -> GpuSurvey:
    """Read a recorded survey (format in the module docstring) as a ``source="fixture"`` survey.

    CUDA_VISIBLE_DEVICES is not applied here (``probe_gpus`` does that). Raises ``SurveyError``
    naming the file and the key for a missing file, bad JSON or a missing or ill-typed key.
    """
    try:
        data = readback.read_json(Path(path), follow=True)
    except OSError as exc:
        problem = f"cannot read the GPU survey ({exc.strerror or exc})"
        raise SurveyError(f"{path}: {problem}", hint=_FIXTURE_HINT) from None
    except readback.ReadBackError as exc:  # not a file, too large, not UTF-8, not JSON
        problem = f"the GPU survey {exc.problem}"
        raise SurveyError(f"{path}: {problem}", hint=_FIXTURE_HINT) from None
    top = _checked(data, _SURVEY_KEYS, path=path, where="")
    gpus = tuple(
        _fixture_gpu(_checked(item, _GPU_KEYS, path=path, where=f"gpus[{i}]"), position=i)
        for i, item in enumerate(top["gpus"])
    )
    notes = (f"GPU survey read from {SURVEY_ENV}={path}, not from the hardware",)
    if not gpus:
        driver = "" if top["driver_version"] else " and no NVIDIA driver"
        notes += (f"the recorded survey lists no GPU{driver}",)
    return GpuSurvey("fixture", gpus, top["driver_version"], top["cuda_driver_version"], notes)


def _fixture_gpu(values: Mapping[str, Any], *, position: int) -> GpuInfo:
    index, cc = values["index"], parse_compute_capability(values["compute_capability"])
    assert cc is not None  # _is_cc accepted it
    return GpuInfo(
        index=position if index is None else index,
        name=values["name"],
        compute_capability=cc,
        memory_mib=values["memory_mib"],
        uuid=values["uuid"],
        pci_bus_id=values["pci_bus_id"],
    )


def _checked(obj: Any, keys: Mapping[str, _KeyRule], *, path: Path, where: str) -> dict[str, Any]:
    """The values of ``keys`` in the JSON object ``obj`` (None for absent optional keys)."""
    if not isinstance(obj, dict):
        raise _fixture_error(path, where or "the top level", "a JSON object", obj)
    values = {}
    for key, (required, ok, allowed) in keys.items():
        name = f"{where}.{key}" if where else key
        if key not in obj and required:
            raise _fixture_error(path, name, allowed)
        if key in obj and not ok(obj[key]):
            raise _fixture_error(path, name, allowed, obj[key])
        values[key] = obj.get(key)
    return values


def _fixture_error(path: Path, key: str, allowed: str, value: Any = _MISSING) -> SurveyError:
    got = "it is missing" if value is _MISSING else f"got {json.dumps(value)[:60]}"
    return SurveyError(f"{path}: {key} must be {allowed}; {got}", hint=_FIXTURE_HINT)


def _is_optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _is_optional_count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_cc(value: Any) -> bool:
    return isinstance(value, str) and parse_compute_capability(value) is not None


_KeyRule = tuple[bool, Callable[[Any], bool], str]  # (required, check, what is allowed)
_OPTIONAL_STR: _KeyRule = (True, _is_optional_str, "a string or null")
_SURVEY_KEYS: dict[str, _KeyRule] = {
    "driver_version": _OPTIONAL_STR,
    "cuda_driver_version": _OPTIONAL_STR,
    "gpus": (True, lambda v: isinstance(v, list), "a list of GPU objects"),
}
_GPU_KEYS: dict[str, _KeyRule] = {
    "name": (True, _is_name, "a non-empty string"),
    "compute_capability": (True, _is_cc, 'a "MAJOR.MINOR" string such as "8.6"'),
    "memory_mib": (True, _is_optional_count, "a whole number of MiB or null"),
    "index": (False, _is_optional_count, "a whole number >= 0"),
    "uuid": (False, _is_optional_str, "a string or null"),
    "pci_bus_id": (False, _is_optional_str, "a string or null"),
}
