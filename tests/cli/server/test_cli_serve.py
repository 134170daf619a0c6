"""``fedlink serve``: its help, settings precedence, TLS by default, graceful SIGTERM/SIGINT, start errors.

The behaviour that belongs to the process (signals, exit codes, what it prints) is tested on the real
``fedlink`` console script in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.orphans import tied
from fedlink.server.settings import env_var, setting_names

from .conftest import Cli

#: How long to wait for a ``fedlink serve`` to start or stop: ~2 s on a quiet machine; far beyond that,
#: so that a loaded machine is no failure, and a hang still is one.
PROCESS_WAIT_S = 180.0


@dataclass
class ServeProcess:
    """A running ``fedlink serve`` and what it printed on start."""

    process: subprocess.Popen[str]
    address: str
    lines: list[str]
    stderr_path: Path

    def value(self, prefix: str) -> str:
        """The rest of the printed line that starts (after indentation) with ``prefix``."""
        return next(
            line.strip()[len(prefix) :].strip() for line in self.lines if line.strip().startswith(prefix)
        )

    def stop(self, sig: signal.Signals, timeout: float) -> tuple[int, str]:
        """Sends a signal and waits for the exit code and the rest of standard output."""
        self.process.send_signal(sig)
        out, _ = self.process.communicate(timeout=timeout)
        return self.process.returncode, out


class StartServe(Protocol):
    """Starts ``fedlink serve`` with these arguments and returns once it reported its address."""

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> ServeProcess: ...


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDLINK_")}
    env.update(extra)
    return env


@pytest.fixture
def serve(venv_bin: Path, tmp_path: Path) -> Iterator[StartServe]:
    """Starts ``fedlink serve`` processes and waits for their start report; kills leftovers at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServeProcess:
        stderr_path = tmp_path / f"serve-{len(started)}.log"
        with stderr_path.open("w") as stderr:
            process = subprocess.Popen(
                tied([str(venv_bin / "fedlink"), "serve", "--log-level", "warning", *args]),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env or _clean_env(),
            )
        started.append(process)
        assert process.stdout is not None
        lines: list[str] = []
        # The start report is printed at once, so reading it line by line blocks only while the process
        # starts; the deadline bounds the whole report.
        deadline = time.monotonic() + PROCESS_WAIT_S
        while not lines or not lines[-1].startswith("  database: "):  # the report's last line
            line = process.stdout.readline()
            if not line:
                process.wait(timeout=PROCESS_WAIT_S)
                pytest.fail(f"fedlink serve exited with {process.returncode}: {stderr_path.read_text()}")
            lines.append(line.rstrip("\n"))
            assert time.monotonic() < deadline, f"no whole start report in {PROCESS_WAIT_S:g} s: {lines}"
        address = lines[0].split(" listening on ", 1)[1].split()[0]
        return ServeProcess(process, address, lines, stderr_path)

    yield start
    for process in started:  # only the processes this fixture started, each by its own handle
        if process.poll() is None:
            process.kill()
            process.wait(timeout=PROCESS_WAIT_S)
        if process.stdout is not None:
            process.stdout.close()


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60).status)


def test_help_documents_every_setting_with_its_variable() -> None:
    result = Cli()("serve", "--help")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # help text wraps at the terminal's width
    for name in setting_names():
        assert re.search(rf"--{name.replace('_', '-')}[ ,/]", text), name
        assert f"[env: {env_var(name)}]" in text, name
    for flag in (
        "--db-url, --db URL",
        "--config FILE",
        "--log-format [console|json]",
        "--loop [auto|uvloop|asyncio]",
    ):
        assert flag in text
    assert "[default: 5m]" in text  # the lease's default, as a duration


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lease", "forever"], "option --lease: lease: not a duration"),
        (["--listen-address", "nowhere"], "listen_address must be host:port"),
        (["--log-format", "xml"], "'xml' is not one of 'console', 'json'"),
        (["--tls-cert", "cert.pem"], "tls_cert and tls_key go together"),
        (["--config", "missing.toml"], "missing.toml does not exist"),
    ],
)
def test_a_bad_setting_exits_2_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = Cli()("serve", "--data-dir", str(tmp_path), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "fedlink.db").exists()  # refused before anything started


