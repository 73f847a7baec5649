"""Every setting of the contract (fdl.settings) through every source it has, along the real path:
an ``fdl run`` flag as text, an ``FDL_*`` variable, a real ``fdl.toml``, the script's value —
the launcher's resolution (fdl.settings), the launch spec (fdl.launch.spec) and the worker
environment it makes, then the engine's resolution in the worker (fdl.engine.config). The winner
must follow docs/run.md: flag > ``FDL_*`` > config file > script > default, with the source
recorded.

The example values below must cover every setting: adding one to the contract without an entry
here fails :func:`test_every_setting_has_examples`.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from fdl.engine.config import resolve_config
from fdl.launch.config_file import load_config_file
from fdl.launch.request import RunRequest
from fdl.launch.spec import LaunchProbes, LaunchSpec, build_launch_spec, place_workers
from fdl.settings import SETTINGS, Setting, SettingSpec, resolve_run_settings
from fdl.system.gpus import GpuInfo, GpuSurvey

# name -> {source: example}; flag and env values are text, file values TOML, script values
# Python. Every example differs from the default (a script value equal to it counts as default).
EXAMPLES: dict[str, dict[str, Any]] = {
    "policy": {"flag": "async", "env": "sync", "file": "async", "script": "sync"},
    "backend": {"flag": "cpu", "env": "nccl", "file": "cpu", "script": "nccl"},
    "epochs": {"flag": "2", "env": "3", "file": 4, "script": 6},
    "batch_size": {"flag": "8", "env": "16", "file": 32, "script": 128},
    "seed": {"flag": "1", "env": "2", "file": 3, "script": 4},
    "simulate_slowdown": {"flag": "1,2", "env": "1,3", "file": [1, 4]},  # no Trainer argument
    "checkpoint_every": {"flag": "2", "env": "10m", "file": "90s", "script": 3},
    "tensorboard": {"flag": "on", "env": "tb/env", "file": "tb/file", "script": "tb/script"},
    "precision": {"flag": "bf16,fp32", "env": "fp16", "file": ["fp32", "bf16"],
                  "script": "bf16"},
    "micro_batch_size": {"flag": "16,64", "env": "auto", "file": [8, "auto"], "script": 32},
    "max_steps": {"flag": "100", "env": "200", "file": 300, "script": 400},
    "max_samples": {"flag": "1000", "env": "2000", "file": 3000, "script": 4000},
    "max_time": {"flag": "90s", "env": "10m", "file": "1.5h", "script": 30},
    "divergence_threshold": {"env": "0.25"},
    "overhead_target": {"env": "0.1"},
    "collective_timeout": {"flag": "90s", "env": "10m", "file": "2m"},
    "average_dtype": {"flag": "int8", "env": "bf16", "file": "int8"},
    "outer_optimizer": {"flag": "nesterov", "env": "nesterov", "file": "nesterov"},
    "outer_lr": {"flag": "1", "env": "0.5", "file": 0.9},
    "outer_momentum": {"flag": "0", "env": "0.5", "file": 0.8},
    "run_dir": {"flag": "runs/flag", "env": "runs/env", "file": "runs/file"},
    "nproc_per_node": {"flag": "3", "env": "4", "file": 1},
    "max_restarts": {"flag": "1", "env": "2", "file": 3},
}
ORDER = ("flag", "env", "file", "script")
# The settings whose examples only a GPU worker takes (backend nccl, precision fp16): planned on
# two Ampere GPUs, since fdl run refuses them for CPU workers as the workers would.
ON_GPUS = ("backend", "precision")
TWO_GPUS = GpuSurvey("fixture", tuple(GpuInfo(i, "NVIDIA A100", (8, 0), uuid=f"GPU-{i}")
                                      for i in range(2)), "550.0", "12.4")


def _sources(spec: SettingSpec) -> tuple[str, ...]:
    has = {"flag": spec.flag, "env": True, "file": spec.file, "script": spec.script}
    return tuple(source for source in ORDER if has[source])


def test_every_setting_has_examples() -> None:
    assert set(EXAMPLES) == {spec.name for spec in SETTINGS}
    for spec in SETTINGS:
        assert set(EXAMPLES[spec.name]) == set(_sources(spec)), spec.name


def test_the_script_settings_are_exactly_the_trainers_arguments() -> None:
    """``script=True`` claims an ``fdl.Trainer`` argument: a setting a script cannot pass must
    not say it can, and an argument named like an engine setting must be one."""
    import inspect

    from fdl.engine.trainer import Trainer

    arguments = set(inspect.signature(Trainer).parameters)
    engine = {spec.name for spec in SETTINGS if spec.engine}
    assert {spec.name for spec in SETTINGS if spec.script} == arguments & engine


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _launch_spec(request: RunRequest, *, settings: dict[str, Setting], survey: GpuSurvey,
                 env: dict[str, str], cwd: Path, logical_cores: int) -> LaunchSpec:
    """The launch spec of ``request``, planned without the probes (fdl.launch.spec)."""
    placement = place_workers(request, settings=settings, survey=survey, env=env, cwd=cwd,
                              now=datetime(2030, 1, 1, tzinfo=timezone.utc), run_id="x",
                              logical_cores=logical_cores, taken=lambda path: False)
    return build_launch_spec(request, settings=settings, placement=placement,
                             probes=LaunchProbes(survey), env=env)


def _run(spec: SettingSpec, given: tuple[str, ...], tmp: Path) -> tuple[Any, str]:
    """The value and source the setting ends with when ``given`` sources set it."""
    examples = EXAMPLES[spec.name]
    project = tmp / "-".join(given or ("none",))
    project.mkdir()
    (project / "train.py").write_text("")
    if "file" in given:
        (project / "fdl.toml").write_text(f"{spec.name} = {_toml(examples['file'])}\n")
    env = {spec.env: examples["env"]} if "env" in given else {}
    flags = {spec.name: examples["flag"]} if "flag" in given else {}
    file_values, file_path = load_config_file(project)
    settings = resolve_run_settings(flags=flags, env=env, file_values=file_values,
                                    file_path=file_path)
    launch = _launch_spec(
        RunRequest("train.py", (), flags), settings=settings,
        survey=TWO_GPUS if spec.name in ON_GPUS else GpuSurvey("none", (), None, None),
        env=env, cwd=project, logical_cores=8)
    if not spec.engine:
        setting = launch.settings[spec.name]
        return setting.value, setting.source
    script = {spec.name: examples["script"]} if "script" in given else {}
    config = resolve_config(script=script, env={**env, **launch.env})  # what a worker sees
    return config.to_dict()[spec.name]["value"], config.sources[spec.name]


def _expected(spec: SettingSpec, given: tuple[str, ...], project: Path) -> tuple[Any, str]:
    if not given:
        return spec.default, "default"
    winner = min(given, key=ORDER.index)
    value = spec.parse(EXAMPLES[spec.name][winner])
    source = f"file:{project / 'fdl.toml'}" if winner == "file" else winner
    return value, source


@pytest.mark.parametrize("spec", SETTINGS, ids=lambda spec: spec.name)
def test_each_source_wins_over_the_ones_below_it(spec: SettingSpec, tmp_path: Path) -> None:
    sources = _sources(spec)
    for count in range(len(sources) + 1):
        for given in itertools.combinations(sources, count):
            project = tmp_path / "-".join(given or ("none",))
            assert _run(spec, given, tmp_path) == _expected(spec, given, project), given


def test_a_flag_reaches_the_engine_as_its_own_variable() -> None:
    """The worker environment carries the flag's value and its provenance."""
    flags = {"policy": "sync", "simulate_slowdown": "1,2.5"}
    launch = _launch_spec(
        RunRequest("train.py", (), flags),
        settings=resolve_run_settings(flags=flags, env={}, file_values={}, file_path=None),
        survey=GpuSurvey("none", (), None, None), env={}, cwd=Path("/nonexistent"),
        logical_cores=2)
    assert launch.env["FDL_POLICY"] == "sync"
    assert launch.env["FDL_SLOWDOWN"] == "1,2.5"
    config = resolve_config(script={"policy": "async"}, env=launch.env)
    assert (config.policy.name, config.sources["policy"]) == ("sync", "flag")
