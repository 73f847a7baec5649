"""`config.json` read back: which engine settings a run's script never read (the engine adds
its `engine` section as it starts; without one, nothing read what the launcher was given)."""

from __future__ import annotations

import pytest

from fdl.rundir.config import unread_engine_settings


def settings(**sources: str) -> dict:
    return {name: {"value": 1, "source": source} for name, source in sources.items()}


@pytest.mark.parametrize(("config", "unread"), [
    # the script never used the engine: what was given is named, in the settings' order;
    # defaults and launcher-only settings (nproc_per_node) are not the engine's to read
    ({"settings": settings(seed="env", policy="flag", epochs="file:/p/fdl.toml",
                           batch_size="default", nproc_per_node="flag")},
     [("policy", "flag"), ("epochs", "file:/p/fdl.toml"), ("seed", "env")]),
    # the engine ran: it read them all
    ({"settings": settings(policy="flag"), "engine": {}}, []),
    ({"settings": settings(policy="default")}, []),
    ({}, []),
])
def test_the_engine_settings_a_script_never_read(config, unread):
    assert unread_engine_settings(config) == unread


@pytest.mark.parametrize(("source", "shown"), [
    ("flag", "--checkpoint-every"), ("env", "FDL_CHECKPOINT_EVERY"),
    ("file:/p/pyproject.toml", "/p/pyproject.toml")])
def test_a_source_is_named_as_the_user_wrote_it(source, shown):
    from fdl.settings import BY_NAME

    assert BY_NAME["checkpoint_every"].source_name(source) == shown
