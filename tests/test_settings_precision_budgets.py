"""The settings of issue 25 (fdl.settings): ``precision`` (one choice for every rank or one per
rank) and the training budgets ``max_steps``, ``max_samples``, ``max_time`` — their parsers,
their text for a worker and back, their place in EngineConfig and config.json, and ``fdl run``
flags winning over the script's values. Every setting has its line in docs/run.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import run_fdl

from fdl.engine.config import resolve_config
from fdl.errors import UsageError
from fdl.settings import BY_NAME, SETTINGS, engine_env, resolve_run_settings

ROOT = Path(__file__).resolve().parents[1]
PRECISION = BY_NAME["precision"]


@pytest.mark.parametrize(("raw", "value"), [
    ("auto", ("auto",)), ("BF16", ("bf16",)), (" bf16 , fp32 ", ("bf16", "fp32")),
    ("fp16,fp16,fp32", ("fp16", "fp16", "fp32")), (["fp32", "bf16"], ("fp32", "bf16")),
    (("fp16",), ("fp16",)),
])
def test_precision_is_one_choice_or_one_per_rank(raw: Any, value: tuple[str, ...]) -> None:
    assert PRECISION.parse(raw) == value


@pytest.mark.parametrize("raw", ["", "fp8", "bf16,,fp32", "bf16;fp32", "float32", [], 16, None])
def test_a_bad_precision_is_one_line_naming_what_is_allowed(raw: Any) -> None:
    with pytest.raises(UsageError) as caught:
        PRECISION.parse(raw)
    assert caught.value.message == ("precision must be one of auto, fp32, bf16, fp16 for every "
                                    f"rank, or one of them per rank, comma-separated; got {raw!r}")
    assert "\n" not in caught.value.message and caught.value.exit_code == 2


@pytest.mark.parametrize("value", [("auto",), ("bf16", "fp32"), ["fp16", "fp32"]])
def test_precision_text_reads_back_as_the_same_value(value: Any) -> None:
    """What a worker receives (and what --resume turns a JSON list back into)."""
    text = PRECISION.encode(value)
    assert text == ",".join(value)
    assert PRECISION.parse(text) == tuple(value)


@pytest.mark.parametrize("name", ["max_steps", "max_samples"])
def test_a_count_budget_is_a_positive_integer_or_off(name: str) -> None:
    parse = BY_NAME[name].parse
    assert (parse("100"), parse(7), parse("off"), parse(" None "), parse(None)) == (
        100, 7, None, None, None)
    for bad in ("0", "-5", "2.5", "lots", True, "9" * 400):
        with pytest.raises(UsageError, match=rf"^{name} must be a whole number in \[1, \d+\], got"):
            parse(bad)


@pytest.mark.parametrize(("raw", "seconds"), [
    ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("45", 45.0), (" 2M ", 120.0),
    (30, 30.0), (0.5, 0.5), ("off", None), (None, None),
])
def test_max_time_is_a_time_in_seconds(raw: Any, seconds: float | None) -> None:
    assert BY_NAME["max_time"].parse(raw) == seconds


@pytest.mark.parametrize("raw", ["0", "0s", "-1m", "10d", "soon", "nan", "inf", "", True, "8761h",
                                 "1e308h"])
def test_a_bad_max_time_names_the_value_and_the_units(raw: Any) -> None:
    with pytest.raises(UsageError) as caught:
        BY_NAME["max_time"].parse(raw)
    assert caught.value.message == f"max_time must be a time in (0s, 8760h], got {raw!r}"
    assert "90s, 10m or 1.5h" in caught.value.hint


@pytest.mark.parametrize("seconds", [5400.0, 0.25, 1234567.5, 1 / 3])
def test_max_time_reaches_a_worker_exactly(seconds: float) -> None:
    """A float's text is as short as reads back to the same number (``:g`` alone rounds
    1234567.5 to 1.23457e+06)."""
    spec = BY_NAME["max_time"]
    assert spec.parse(spec.encode(seconds)) == seconds


def test_the_engine_config_carries_precision_and_budgets_into_config_json() -> None:
    config = resolve_config(script={"max_steps": 500, "precision": "fp32"},
                            env={"FDL_PRECISION": "bf16,fp32", "FDL_MAX_TIME": "10m",
                                 "FDL_MAX_SAMPLES": "4096"})
    assert (config.precision, config.max_steps, config.max_samples, config.max_time) == (
        ("bf16", "fp32"), 500, 4096, 600.0)
    recorded = json.loads(json.dumps(config.to_dict()))
    assert recorded["precision"] == {"value": ["bf16", "fp32"], "source": "env"}
    assert recorded["max_steps"] == {"value": 500, "source": "script"}
    assert recorded["max_time"] == {"value": 600.0, "source": "env"}


def test_by_default_auto_precision_and_no_budget() -> None:
    config = resolve_config(script={}, env={})
    assert (config.precision, config.max_steps, config.max_samples, config.max_time) == (
        ("auto",), None, None, None)


@pytest.mark.parametrize("value", ["auto", ["auto"], "AUTO"])
def test_a_script_precision_that_means_the_default_counts_as_default(value: Any) -> None:
    config = resolve_config(script={"precision": value}, env={})
    assert config.precision == ("auto",) and config.sources["precision"] == "default"


def test_a_flag_lifts_a_budget_the_config_file_sets() -> None:
    settings = resolve_run_settings(flags={"max_steps": "off"}, env={},
                                    file_values={"max_steps": 100}, file_path=Path("fdl.toml"))
    env = engine_env(settings)
    assert env["FDL_MAX_STEPS"] == "off"
    config = resolve_config(script={"max_steps": 50}, env=env)
    assert config.max_steps is None and config.sources["max_steps"] == "flag"


def test_fdl_run_flags_override_the_config_file_for_the_workers(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "fdl.toml").write_text('precision = "fp32"\nmax_steps = 50\n')
    proc = run_fdl("run", "--dry-run", "--json", "--precision", "bf16,fp32", "train.py",
                   "--max-steps", "100", "--max-samples", "2000", "--max-time", "1.5h",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["args"] == []  # fdl's flags after SCRIPT too
    assert {k: spec["env"][k] for k in ("FDL_PRECISION", "FDL_MAX_STEPS", "FDL_MAX_SAMPLES",
                                        "FDL_MAX_TIME")} == {
        "FDL_PRECISION": "bf16,fp32", "FDL_MAX_STEPS": "100", "FDL_MAX_SAMPLES": "2000",
        "FDL_MAX_TIME": "5400"}
    assert spec["settings"]["precision"] == {"value": ["bf16", "fp32"], "source": "flag"}
    assert spec["settings"]["max_time"] == {"value": 5400.0, "source": "flag"}


def test_a_bad_precision_flag_is_exit_2_with_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    proc = run_fdl("run", "--dry-run", "--precision", "fp8", "train.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "error: --precision: precision must be one of auto, fp32, bf16, fp16 for every rank, or "
        "one of them per rank, comma-separated; got 'fp8'")


def test_every_setting_has_its_line_in_docs_run_md() -> None:
    text = (ROOT / "docs" / "run.md").read_text(encoding="utf-8")
    missing = [spec.name for spec in SETTINGS
               if spec.env not in text or (spec.flag and f"`{spec.flag_name}" not in text)]
    assert missing == []
