"""`fedlink serve`'s files and secrets, on the real console scripts.

Everything the coordinator creates in its data and blob directories is owner-only (files 0600,
directories 0700) under the usual umask 022 and in directories that already exist with mode 0755; the
only exceptions are the public certificates runners are given. Secrets come from files named by
``--join-secret-file`` / ``--admin-token-file`` (the runner's ``--join-secret-file``, the operator
commands' ``--admin-token-file``), and a file that is missing, empty or readable by others is a usage
error (exit 2) naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2

from .conftest import Cli, dense

#: The umask most shells run with: what open() and SQLite turn into 0644 files and 0755 directories.
USUAL_UMASK = 0o022
#: Certificates handed to runners and clients: public by design.
PUBLIC_FILES = frozenset({"tls/ca.pem", "tls/server.pem"})
START_TIMEOUT_S = 60.0


@dataclass
class Serving:
    """A running ``fedlink serve`` and its start report."""

    process: subprocess.Popen[str]
    address: str
    lines: list[str]

    def value(self, prefix: str) -> str:
        """The rest of the start report's line that begins (after indentation) with ``prefix``."""
        return next(
            line.strip()[len(prefix) :].strip() for line in self.lines if line.strip().startswith(prefix)
        )

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=30)
        return self.process.returncode


StartServe = Callable[..., Serving]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FEDLINK_")}


def fedlink(venv_bin: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs a ``fedlink`` command to its end."""
    return subprocess.run(
        [str(venv_bin / "fedlink"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),
        umask=USUAL_UMASK,
        check=False,
    )


@pytest.fixture
def serve(venv_bin: Path) -> Iterator[StartServe]:
    """Starts ``fedlink serve`` under umask 022 and waits for its start report; kills leftovers."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> Serving:
        process = subprocess.Popen(
            [
                str(venv_bin / "fedlink"),
                "serve",
                "--listen-address",
                "127.0.0.1:0",
                "--log-level",
                "warning",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
            umask=USUAL_UMASK,
        )
        started.append(process)
        assert process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                pytest.fail(f"fedlink serve exited with {process.wait(timeout=10)}: {''.join(lines)}")
            lines.append(line.rstrip("\n"))
            if line.startswith("  database: "):  # the start report's last line
                return Serving(process, lines[0].split(" listening on ", 1)[1].split()[0], lines)
        pytest.fail("fedlink serve did not report its start in time")

    yield start
    for process in started:  # only the processes this fixture started, each by its own handle
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def model(floats: int) -> bytes:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    dxo.data["w"].CopyFrom(dense(np.arange(floats, dtype=np.float32)))
    return dxo.SerializeToString(deterministic=True)


def upload(stub: cgrpc.ControlServiceStub, token: str, data: bytes, *, send_bytes: int | None = None) -> None:
    """UploadModel of ``data``; with ``send_bytes``, the stream ends after that many (a partial upload)."""
    sha = hashlib.sha256(data).hexdigest()
    sent = data[: len(data) if send_bytes is None else send_bytes]

    def parts() -> Iterator[cpb.UploadModelRequest]:
        yield cpb.UploadModelRequest(header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data)))
        for start in range(0, len(sent), 256 * 1024):
            yield cpb.UploadModelRequest(chunk=sent[start : start + 256 * 1024])

    metadata = (("authorization", f"Bearer {token}"),)
    if send_bytes is None:
        stub.UploadModel(parts(), metadata=metadata, timeout=30)
    else:
        with pytest.raises(grpc.RpcError):  # the coordinator keeps what came, as a partial upload
            stub.UploadModel(parts(), metadata=metadata, timeout=30)


def fill_blobs(channel: grpc.Channel, token: str) -> None:
    """A model big enough to be a blob file, a small one (a row) and a partial upload (a file)."""
    stub = cgrpc.ControlServiceStub(channel)
    upload(stub, token, model(300_000))
    upload(stub, token, model(10))
    upload(stub, token, model(200_000), send_bytes=512 * 1024)


