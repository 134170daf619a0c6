"""Secret files are created once, 0600 in a 0700 directory, and refused when others can read them."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from fedlink.common.errors import FailedPrecondition, NotFound
from fedlink.server.credentials import (
    constant_time_equals,
    ensure_secret_file,
    hash_credential,
    read_secret_file,
    resolve_admin_token,
    resolve_join_secret,
)
from fedlink.server.settings import CoordinatorSettings

posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@posix_only
def test_creates_a_private_token_once(tmp_path: Path) -> None:
    path = tmp_path / "new" / "admin-token"
    token = ensure_secret_file(path)
    assert len(token) >= 43  # 32 random bytes in url-safe base64
    assert token.replace("-", "").replace("_", "").isalnum()
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert ensure_secret_file(path) == token  # the same token on the next start
    assert read_secret_file(path) == token
    assert [p.name for p in path.parent.iterdir()] == ["admin-token"]  # no temporary file left behind


@posix_only
def test_mode_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "d" / "join-secret"
        ensure_secret_file(path)
    finally:
        os.umask(old)
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700


def test_distinct_files_get_distinct_tokens(tmp_path: Path) -> None:
    assert ensure_secret_file(tmp_path / "a") != ensure_secret_file(tmp_path / "b")


def test_concurrent_first_starts_agree_on_one_token(tmp_path: Path) -> None:
    path = tmp_path / "race" / "admin-token"
    results: list[str] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        results.append(ensure_secret_file(path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and len(set(results)) == 1


@posix_only
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "admin-token"
    path.write_text("secret-value\n")
    path.chmod(mode)
    with pytest.raises(FailedPrecondition, match=rf"accessible by others \(mode {mode:04o}\).*chmod 600"):
        ensure_secret_file(path)
    assert path.read_text() == "secret-value\n"  # left as it was, not replaced


@posix_only
def test_an_existing_private_file_is_read_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "join-secret"
    path.write_text("  chosen-by-operator \n")
    path.chmod(0o400)
    assert ensure_secret_file(path) == "chosen-by-operator"


def test_empty_file_and_symlink_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(FailedPrecondition, match="is empty"):
        ensure_secret_file(empty)
    target = tmp_path / "target"
    target.write_text("tok")
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(FailedPrecondition, match="cannot open"):
        read_secret_file(link)


def test_reading_a_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        read_secret_file(tmp_path / "nothing")


def test_hash_and_compare() -> None:
    digest = hash_credential("token")
    assert digest == "3c469e9d6c5875d37a43f353d4f88e61fcf812c66eee3457465a40b0da4153e0"
    assert hash_credential("token2") != digest
    assert constant_time_equals("abc", "abc")
    assert constant_time_equals(b"abc", "abc")
    assert not constant_time_equals("abc", "abd")
    assert not constant_time_equals("abc", "abcd")


def test_resolving_the_admin_token_and_join_secret(tmp_path: Path) -> None:
    generated = CoordinatorSettings(data_dir=tmp_path)
    admin = resolve_admin_token(generated)
    join = resolve_join_secret(generated)
    assert admin == generated.admin_token_file.read_text().strip()
    assert join == generated.join_secret_file.read_text().strip()
    assert admin != join

    given = CoordinatorSettings(data_dir=tmp_path / "other", admin_token="adm", join_secret="js")
    assert resolve_admin_token(given) == "adm"
    assert resolve_join_secret(given) == "js"
    assert not (tmp_path / "other").exists()  # given values write no files

    open_enrolment = CoordinatorSettings(data_dir=tmp_path / "open", open_enrolment=True)
    assert resolve_join_secret(open_enrolment) is None
    assert not open_enrolment.join_secret_file.exists()