def test_a_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    result = Cli()("serve", "--data-dir", str(tmp_path), env={"FEDLINK_MAX_MESSAGE_BYTES": "lots"})
    assert result.exit_code == 2
    assert "environment variable FEDLINK_MAX_MESSAGE_BYTES" in result.output


@pytest.mark.slow  # a whole coordinator process: ~2 s idle, ~6 s on a loaded machine
def test_serve_defaults_to_tls_and_stops_gracefully_on_sigterm(serve: StartServe, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = serve("--data-dir", str(data), "--listen-address", "127.0.0.1:0", "--shutdown-grace", "2s")
    assert "(TLS)" in server.lines[0]
    ca = Path(server.value("CA certificate for runners to trust:"))
    assert ca == data / "tls" / "ca.pem"
    assert server.value("admin token:").startswith(str(data / "admin-token"))
    assert server.value("join secret for runners:") == str(data / "join-secret")
    credentials = grpc.ssl_channel_credentials(ca.read_bytes())
    port = server.address.rsplit(":", 1)[1]
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.address) as plaintext, pytest.raises(grpc.RpcError):
        _health(plaintext)  # TLS only

    # The operator commands find the CA and the admin token in the data directory on their own.
    listed = Cli()(
        "job", "list", "--server", f"localhost:{port}", "--data-dir", str(data), "--format", "json"
    )
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout) == []

    started = time.monotonic()
    code, out = server.stop(signal.SIGTERM, timeout=PROCESS_WAIT_S)
    assert code == 0, server.stderr_path.read_text()
    # Nothing is in flight, so it need not wait out even the 2 s grace: under a second on a quiet
    # machine, seconds on a loaded one; not the 30 s of a shutdown that waits for something.
    assert time.monotonic() - started < 30
    assert "stopping" in out and out.rstrip().endswith("stopped")


@pytest.mark.slow  # a whole coordinator process: ~2 s idle, ~6 s on a loaded machine
def test_precedence_flags_over_environment_over_file_and_insecure_with_sigint(
    serve: StartServe, tmp_path: Path
) -> None:
    config = tmp_path / "fedlink.toml"
    config.write_text(
        '[serve]\ninsecure = true\nlisten_address = "file.invalid:1"\nopen_enrolment = false\n'
        'data_dir = "data"\n'
    )
    env = _clean_env(FEDLINK_LISTEN_ADDRESS="env.invalid:1", FEDLINK_OPEN_ENROLMENT="true")
    # The flag's address must win over the environment's, the environment's enrolment over the file's,
    # and the file's insecure and data_dir (relative to the file) must apply.
    server = serve("--config", str(config), "--listen-address", "127.0.0.1:0", "--loop", "asyncio", env=env)
    assert "(plaintext, no TLS (--insecure))" in server.lines[0]
    assert server.value("enrolment:") == "open, no join secret needed"
    assert server.value("admin token:").startswith(str(tmp_path / "data" / "admin-token"))
    with grpc.insecure_channel(server.address) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    code, _ = server.stop(signal.SIGINT, timeout=PROCESS_WAIT_S)
    assert code == 0, server.stderr_path.read_text()


@pytest.mark.slow  # a whole coordinator process: ~2 s idle, ~6 s on a loaded machine
def test_a_port_in_use_exits_1_with_a_clear_error(venv_bin: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run(
            tied(
                [
                    str(venv_bin / "fedlink"),
                    "serve",
                    "--data-dir",
                    str(tmp_path),
                    "--insecure",
                    "--listen-address",
                    address,
                ]
            ),
            capture_output=True,
            text=True,
            timeout=PROCESS_WAIT_S,
            env=_clean_env(),
            check=False,
        )
    assert result.returncode == 1, result.stderr
    assert f"error: cannot listen on {address}: the address is in use" in result.stderr
    assert "Traceback" not in result.stderr
