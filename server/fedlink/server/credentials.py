"""Secret files (join secret, admin token) readable only by their owner, and credential hashing.

Tokens are 256-bit random url-safe strings. They are stored hashed with plain SHA-256: a slow password
hash (bcrypt, scrypt, argon2) exists to make guessing *low-entropy* human passwords expensive, but
nobody can enumerate 2**256 candidates whatever the hash costs, so a fast hash loses nothing — and it
keeps authenticating every device RPC cheap. Compare secrets with :func:`constant_time_equals` only.

None of these values may ever be logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.server.settings import CoordinatorSettings

log = logging.getLogger(__name__)

#: Bytes of randomness in a generated token (256 bits).
TOKEN_BYTES: Final = 32

# Files created here are 0600 and their new parent directories 0700, whatever the umask says.
_FILE_MODE: Final = 0o600
_DIR_MODE: Final = 0o700
_MAX_SECRET_FILE_BYTES: Final = 4096
_POSIX: Final = os.name == "posix"


def generate_token(nbytes: int = TOKEN_BYTES) -> str:
    """A fresh random url-safe token carrying ``nbytes`` bytes of randomness."""
    return secrets.token_urlsafe(nbytes)


def hash_credential(token: str) -> str:
    """The SHA-256 hex digest under which a credential is stored (see the module docstring for why)."""
    return hashlib.sha256(token.encode()).hexdigest()


def constant_time_equals(a: str | bytes, b: str | bytes) -> bool:
    """Compares two secrets in time independent of where they differ."""
    left = a.encode() if isinstance(a, str) else a
    right = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(left, right)


def read_secret_file(path: Path) -> str:
    """Reads a secret file, refusing one that others may read (as ssh does with private keys).

    Raises:
        NotFound: there is no such file.
        FailedPrecondition: the file is readable by group or others, owned by another user, not a
            regular file, or empty.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NotFound(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise FailedPrecondition(f"cannot open secret file {path}: {exc.strerror}") from None
    try:
        # Checked on the opened descriptor, so the file cannot be swapped between check and read.
        _check_private(path, os.fstat(fd))
        data = os.read(fd, _MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _token(path, data, "; delete it to generate a new one")


def read_given_secret_file(path: Path) -> str:
    """Reads a secret file the operator named (``--join-secret-file``, ``--admin-token-file``).

    Unlike the data directory's own files, it may be a symlink (a mounted secret) and belong to another
    user that granted read access (systemd's credentials are root's, shared by an ACL). It is refused if
    others may read it and used with a warning if its group may, unless systemd passed it
    (``$CREDENTIALS_DIRECTORY``, private to the service whatever its mode bits show).

    Raises:
        InvalidArgument: the file is missing, unreadable, accessible by others, empty or not a token;
            the message names it.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InvalidArgument(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"secret file {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if _POSIX and mode & 0o007:
            raise InvalidArgument(
                f"secret file {path} is accessible by others (mode {mode:04o}); run: chmod 600 {path}"
            )
        if _POSIX and mode & 0o070 and not _from_systemd(path):
            log.warning("secret file %s is readable by its group (mode %04o); chmod 600 it", path, mode)
        data = os.read(fd, _MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return _token(path, data, "")
    except FailedPrecondition as exc:
        raise InvalidArgument(exc.message) from None


def _from_systemd(path: Path) -> bool:
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")
    return bool(directory) and Path(path).resolve().parent == Path(directory).resolve()


def _token(path: Path, data: bytes, remedy: str) -> str:
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise FailedPrecondition(f"secret file {path} is too large to be a token")
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise FailedPrecondition(f"secret file {path} is not text{remedy}") from None
    if not token:
        raise FailedPrecondition(f"secret file {path} is empty{remedy}")
    return token


def _check_private(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise FailedPrecondition(f"secret file {path} is not a regular file")
    if not _POSIX:
        return  # Windows has no mode bits; its ACLs are the operator's business.
    if info.st_uid != os.getuid():
        raise FailedPrecondition(f"secret file {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        raise FailedPrecondition(
            f"secret file {path} is accessible by others (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"run: chmod 600 {path}"
        )


def ensure_secret_file(path: Path, *, nbytes: int = TOKEN_BYTES) -> str:
    """Returns the token in ``path``, creating the file with a new random token if it does not exist.

    The file is written under a temporary name (created with ``O_CREAT | O_EXCL``, mode 0600) and
    published with a hard link, which fails if the name exists: two processes starting at once agree on
    one token, and nobody ever reads a half-written file. A missing parent directory is created 0700.

    Raises:
        FailedPrecondition: an existing file is readable by others or otherwise unusable (see
            :func:`read_secret_file`), or the file cannot be created.
    """
    with contextlib.suppress(NotFound):
        return read_secret_file(path)
    path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    token = generate_token(nbytes)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temporary, flags, _FILE_MODE)
        try:
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        # If another process won the race, its token is the one.
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    except OSError as exc:
        raise FailedPrecondition(f"cannot create secret file {path}: {exc.strerror}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return read_secret_file(path)


def resolve_admin_token(settings: CoordinatorSettings) -> str:
    """The operator credential: ``settings.admin_token`` if given, else ``admin_token_file``.

    Raises:
        InvalidArgument: a file named in the settings cannot be used (see :func:`read_given_secret_file`).
        FailedPrecondition: the data directory's own file is unusable (see :func:`ensure_secret_file`).
    """
    if settings.admin_token:
        return settings.admin_token
    if settings.generates_admin_token:
        return ensure_secret_file(settings.admin_token_file)
    return _given(settings.admin_token_file, "admin_token_file")


def resolve_join_secret(settings: CoordinatorSettings) -> str | None:
    """The enrolment secret; ``None`` when enrolment is open (anyone may enrol).

    Without ``open_enrolment`` it is ``settings.join_secret`` if given, else ``join_secret_file``.

    Raises:
        InvalidArgument: a file named in the settings cannot be used (see :func:`read_given_secret_file`).
        FailedPrecondition: the data directory's own file is unusable (see :func:`ensure_secret_file`).
    """
    if settings.open_enrolment:
        return None
    if settings.join_secret:
        return settings.join_secret
    if settings.generates_join_secret:
        return ensure_secret_file(settings.join_secret_file)
    return _given(settings.join_secret_file, "join_secret_file")


def _given(path: Path, setting: str) -> str:
    try:
        return read_given_secret_file(path)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{setting}: {exc.message}") from None


__all__ = [
    "TOKEN_BYTES",
    "constant_time_equals",
    "ensure_secret_file",
    "generate_token",
    "hash_credential",
    "read_given_secret_file",
    "read_secret_file",
    "resolve_admin_token",
    "resolve_join_secret",
]
