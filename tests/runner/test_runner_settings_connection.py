"""The runner's connection and log settings: ``connect_timeout`` and ``log_format``, from every source."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.runner.settings import load_runner_settings

SERVER = {"FEDLINK_SERVER": "coordinator:8443"}


def test_the_defaults_give_up_after_five_minutes_and_log_for_people() -> None:
    settings = load_runner_settings(environ=SERVER)
    assert settings.connect_timeout == timedelta(minutes=5)
    assert settings.log_format == "console"


def test_connect_timeout_and_log_format_come_from_toml_environment_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "runner.toml"
    config.write_text('[runner]\nconnect_timeout = "90s"\nlog_format = "json"\n')
    assert load_runner_settings(config, environ=SERVER).connect_timeout == timedelta(seconds=90)
    env = {**SERVER, "FEDLINK_CONNECT_TIMEOUT": "0", "FEDLINK_LOG_FORMAT": "JSON"}
    from_env = load_runner_settings(config, environ=env)
    assert (from_env.connect_timeout, from_env.log_format) == (timedelta(0), "json")  # 0: for ever
    flags = {"connect_timeout": "2m", "log_format": "console"}
    from_flags = load_runner_settings(config, environ=env, flags=flags)
    assert (from_flags.connect_timeout, from_flags.log_format) == (timedelta(minutes=2), "console")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"log_format": "xml"}, "log_format must be console or json, not 'xml'"),
        ({"connect_timeout": "soon"}, "--connect-timeout: bad value for connect_timeout: not a duration"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting(flags: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_runner_settings(environ=SERVER, flags=flags)
