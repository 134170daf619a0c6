"""The operator commands and ``fedlink runner`` with several coordinator addresses: an address that
refuses connections is passed over for the next; an error a coordinator answers (a wrong admin token)
is final; when no address answers, the error names each one and why. Real coordinators on
127.0.0.1:0, real ``fedlink runner`` processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from bench.orphans import tied

from .conftest import Cli, CoordinatorThread, plaintext_settings

#: The ``closed_ports`` fixture (tests/conftest.py): ``with closed_ports(n) as addresses``.
ClosedPorts = Callable[[int], AbstractContextManager[list[str]]]


FEDLINK = str(Path(sys.executable).parent / "fedlink")


def operator(coordinator: CoordinatorThread, server: str) -> Cli:
    """The CLI with ``FEDLINK_SERVER=server`` and ``coordinator``'s admin token."""
    return Cli(
        env={
            "FEDLINK_SERVER": server,
            "FEDLINK_INSECURE": "1",
            "FEDLINK_ADMIN_TOKEN": coordinator.admin_token,
            "FEDLINK_DATA_DIR": str(coordinator.settings.data_dir),
        }
    )


def test_a_dead_address_in_fedlink_server_is_passed_over(
    coordinator: CoordinatorThread, closed_ports: ClosedPorts
) -> None:
    with closed_ports(1) as [dead]:
        result = operator(coordinator, f"{dead},{coordinator.address}")("device", "list", "--format", "json")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "[]"


def test_when_no_address_answers_the_error_names_each(tmp_path: Path, closed_ports: ClosedPorts) -> None:
    with closed_ports(2) as dead:
        result = Cli()(
            "job", "list", "--server", ",".join(dead), "--insecure", "--admin-token", "x",
            "--data-dir", str(tmp_path),
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    first_line = result.stderr.splitlines()[0]
    assert first_line.startswith(
        f"error: UNAVAILABLE: no coordinator answered (tried {dead[0]}, {dead[1]}): "
    )
    for address in dead:
        assert f"{address}: connection refused: nothing listens there" in first_line, first_line


def test_an_error_the_coordinator_answers_is_final(tmp_path: Path) -> None:
    # Two coordinators with different admin tokens: the second's token, sent to the first, is refused
    # there; the command must say so rather than try the second, which would accept it.
    first_settings = plaintext_settings(tmp_path / "first")
    with (
        CoordinatorThread(first_settings) as first,
        CoordinatorThread(plaintext_settings(tmp_path / "second")) as second,
    ):
        assert first.admin_token != second.admin_token
        refused = operator(second, f"{first.address},{second.address}")("job", "list")
        assert refused.exit_code == 1, refused.output
        assert refused.stderr.startswith("error: UNAUTHENTICATED: "), refused.stderr
        accepted = operator(second, f"{second.address},{first.address}")("job", "list")
        assert accepted.exit_code == 0, accepted.output


def test_health_reports_the_address_that_answered(
    coordinator: CoordinatorThread, tmp_path: Path, closed_ports: ClosedPorts
) -> None:
    with closed_ports(2) as dead:
        live = Cli()(
            "health",
            "--server",
            f"{dead[0]},{coordinator.address}",
            "--insecure",
            "--data-dir",
            str(tmp_path),
        )
        none = Cli()("health", "--server", ",".join(dead), "--insecure", "--data-dir", str(tmp_path))
    assert live.exit_code == 0, live.output
    assert live.stdout.strip() == f"{coordinator.address}: SERVING"
    assert none.exit_code == 1, none.output
    assert none.stderr.startswith(f"{dead[0]},{dead[1]}: UNREACHABLE: no coordinator answered (tried "), (
        none.stderr
    )
    assert all(f"{address}: connection refused" in none.stderr for address in dead), none.stderr


@pytest.mark.parametrize(
    ("server", "complaint"),
    [
        ("127.0.0.1:1,127.0.0.1:1", "127.0.0.1:1 is listed twice"),
        ("localhost", "'localhost' is not host:port"),
    ],
)
def test_a_bad_list_is_a_usage_error(tmp_path: Path, server: str, complaint: str) -> None:
    result = Cli()(
        "job", "list", "--server", server, "--insecure", "--admin-token", "x", "--data-dir", str(tmp_path)
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(f"error: --server: {complaint}"), result.stderr


@pytest.mark.slow  # runner processes
def test_the_runner_process_names_every_address_when_none_answers(
    tmp_path: Path, closed_ports: ClosedPorts
) -> None:
    with closed_ports(2) as dead:
        args = [
            FEDLINK, "runner", "--server", ",".join(dead), "--insecure",
            "--state-dir", str(tmp_path / "state"), "--connect-timeout", "2s",
        ]  # fmt: skip
        done = subprocess.run(tied(args), capture_output=True, text=True, timeout=180, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert "runner stopped: Unavailable: Enroll: gave up after 2s without a connection" in last, last
    assert all(f"{address}: connection refused" in last for address in dead), last
    warnings = [line for line in output.splitlines() if " WARNING " in line]
    assert len(warnings) == 2, output  # once per address, however many rounds


@pytest.mark.slow  # a runner process
def test_the_runner_refuses_a_bad_list_with_exit_2(tmp_path: Path) -> None:
    args = [
        FEDLINK,
        "runner",
        "--server",
        "127.0.0.1:1,[::1",
        "--insecure",
        "--state-dir",
        str(tmp_path / "s"),
    ]
    done = subprocess.run(tied(args), capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--server: '[::1' is not host:port" in done.stderr, done.stderr
