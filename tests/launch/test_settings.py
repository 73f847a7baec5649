"""Run settings: value parsers, fdl.toml / [tool.fdl], flag > env > file > default, and the engine
settings as the workers' FDL_* variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fdl.errors import ConfigError, UsageError
from fdl.launch.config_file import load_config_file
from fdl.settings import (
    BY_NAME,
    EPOCHS,
    SEEDS,
    SETTINGS,
    SOURCES_ENV,
    Setting,
    engine_env,
    parse_backend,
    parse_nproc,
    parse_policy,
    parse_slowdown,
    parse_whole,
    resolve_run_settings,
)

# --- parsers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"), [("sync", "sync"), (" Cadence ", "cadence"), ("ASYNC", "async")]
)
def test_parse_policy_accepts_known_policies_in_any_case(text: str, value: str) -> None:
    assert parse_policy(text) == value


def test_parse_policy_names_the_value_and_the_policies() -> None:
    with pytest.raises(UsageError) as caught:
        parse_policy("lockstep")
    assert caught.value.message == "unknown policy 'lockstep'"
    assert caught.value.hint == "use one of: sync, cadence, async, auto"
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("parse", "typo", "meant"), [(parse_policy, "cadance", "cadence"),
                                                      (parse_policy, "Asynch", "async"),
                                                      (parse_backend, "ncl", "nccl")])
def test_a_typo_of_a_choice_is_told_the_one_it_meant(parse, typo, meant) -> None:
    with pytest.raises(UsageError) as caught:
        parse(typo)
    assert caught.value.message.endswith(f" (did you mean {meant!r}?)")
    assert caught.value.hint.startswith("use one of: ")


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("NCCL", "nccl"), (" cpu", "cpu")])
def test_parse_backend_accepts_known_backends(text: str, value: str) -> None:
    assert parse_backend(text) == value


def test_parse_backend_names_the_value_and_the_backends() -> None:
    with pytest.raises(UsageError) as caught:
        parse_backend("gloo")
    assert caught.value.message == "unknown backend 'gloo'"
    assert caught.value.hint == "use one of: auto, nccl, cpu"


@pytest.mark.parametrize(("raw", "value"), [("3", 3), (" 12 ", 12), (7, 7)])
def test_parse_whole_accepts_whole_numbers_in_range(raw: Any, value: int) -> None:
    assert parse_whole("epochs", EPOCHS)(raw) == value


@pytest.mark.parametrize("raw", ["0", "-2", "three", "2.5", 2.5, True, "", None, "1000001"])
def test_parse_whole_rejects_the_rest_naming_field_value_and_range(raw: Any) -> None:
    with pytest.raises(UsageError) as caught:
        parse_whole("epochs", EPOCHS)(raw)
    assert caught.value.message == f"epochs must be a whole number in [1, 1000000], got {raw!r}"


@pytest.mark.parametrize(("raw", "value"), [("0", 0), ("42", 42), (5, 5)])
def test_parse_whole_accepts_zero_and_up_where_the_range_starts_there(raw: Any, value: int) -> None:
    assert parse_whole("seed", SEEDS)(raw) == value


@pytest.mark.parametrize("raw", ["-1", "x", False, 1.5, 2**63])
def test_parse_whole_rejects_what_is_outside_a_range_from_zero(raw: Any) -> None:
    with pytest.raises(UsageError) as caught:
        parse_whole("seed", SEEDS)(raw)
    assert caught.value.message == \
        f"seed must be a whole number in [0, 9223372036854775807], got {raw!r}"


@pytest.mark.parametrize(
    ("raw", "factors"),
    [("1,2.5", (1.0, 2.5)), (" 1 , 3 ", (1.0, 3.0)), ("1000", (1000.0,)), ([1, 2.5], (1.0, 2.5))],
)
def test_parse_slowdown_reads_one_factor_per_worker(raw: Any, factors: tuple[float, ...]) -> None:
    assert parse_slowdown(raw) == factors


@pytest.mark.parametrize("raw", ["", "1,,2", "1,0", "-1", "fast", "nan", "1,inf", [], 2, "0.5",
                                 "1,1001", [1, True]])
def test_parse_slowdown_rejects_malformed_factors(raw: Any) -> None:
    with pytest.raises(UsageError) as caught:
        parse_slowdown(raw)
    assert caught.value.message == \
        f"simulate_slowdown must be one factor in [1, 1000] per worker, got {raw!r}"
    assert caught.value.hint and "1,2.5" in caught.value.hint


@pytest.mark.parametrize(
    ("raw", "value"), [("auto", "auto"), ("GPU", "gpu"), ("cpu", "cpu"), ("4", 4), (2, 2)]
)
def test_parse_nproc_accepts_counts_and_keywords(raw: Any, value: int | str) -> None:
    assert parse_nproc(raw) == value


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("0", "nproc_per_node must be a whole number in [1, 1024], got '0'"),
        ("-3", "nproc_per_node must be a whole number in [1, 1024], got '-3'"),
        ("1025", "nproc_per_node must be a whole number in [1, 1024], got '1025'"),
        ("many", "nproc_per_node must be a whole number in [1, 1024], 'auto', 'gpu' or 'cpu', "
                 "got 'many'"),
        ("2.5", "nproc_per_node must be a whole number in [1, 1024], 'auto', 'gpu' or 'cpu', "
                "got '2.5'"),
    ],
)
def test_parse_nproc_rejects_the_rest(raw: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_nproc(raw)
    assert caught.value.message == message


def test_parse_run_dir_accepts_paths_and_rejects_other_types() -> None:
    assert BY_NAME["run_dir"].parse("runs/a") == "runs/a"
    assert BY_NAME["run_dir"].parse(Path("runs/b")) == "runs/b"
    for bad in (5, ["runs"], ""):
        with pytest.raises(UsageError, match="run_dir must be a non-empty path"):
            BY_NAME["run_dir"].parse(bad)


def test_every_setting_has_its_own_fdl_variable() -> None:
    assert BY_NAME["simulate_slowdown"].env == "FDL_SLOWDOWN"
    assert BY_NAME["nproc_per_node"].env == "FDL_NPROC_PER_NODE"
    names = [spec.env for spec in SETTINGS]
    assert len(set(names)) == len(names)
    assert all(name.startswith("FDL_") for name in names)


# --- config files ----------------------------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_no_config_file_gives_nothing(tmp_path: Path) -> None:
    assert load_config_file(tmp_path) == ({}, None)


def test_fdl_toml_top_level_keys_are_parsed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "fdl.toml",
        'policy = "Cadence"\nepochs = 3\nsimulate_slowdown = [1, 2.5]\nnproc_per_node = "cpu"\n',
    )
    values, found = load_config_file(tmp_path)
    assert found == path
    assert values == {
        "policy": "cadence",
        "epochs": 3,
        "simulate_slowdown": (1.0, 2.5),
        "nproc_per_node": "cpu",
    }


def test_a_byte_order_mark_an_editor_wrote_is_read_past(tmp_path: Path) -> None:
    """Notepad's UTF-8 with BOM gave "Invalid statement (at line 1, column 1)"."""
    path = tmp_path / "fdl.toml"
    path.write_bytes(b"\xef\xbb\xbfpolicy = \"async\"\nepochs = 2\n")
    assert load_config_file(tmp_path) == ({"policy": "async", "epochs": 2}, path)


