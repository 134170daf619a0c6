"""Secret files the operator names (``--join-secret-file``, ``--admin-token-file``, the runner's
``--join-secret-file``): both sides read them alike. Others may not read them; a group that may is
warned about, unless systemd passed the file ($CREDENTIALS_DIRECTORY); a mounted secret (a symlink)
is fine; what is wrong is InvalidArgument naming the file."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.runner.settings import read_secret_file as runner_reads
from fedlink.server.credentials import read_given_secret_file as coordinator_reads
from fedlink.server.credentials import resolve_admin_token, resolve_join_secret
from fedlink.server.settings import CoordinatorSettings

Reader = Callable[[Path], str]
readers = pytest.mark.parametrize("read", [coordinator_reads, runner_reads], ids=["coordinator", "runner"])


def secret(path: Path, value: str, mode: int) -> Path:
    path.write_text(value)
    path.chmod(mode)
    return path


@readers
def test_a_private_file_or_a_symlink_to_one_is_read_stripped(read: Reader, tmp_path: Path) -> None:
    target = secret(tmp_path / "token", "  tok-1 \n", 0o400)
    link = tmp_path / "mounted"
    link.symlink_to(target)
    assert read(target) == read(link) == "tok-1"


@readers
@pytest.mark.parametrize("mode", [0o604, 0o644, 0o606, 0o601])
def test_a_file_others_may_access_is_refused(read: Reader, tmp_path: Path, mode: int) -> None:
    path = secret(tmp_path / "token", "tok", mode)
    with pytest.raises(
        InvalidArgument, match=rf"secret file {path} is accessible by others \(mode {mode:04o}\)"
    ):
        read(path)


@readers
def test_a_group_readable_file_is_used_with_a_warning(
    read: Reader, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    path = secret(tmp_path / "token", "tok", 0o640)
    with caplog.at_level(logging.WARNING):
        assert read(path) == "tok"
    assert [r.getMessage() for r in caplog.records] == [
        f"secret file {path} is readable by its group (mode 0640); chmod 600 it"
    ]


@readers
def test_a_systemd_credential_is_used_without_a_warning(
    read: Reader, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # systemd's credentials are 0400 plus an ACL for the service's user: the mode shows the ACL's mask
    # in the group bits, which says nothing about the group.
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    path = secret(credentials / "join-secret", "tok", 0o440)
    with caplog.at_level(logging.WARNING):
        assert read(path) == "tok"
    assert caplog.records == []


@readers
def test_missing_empty_and_binary_files_are_refused_by_name(read: Reader, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=f"secret file {tmp_path / 'none'} does not exist"):
        read(tmp_path / "none")
    empty = secret(tmp_path / "empty", " \n", 0o600)
    with pytest.raises(InvalidArgument, match=f"secret file {empty} is empty"):
        read(empty)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe")
    binary.chmod(0o600)
    with pytest.raises(InvalidArgument, match=f"secret file {binary} is not text"):
        read(binary)
    with pytest.raises(InvalidArgument, match=f"secret file {tmp_path} is not a regular file"):
        read(tmp_path)


def test_the_coordinator_reads_named_files_and_generates_none(tmp_path: Path) -> None:
    join = secret(tmp_path / "join", "js-from-file\n", 0o600)
    admin = secret(tmp_path / "admin", "adm-from-file\n", 0o600)
    settings = CoordinatorSettings(data_dir=tmp_path / "data", join_secret_file=join, admin_token_file=admin)
    assert not settings.generates_join_secret and not settings.generates_admin_token
    assert resolve_join_secret(settings) == "js-from-file"
    assert resolve_admin_token(settings) == "adm-from-file"
    assert not (tmp_path / "data").exists()

    missing = CoordinatorSettings(data_dir=tmp_path / "data", admin_token_file=tmp_path / "gone")
    with pytest.raises(InvalidArgument, match=f"admin_token_file: secret file {tmp_path / 'gone'} does not"):
        resolve_admin_token(missing)
    assert not (tmp_path / "data").exists()  # a named file is never created


def test_a_secret_and_its_file_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="join_secret and join_secret_file exclude each other"):
        CoordinatorSettings(data_dir=tmp_path, join_secret="s", join_secret_file=tmp_path / "f")
    with pytest.raises(InvalidArgument, match="admin_token and admin_token_file exclude each other"):
        CoordinatorSettings(data_dir=tmp_path, admin_token="a", admin_token_file=tmp_path / "f")
    defaults = CoordinatorSettings(data_dir=tmp_path, join_secret="s")
    assert defaults.join_secret_file == tmp_path / "join-secret" and defaults.generates_join_secret
