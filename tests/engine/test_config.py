"""resolve_config: FDL_* > the script's value > the default, each value with its source."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fdl.engine.config import resolve_config
from fdl.errors import UsageError
from fdl.settings import ENGINE_DEFAULTS as DEFAULTS

DIVERGENCE_THRESHOLD = DEFAULTS["divergence_threshold"]


def test_nothing_given_is_every_default():
    config = resolve_config(script={}, env={})
    assert (config.policy.name, config.backend, config.epochs, config.batch_size, config.seed,
            config.simulate_slowdown) == ("cadence", "auto", 5, 64, 42, None)
    assert config.sources == dict.fromkeys(DEFAULTS, "default")
    assert config.max_grad_norm is None
    assert config.run_dir is None
    assert config.divergence_threshold == DIVERGENCE_THRESHOLD


def test_env_beats_script_beats_default():
    config = resolve_config(
        script={"policy": "async", "epochs": 3, "batch_size": 32},
        env={"FDL_POLICY": "sync", "FDL_SEED": "7", "FDL_SLOWDOWN": "1,2.5"})
    assert config.policy.name == "sync" and config.sources["policy"] == "env"  # env over script
    assert config.seed == 7 and config.sources["seed"] == "env"  # env over default
    assert config.simulate_slowdown == (1.0, 2.5) and config.sources["simulate_slowdown"] == "env"
    assert config.epochs == 3 and config.sources["epochs"] == "script"
    assert config.batch_size == 32 and config.sources["batch_size"] == "script"
    assert config.backend == "auto" and config.sources["backend"] == "default"


def test_script_values_are_parsed():
    config = resolve_config(script={"policy": " SYNC ", "checkpoint_every": "10M"}, env={})
    assert config.policy.name == "sync"
    assert config.checkpoint_every == "600s"
    assert config.sources["checkpoint_every"] == "script"


def test_the_slowdown_is_not_a_script_setting():
    """fdl.Trainer has no simulate_slowdown argument: only fdl run's sources set it."""
    config = resolve_config(script={"simulate_slowdown": [1, 2]}, env={})
    assert config.simulate_slowdown is None
    assert config.sources["simulate_slowdown"] == "default"


def test_an_empty_env_value_is_unset():
    config = resolve_config(script={"epochs": 2}, env={"FDL_EPOCHS": ""})
    assert config.epochs == 2 and config.sources["epochs"] == "script"


def test_fdl_sources_relabels_env_values():
    env = {"FDL_POLICY": "async", "FDL_EPOCHS": "9", "FDL_SEED": "1",
           "FDL_SOURCES": json.dumps({"policy": "flag", "epochs": "file:/proj/fdl.toml",
                                      "batch_size": "flag"})}
    config = resolve_config(script={}, env=env)
    assert config.sources["policy"] == "flag"
    assert config.sources["epochs"] == "file:/proj/fdl.toml"
    assert config.sources["seed"] == "env"  # not in FDL_SOURCES
    # a source for a key with no FDL_* value does not relabel the default
    assert config.sources["batch_size"] == "default"
    assert config.to_dict()["policy"] == {"value": "async", "source": "flag"}
    assert config.to_dict()["epochs"] == {"value": 9, "source": "file:/proj/fdl.toml"}


@pytest.mark.parametrize("sources", ["not json", "[1, 2]"])
def test_unreadable_fdl_sources_falls_back_to_env(sources):
    config = resolve_config(script={}, env={"FDL_POLICY": "sync", "FDL_SOURCES": sources})
    assert config.sources["policy"] == "env"


def test_a_script_value_equal_to_the_default_counts_as_default():
    config = resolve_config(script={"policy": "cadence", "epochs": 5, "batch_size": 64},
                            env={})
    assert config.sources == dict.fromkeys(DEFAULTS, "default")
    assert config.epochs == DEFAULTS["epochs"]


@pytest.mark.parametrize(("name", "value"), [
    ("FDL_POLICY", "turbo"),
    ("FDL_BACKEND", "tpu"),
    ("FDL_EPOCHS", "0"),
    ("FDL_BATCH_SIZE", "lots"),
    ("FDL_SEED", "-1"),
    ("FDL_SLOWDOWN", "1,fast"),
])
def test_a_bad_env_value_is_a_usage_error_naming_the_variable(name, value):
    with pytest.raises(UsageError) as caught:
        resolve_config(script={}, env={name: value})
    assert caught.value.message.startswith(f"{name}: ")
    assert repr(value) in caught.value.message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("script", "key"), [
    ({"policy": "turbo"}, "policy"),
    ({"batch_size": 0}, "batch_size"),
    ({"epochs": 0}, "epochs"),
    ({"checkpoint_every": "0"}, "checkpoint_every"),
])
def test_a_bad_script_value_is_a_usage_error_naming_the_argument(script, key):
    """Named once: run.batches(batch_size=0) read "batch_size: batch_size must be ..."."""
    with pytest.raises(UsageError) as caught:
        resolve_config(script=script, env={})
    message = caught.value.message
    assert message.startswith((f"{key}: ", f"{key} must")), message
    assert f"{key}: {key} " not in message, message


def test_a_bad_script_value_overridden_by_env_is_never_read():
    config = resolve_config(script={"policy": "turbo"}, env={"FDL_POLICY": "sync"})
    assert config.policy.name == "sync"


def test_unknown_policy_hint_lists_the_choices():
    with pytest.raises(UsageError) as caught:
        resolve_config(script={"policy": "turbo"}, env={})
    assert caught.value.hint == "use one of: sync, cadence, async, auto"


@pytest.mark.parametrize("max_grad_norm", [0, 0.0, -1.0, math.nan])
def test_max_grad_norm_must_be_positive(max_grad_norm):
    with pytest.raises(UsageError, match="max_grad_norm must be > 0"):
        resolve_config(script={}, env={}, max_grad_norm=max_grad_norm)


def test_a_positive_max_grad_norm_is_kept():
    assert resolve_config(script={}, env={}, max_grad_norm=1.5).max_grad_norm == 1.5


def test_fdl_run_dir_becomes_a_path():
    config = resolve_config(script={}, env={"FDL_RUN_DIR": "/tmp/runs/one"})
    assert config.run_dir == Path("/tmp/runs/one")
    assert resolve_config(script={}, env={"FDL_RUN_DIR": ""}).run_dir is None


def test_fdl_divergence_threshold_is_parsed():
    config = resolve_config(script={}, env={"FDL_DIVERGENCE_THRESHOLD": "0.25"})
    assert config.divergence_threshold == 0.25


def test_an_empty_fdl_divergence_threshold_is_unset_like_every_other_variable():
    config = resolve_config(script={}, env={"FDL_DIVERGENCE_THRESHOLD": ""})
    assert config.divergence_threshold == DIVERGENCE_THRESHOLD


def test_a_bad_fdl_divergence_threshold_is_a_usage_error_naming_the_variable():
    with pytest.raises(UsageError, match="FDL_DIVERGENCE_THRESHOLD"):
        resolve_config(script={}, env={"FDL_DIVERGENCE_THRESHOLD": "high"})


def test_reads_os_environ_when_no_env_is_given(monkeypatch):
    monkeypatch.setenv("FDL_POLICY", "async")
    config = resolve_config(script={})
    assert config.policy.name == "async" and config.sources["policy"] == "env"