def test_pyproject_tool_fdl_table_is_read(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pyproject.toml",
        '[project]\nname = "x"\n\n[tool.fdl]\nbackend = "nccl"\nseed = 0\n',
    )
    assert load_config_file(tmp_path) == ({"backend": "nccl", "seed": 0}, path)


def test_pyproject_without_tool_fdl_gives_nothing(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", '[project]\nname = "x"\n\n[tool.ruff]\nline-length = 100\n')
    assert load_config_file(tmp_path) == ({}, None)


def test_fdl_toml_wins_over_pyproject(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", '[tool.fdl]\npolicy = "async"\nepochs = 9\n')
    path = write(tmp_path, "fdl.toml", 'policy = "sync"\n')
    assert load_config_file(tmp_path) == ({"policy": "sync"}, path)


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("fdl.toml", "epochs = 2\nepoch = 3\n", "'epoch'"),
        ("pyproject.toml", "[tool.fdl]\nbatchsize = 8\n", "'tool.fdl.batchsize'"),
    ],
)
def test_unknown_key_is_a_config_error_naming_file_and_key(
    tmp_path: Path, name: str, text: str, key: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.message == f"unknown key {key} in {path}"
    assert caught.value.exit_code == 2
    assert caught.value.hint and "batch_size" in caught.value.hint and "epochs" in caught.value.hint


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("fdl.toml", 'epochs = "many"\n', "epochs must be a whole number in [1, 1000000], "
                                          "got 'many'"),
        ("fdl.toml", "run_dir = 5\n", "run_dir must be a non-empty path, got 5"),
        (
            "pyproject.toml",
            "[tool.fdl]\nseed = -1\n",
            "tool.fdl.seed must be a whole number in [0, 9223372036854775807]",
        ),
        (
            "pyproject.toml",
            '[tool.fdl]\npolicy = "fast"\n',
            "tool.fdl.policy: unknown policy 'fast'",
        ),
    ],
)
def test_wrong_value_is_a_config_error_naming_file_and_key(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.message.startswith(f"{path}: {message}")
    assert caught.value.exit_code == 2


def test_wrong_value_keeps_the_parsers_hint(tmp_path: Path) -> None:
    write(tmp_path, "fdl.toml", 'backend = "mpi"\n')
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.hint == "use one of: auto, nccl, cpu"


@pytest.mark.parametrize("name", ["fdl.toml", "pyproject.toml"])
def test_invalid_toml_is_a_config_error_naming_the_file(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, name, "[tool.fdl\npolicy = \n")
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.message.startswith(f"cannot read {path}: ")
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tool = 'x'\n", "tool must be a table, got 'x'"),
        ("[tool]\nfdl = 3\n", "tool.fdl must be a table, got 3"),
        ("[tool]\nfdl = [1]\n", "tool.fdl must be a table, got [1]"),
    ],
)
def test_pyproject_tool_tables_of_the_wrong_type_are_config_errors(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, "pyproject.toml", text)
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.message == f"{path}: {message}"
    assert caught.value.hint and caught.value.exit_code == 2


