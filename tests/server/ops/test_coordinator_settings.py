"""Coordinator settings: defaults, the four sources in order, parsing, and clear errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.settings import (
    CoordinatorSettings,
    default_data_dir,
    env_var,
    load_settings,
    parse_duration,
    parse_size,
    setting_docs,
    setting_names,
    split_address,
)


def test_defaults_put_everything_under_one_data_dir(tmp_path: Path) -> None:
    settings = CoordinatorSettings(data_dir=tmp_path)
    assert settings.db_url == f"sqlite+aiosqlite:///{tmp_path}/fedlink.db"
    assert settings.blob_dir == tmp_path / "blobs"
    assert settings.join_secret_file.parent == tmp_path
    assert settings.admin_token_file.parent == tmp_path
    assert settings.tls_dir.parent == tmp_path
    assert settings.auto_migrate is True
    assert settings.insecure is False
    assert settings.open_enrolment is False
    assert settings.lease == timedelta(minutes=5)
    assert settings.max_message_bytes == 64 * 1024 * 1024


def test_postgres_is_not_migrated_automatically_unless_asked() -> None:
    url = "postgresql+asyncpg://u@db/fedlink"
    assert CoordinatorSettings(db_url=url).auto_migrate is False
    assert CoordinatorSettings(db_url=url, auto_migrate=True).auto_migrate is True


def test_default_data_dir_follows_xdg_then_home() -> None:
    assert default_data_dir({"XDG_DATA_HOME": "/xdg", "HOME": "/h"}) == Path("/xdg/fedlink")
    assert default_data_dir({"XDG_DATA_HOME": "relative", "HOME": "/h"}) == Path("/h/.local/share/fedlink")
    assert default_data_dir({"HOME": "/h"}) == Path("/h/.local/share/fedlink")


def test_every_setting_has_a_docstring() -> None:
    docs = setting_docs()
    assert set(docs) == set(setting_names())
    assert all(len(text) > 10 for text in docs.values())
    assert env_var("db_url") == "FEDLINK_DB_URL"


def test_secrets_and_db_passwords_stay_out_of_repr() -> None:
    settings = CoordinatorSettings(
        db_url="postgresql+asyncpg://fl:hunter2@db:5432/fedlink", admin_token="adm-xyz", join_secret="js-xyz"
    )
    text = repr(settings)
    assert "hunter2" not in text and "adm-xyz" not in text and "js-xyz" not in text
    assert settings.redacted_db_url == "postgresql+asyncpg://fl:***@db:5432/fedlink"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250ms", timedelta(milliseconds=250)),
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("1h", timedelta(hours=1)),
        ("1h30m", timedelta(minutes=90)),
        ("2d", timedelta(days=2)),
        ("1.5s", timedelta(seconds=1.5)),
        ("12", timedelta(seconds=12)),
        (7, timedelta(seconds=7)),
        (0.25, timedelta(milliseconds=250)),
    ],
)
def test_parse_duration(text: object, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "5 minutes", "m5", "-3s", "1x", True, float("inf"), -1, "5m 3s"])
def test_bad_durations_are_refused(text: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MiB", 64 * 2**20),
        ("2MB", 2_000_000),
        ("512KiB", 512 * 1024),
        ("1GiB", 2**30),
        ("1.5KiB", 1536),
        ("10b", 10),
        ("4096", 4096),
        (123, 123),
        ("64mib", 64 * 2**20),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1", "1.3b", "5 parsecs", False, 1.5])
def test_bad_sizes_are_refused(text: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(text)


def test_split_address() -> None:
    assert split_address("127.0.0.1:8443") == ("127.0.0.1", 8443)
    assert split_address("[::1]:0") == ("::1", 0)
    for bad in ("8443", "host:", ":80", "host:99999", "host:http"):
        with pytest.raises(InvalidArgument, match="host:port"):
            split_address(bad)


def test_sources_apply_in_order(tmp_path: Path) -> None:
    config = tmp_path / "fedlink.toml"
    config.write_text(
        "[serve]\n"
        'lease = "1m"\n'
        'listen_address = "0.0.0.0:9000"\n'
        'max_message_bytes = "32MiB"\n'
        "keep_checkpoints = 5\n"
        'data_dir = "state"\n'
        "[job]\n"
        'name = "belongs to another command"\n'
    )
    environ = {
        "FEDLINK_LEASE": "2m",
        "FEDLINK_LISTEN_ADDRESS": "0.0.0.0:9001",
        "FEDLINK_OPEN_ENROLMENT": "yes",
        "FEDLINK_TEST_PG_URL": "not a setting, left alone",
    }
    settings = load_settings(
        config_file=config, environ=environ, overrides={"lease": "3m", "listen_address": None}
    )
    assert settings.lease == timedelta(minutes=3)  # flag beats environment beats file
    assert settings.listen_address == "0.0.0.0:9001"  # None means the flag was not given
    assert settings.open_enrolment is True
    assert settings.max_message_bytes == 32 * 2**20  # from the file only
    assert settings.keep_checkpoints == 5
    assert settings.data_dir == tmp_path / "state"  # relative to the file, not the working directory
    assert settings.blob_dir == tmp_path / "state" / "blobs"


def test_top_level_keys_work_without_a_serve_table(tmp_path: Path) -> None:
    config = tmp_path / "fedlink.toml"
    config.write_text('log_format = "json"\nmetrics_address = "127.0.0.1:9464"\ntls_hostnames = ["a", "b"]\n')
    settings = load_settings(config_file=config, environ={"HOME": str(tmp_path)}, overrides={})
    assert settings.log_format == "json"
    assert settings.metrics_address == "127.0.0.1:9464"
    assert settings.tls_hostnames == ("a", "b")
    assert settings.data_dir == tmp_path / ".local" / "share" / "fedlink"


def test_environment_values_are_parsed() -> None:
    settings = load_settings(
        config_file=None,
        environ={
            "FEDLINK_DATA_DIR": "/srv/fedlink",
            "FEDLINK_DB_URL": "postgresql+asyncpg://u@h/db",
            "FEDLINK_INLINE_PAYLOAD_BYTES": "1MiB",
            "FEDLINK_DEFAULT_TASK_WAIT": "5s",
            "FEDLINK_TLS_HOSTNAMES": "coord.example, 10.0.0.5",
            "FEDLINK_METRICS_ADDRESS": "",
            "FEDLINK_LOG_LEVEL": "debug",
            "FEDLINK_LOOP": "asyncio",
        },
        overrides={},
    )
    assert settings.data_dir == Path("/srv/fedlink")
    assert settings.db_url == "postgresql+asyncpg://u@h/db"
    assert settings.inline_payload_bytes == 2**20
    assert settings.default_task_wait == timedelta(seconds=5)
    assert settings.tls_hostnames == ("coord.example", "10.0.0.5")
    assert settings.metrics_address is None  # empty means unset
    assert settings.log_level == "DEBUG"
    assert settings.loop == "asyncio"


def test_unknown_key_in_the_file_names_key_and_file(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[serve]\nleese = '5m'\n")
    with pytest.raises(InvalidArgument, match=r"bad\.toml.*unknown setting 'leese'"):
        load_settings(config_file=config, environ={}, overrides={})


def test_loose_keys_beside_a_serve_table_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("lease = '5m'\n[serve]\ninsecure = true\n")
    with pytest.raises(InvalidArgument, match=r"lease must go under \[serve\]"):
        load_settings(config_file=config, environ={}, overrides={})


def test_bad_values_name_key_and_source(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[serve]\nlease = 'soon'\n")
    with pytest.raises(InvalidArgument, match=r"bad\.toml \[serve\]: lease: not a duration"):
        load_settings(config_file=config, environ={}, overrides={})
    with pytest.raises(InvalidArgument, match=r"FEDLINK_INSECURE: insecure: not a boolean"):
        load_settings(config_file=None, environ={"FEDLINK_INSECURE": "maybe"}, overrides={})
    with pytest.raises(InvalidArgument, match=r"--max-message-bytes: max_message_bytes: not a size"):
        load_settings(config_file=None, environ={}, overrides={"max_message_bytes": "big"})
    with pytest.raises(InvalidArgument, match=r"--log-format: log_format: must be one of console, json"):
        load_settings(config_file=None, environ={}, overrides={"log_format": "xml"})
    with pytest.raises(InvalidArgument, match="unknown setting 'colour'"):
        load_settings(config_file=None, environ={}, overrides={"colour": "blue"})


def test_broken_or_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_settings(config_file=tmp_path / "missing.toml", environ={}, overrides={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[serve\n")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load_settings(config_file=broken, environ={}, overrides={})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls_cert": Path("c.pem")}, "tls_cert and tls_key go together"),
        ({"insecure": True, "tls_cert": Path("c"), "tls_key": Path("k")}, "insecure cannot be combined"),
        ({"default_task_wait": timedelta(seconds=40)}, "must not exceed max_task_wait"),
        ({"inline_payload_bytes": 128 * 2**20}, "at most max_message_bytes"),
        ({"listen_address": "nowhere"}, "listen_address must be host:port"),
        ({"log_level": "LOUD"}, "log_level must be"),
        ({"reaper_interval": timedelta(0)}, "reaper_interval must be positive"),
        ({"lease": timedelta(seconds=-1)}, "lease must not be negative"),
    ],
)
def test_inconsistent_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        CoordinatorSettings(**fields)  # type: ignore[arg-type]


def test_load_settings_reports_inconsistencies_too() -> None:
    with pytest.raises(InvalidArgument, match="invalid settings: tls_cert and tls_key go together"):
        load_settings(config_file=None, environ={"FEDLINK_TLS_KEY": "/k.pem"}, overrides={})


def test_enrolment_and_liveness_settings_come_from_flags_env_and_files(tmp_path: Path) -> None:
    config = tmp_path / "fedlink.toml"
    config.write_text('[serve]\nmax_devices = 500\nenrolment_replay_window = "2m"\n')
    settings = load_settings(
        config_file=config,
        environ={"FEDLINK_DATA_DIR": str(tmp_path), "FEDLINK_ENROLMENTS_PER_MINUTE": "0"},
        overrides={"require_approval": True, "device_offline_after": "1m", "job_retry_after": "2s"},
    )
    assert settings.max_devices == 500 and settings.enrolment_replay_window == timedelta(minutes=2)
    assert settings.enrolments_per_minute == 0 and settings.require_approval is True
    assert settings.online_window == timedelta(minutes=1) and settings.job_retry_after == timedelta(seconds=2)
    assert CoordinatorSettings(data_dir=tmp_path).max_devices is None  # no cap unless asked
    for bad, says in (
        ({"max_devices": "0"}, "max_devices must be at least 1"),
        ({"enrolment_burst": "0"}, "enrolment_burst must be at least 1"),
        ({"enrolments_per_minute": "-1"}, "enrolments_per_minute must not be negative"),
        ({"device_offline_after": "5s"}, r"at least max_task_wait \+ job_retry_after \(0:00:35\)"),
    ):
        with pytest.raises(InvalidArgument, match=says):
            load_settings(environ={"FEDLINK_DATA_DIR": str(tmp_path)}, overrides=bad)