def modes(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root`` (not root itself): relative path -> (``dir`` or ``file``, mode bits)."""
    found = {}
    for path in root.rglob("*"):
        info = path.lstat()
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        found[path.relative_to(root).as_posix()] = (kind, stat.S_IMODE(info.st_mode))
    return found


def not_private(found: dict[str, tuple[str, int]]) -> dict[str, str]:
    expected = {"dir": 0o700, "file": 0o600}
    return {
        name: f"{kind} {mode:04o}"
        for name, (kind, mode) in found.items()
        if mode != expected[kind] and name not in PUBLIC_FILES
    }


def blob_files(found: dict[str, tuple[str, int]], under: str = "") -> tuple[list[str], list[str]]:
    objects = [n for n, (k, _) in found.items() if k == "file" and n.startswith(f"{under}objects/")]
    uploads = [n for n, (k, _) in found.items() if k == "file" and n.startswith(f"{under}uploads/")]
    return objects, uploads


@pytest.mark.slow  # a whole coordinator process
def test_everything_created_in_an_existing_0755_data_dir_is_owner_only(
    serve: StartServe, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    server = serve("--data-dir", str(data))  # TLS: its CA key and certificates are made there too
    port = server.address.rsplit(":", 1)[1]
    credentials = grpc.ssl_channel_credentials((data / "tls" / "ca.pem").read_bytes())
    token = (data / "admin-token").read_text().strip()
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        fill_blobs(channel, token)

    found = modes(data)  # while it runs: SQLite's -wal and -shm files exist only then
    for name in ("fedlink.db", "fedlink.db-wal", "fedlink.db-shm", "admin-token", "join-secret",
                 "coordinator-id", "coordinator.lock", "tls/ca.key", "tls/server.key", "blobs"):  # fmt: skip
        assert name in found, f"{name} was not created: the test would prove nothing about it"
    objects, uploads = blob_files(found, "blobs/")
    assert objects and uploads, found
    assert not_private(found) == {}
    assert stat.S_IMODE(data.stat().st_mode) == 0o755  # the operator's own directory is left as it was
    assert server.stop() == 0


@pytest.mark.slow  # a whole coordinator process
def test_everything_created_in_an_existing_0755_blob_dir_is_owner_only(
    serve: StartServe, tmp_path: Path
) -> None:
    blobs = tmp_path / "blob-store"
    blobs.mkdir(mode=0o755)
    blobs.chmod(0o755)
    data = tmp_path / "data"
    server = serve("--data-dir", str(data), "--blob-dir", str(blobs), "--insecure")
    with grpc.insecure_channel(server.address) as channel:
        fill_blobs(channel, (data / "admin-token").read_text().strip())

    found = modes(blobs)
    objects, uploads = blob_files(found)
    assert objects and uploads, found
    assert not_private(found) == {}
    assert not_private(modes(data)) == {}
    assert not (data / "blobs").exists()
    assert server.stop() == 0


def secret_file(path: Path, value: str, mode: int = 0o600) -> Path:
    path.write_text(value + "\n")
    path.chmod(mode)
    return path


@pytest.mark.slow  # a coordinator and two runner processes
def test_a_runner_enrols_with_secret_files_against_a_coordinator_given_them(
    serve: StartServe, venv_bin: Path, tmp_path: Path
) -> None:
    join = secret_file(tmp_path / "join-secret.txt", "join-from-a-file")
    admin = secret_file(tmp_path / "admin-token.txt", "admin-from-a-file")
    data = tmp_path / "data"
    server = serve(
        "--data-dir", str(data), "--insecure",
        "--join-secret-file", str(join), "--admin-token-file", str(admin),
    )  # fmt: skip
    assert server.value("join secret for runners:") == str(join)
    assert server.value("admin token:").startswith(
        f"{admin} (fedlink job/device: --admin-token-file {admin})"
    )
    assert not (data / "join-secret").exists() and not (data / "admin-token").exists()  # none generated
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert b"join-from-a-file" not in cmdline and b"admin-from-a-file" not in cmdline

    def runner(name: str, secret: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
        state = tmp_path / name
        done = fedlink(
            venv_bin, "runner", "--server", server.address, "--insecure", "--join-secret-file", str(secret),
            "--state-dir", str(state), "--job-timeout", "1s", "--task-wait", "1s",
        )  # fmt: skip
        return done, state / "identity.json"

    # The wrong secret, from a file, is refused: the file's content is what the runner sends.
    wrong, wrong_identity = runner("wrong", secret_file(tmp_path / "wrong.txt", "not-the-secret"))
    assert wrong.returncode == 1, wrong.stderr
    assert "Enroll" in wrong.stderr
    assert json.loads(wrong_identity.read_text())["device_id"] == ""

    enrolled, identity = runner("device", join)
    assert enrolled.returncode == 0, enrolled.stderr
    device_id = json.loads(identity.read_text())["device_id"]
    assert device_id

    # The operator commands read the admin token from the file too.
    listed = Cli()("device", "list", "--server", server.address, "--insecure", "--admin-token-file",
                   str(admin), "--format", "json")  # fmt: skip
    assert listed.exit_code == 0, listed.output
    assert [d["device_id"] for d in json.loads(listed.stdout)] == [device_id]
    assert server.stop() == 0


@pytest.mark.slow  # a coordinator process each (which must not get as far as starting)
@pytest.mark.parametrize(
    ("flag", "content", "mode", "message"),
    [
        ("--join-secret-file", None, 0o600, "does not exist"),
        ("--join-secret-file", "  ", 0o600, "is empty"),
        ("--admin-token-file", None, 0o600, "does not exist"),
        ("--admin-token-file", "", 0o600, "is empty"),
        ("--admin-token-file", "token", 0o644, "is accessible by others (mode 0644); run: chmod 600"),
    ],
)
def test_serve_refuses_an_unusable_secret_file_with_exit_2(
    venv_bin: Path, tmp_path: Path, flag: str, content: str | None, mode: int, message: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        secret_file(path, content, mode)
    data = tmp_path / "data"
    done = fedlink(
        venv_bin, "serve", "--data-dir", str(data), "--insecure", "--listen-address", "127.0.0.1:0",
        flag, str(path),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    setting = flag[2:].replace("-", "_")
    assert f"error: {setting}: secret file {path} {message}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (data / "fedlink.db").exists()  # refused before the store was opened


def test_serve_refuses_a_secret_and_its_file_together(tmp_path: Path) -> None:
    path = secret_file(tmp_path / "secret", "s")
    result = Cli()(
        "serve", "--data-dir", str(tmp_path), "--join-secret", "s", "--join-secret-file", str(path)
    )
    assert result.exit_code == 2, result.output
    assert "join_secret and join_secret_file exclude each other" in result.output


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (None, 0o600, "does not exist"),
        ("\n", 0o600, "is empty"),
        ("secret", 0o604, "is accessible by others (mode 0604)"),
    ],
)
def test_the_runner_refuses_an_unusable_join_secret_file_with_exit_2(
    tmp_path: Path, content: str | None, mode: int, message: str
) -> None:
    path = tmp_path / "join-secret"
    if content is not None:
        secret_file(path, content, mode)
    result = Cli()("runner", "--server", "127.0.0.1:1", "--insecure", "--state-dir", str(tmp_path / "state"),
                   "--join-secret-file", str(path))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"secret file {path} {message}" in result.output
    assert not (tmp_path / "state").exists()  # refused before the runner started


@pytest.mark.parametrize(("content", "message"), [(None, "does not exist"), ("", "is empty")])
def test_the_operator_commands_refuse_an_unusable_admin_token_file_with_exit_2(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "admin-token"
    if content is not None:
        secret_file(path, content)
    result = Cli()("job", "list", "--server", "127.0.0.1:1", "--insecure", "--admin-token-file", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --admin-token-file: secret file {path} {message}")