@pytest.mark.parametrize("name", ["fdl.toml", "pyproject.toml"])
def test_config_file_that_is_not_a_file_is_a_config_error(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError) as caught:
        load_config_file(tmp_path)
    assert caught.value.message == f"{tmp_path / name} is not a file"


def test_dangling_fdl_toml_link_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "fdl.toml").symlink_to(tmp_path / "gone.toml")
    with pytest.raises(ConfigError, match="is not a file"):
        load_config_file(tmp_path)


# --- precedence ------------------------------------------------------------------------------


def test_resolve_takes_flag_then_env_then_file_then_default(tmp_path: Path) -> None:
    file_path = tmp_path / "fdl.toml"
    settings = resolve_run_settings(
        flags={"policy": "async", "backend": None},
        env={"FDL_POLICY": "cadence", "FDL_BACKEND": "cpu", "FDL_EPOCHS": "4"},
        file_values={"policy": "sync", "backend": "nccl", "epochs": 2, "seed": 7},
        file_path=file_path,
    )
    assert set(settings) == {spec.name for spec in SETTINGS}
    assert {key: settings[key] for key in ("policy", "backend", "epochs", "seed",
                                            "simulate_slowdown")} == {
        "policy": Setting("async", "flag"),
        "backend": Setting("cpu", "env"),
        "epochs": Setting(4, "env"),
        "seed": Setting(7, f"file:{file_path}"),
        "simulate_slowdown": Setting(None, "default"),
    }


def test_resolve_parses_flags_and_ignores_empty_env_values() -> None:
    settings = resolve_run_settings(
        flags={"simulate_slowdown": "1,2.5", "epochs": "3"},
        env={"FDL_SEED": "", "FDL_SLOWDOWN": "9"},
        file_values={},
        file_path=None,
    )
    assert settings["simulate_slowdown"] == Setting((1.0, 2.5), "flag")
    assert settings["epochs"] == Setting(3, "flag")
    assert settings["seed"] == Setting(42, "default")


def test_resolve_ignores_a_flag_value_for_an_env_only_setting() -> None:
    settings = resolve_run_settings(flags={"overhead_target": "0.2"}, env={}, file_values={},
                                    file_path=None)
    assert settings["overhead_target"] == Setting(BY_NAME["overhead_target"].default, "default")
    assert BY_NAME["overhead_target"].default != 0.2


def test_bad_flag_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^--epochs: epochs must be a whole number in \[1, "):
        resolve_run_settings(flags={"epochs": "0"}, env={}, file_values={}, file_path=None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FDL_POLICY": "fast"}, "FDL_POLICY: unknown policy 'fast'"),
        ({"FDL_EPOCHS": "zero"},
         "FDL_EPOCHS: epochs must be a whole number in [1, 1000000], got 'zero'"),
        ({"FDL_SLOWDOWN": "1;2"},
         "FDL_SLOWDOWN: simulate_slowdown must be one factor in [1, 1000] per worker, got '1;2'"),
    ],
)
def test_bad_env_value_is_a_config_error_naming_the_variable(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_run_settings(flags={}, env=env, file_values={}, file_path=None)
    assert caught.value.message == message
    assert caught.value.exit_code == 2


def test_bad_env_value_is_not_read_when_a_flag_wins() -> None:
    settings = resolve_run_settings(
        flags={"policy": "sync"},
        env={"FDL_POLICY": "fast"},
        file_values={},
        file_path=None,
    )
    assert settings["policy"] == Setting("sync", "flag")


# --- engine settings in the worker environment -------------------------------------------------


def test_engine_env_passes_only_non_default_engine_settings() -> None:
    settings = {
        "policy": Setting("cadence", "flag"),
        "backend": Setting("auto", "default"),
        "epochs": Setting(3, "file:/p/fdl.toml"),
        "seed": Setting(0, "env"),
        "simulate_slowdown": Setting((1.0, 2.5), "flag"),
        "run_dir": Setting("runs/x", "flag"),  # not an engine key: the launcher's business
        "nproc_per_node": Setting(2, "flag"),
    }
    env = engine_env(settings)
    assert {k: v for k, v in env.items() if k != SOURCES_ENV} == {
        "FDL_POLICY": "cadence",
        "FDL_EPOCHS": "3",
        "FDL_SEED": "0",
        "FDL_SLOWDOWN": "1,2.5",
    }
    assert json.loads(env[SOURCES_ENV]) == {
        "policy": "flag",
        "backend": "default",
        "epochs": "file:/p/fdl.toml",
        "seed": "env",
        "simulate_slowdown": "flag",
    }


def test_engine_env_round_trips_through_the_parsers() -> None:
    settings = {
        "simulate_slowdown": Setting((1.0, 2.5, 1.75), "env"),
        "batch_size": Setting(64, "flag"),
    }
    env = engine_env(settings)
    assert env["FDL_SLOWDOWN"] == "1,2.5,1.75"
    assert BY_NAME["simulate_slowdown"].parse(env["FDL_SLOWDOWN"]) == (1.0, 2.5, 1.75)
    assert BY_NAME["batch_size"].parse(env["FDL_BATCH_SIZE"]) == 64


def test_engine_env_with_only_defaults_carries_just_the_sources() -> None:
    env = engine_env({"policy": Setting("sync", "default")})
    assert env == {SOURCES_ENV: json.dumps({"policy": "default"})}
