"""The ``fedlink`` group: version, help, and which server commands a given install offers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.orphans import tied
from fedlink.cli.extras import MISSING_EXTRA_EXIT_CODE, OPERATOR_COMMAND_NAMES, SERVER_COMMAND_NAMES
from fedlink.cli.main import build_cli
from fedlink.common.version import PROTOCOL_VERSION, __version__

VERSION_LINE = f"fedlink {__version__} (device protocol {PROTOCOL_VERSION})"


def run(*args: str, server_extra: bool) -> tuple[int, str]:
    """Invokes a freshly built group in-process; returns the exit code and everything it printed."""
    result = CliRunner().invoke(build_cli(server_extra=server_extra), list(args), prog_name="fedlink")
    return result.exit_code, result.output


def listed_commands(help_text: str) -> set[str]:
    """The command names in the ``Commands:`` section of a help page."""
    section = help_text.split("Commands:", 1)[1] if "Commands:" in help_text else ""
    return {line.split()[0] for line in section.splitlines() if line.strip()}


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_package_and_protocol(flag: str) -> None:
    code, output = run(flag, server_extra=False)
    assert code == 0
    assert output.strip() == VERSION_LINE


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_describes_the_group(flag: str) -> None:
    code, output = run(flag, server_extra=True)
    assert code == 0
    assert output.startswith("Usage: fedlink [OPTIONS] COMMAND [ARGS]...")
    assert "--version" in output


def test_runner_only_install_lists_server_commands_as_needing_the_extra() -> None:
    code, output = run("--help", server_extra=False)
    assert code == 0
    assert listed_commands(output) == {*SERVER_COMMAND_NAMES, *OPERATOR_COMMAND_NAMES, "runner"}
    assert "fedlink[server]" in output


@pytest.mark.parametrize(
    "args",
    [("serve",), ("db", "upgrade", "--url", "sqlite:///x.db"), ("simulate", "--help")],
)
def test_runner_only_install_explains_the_missing_extra(args: tuple[str, ...]) -> None:
    code, output = run(*args, server_extra=False)
    assert code == MISSING_EXTRA_EXIT_CODE == 2
    assert f"fedlink {args[0]} needs the server extra: pip install 'fedlink[server]'" in output


def test_server_install_lists_every_command() -> None:
    code, output = run("--help", server_extra=True)
    assert code == 0
    assert {"serve", "db", "job", "device", "simulate", "runner"} <= listed_commands(output)


def test_server_install_runs_the_db_group() -> None:
    code, output = run("db", "--help", server_extra=True)
    assert code == 0
    assert {"upgrade", "downgrade", "current"} <= listed_commands(output)


def test_console_script_prints_the_version(venv_bin: Path) -> None:
    result = subprocess.run(
        tied([str(venv_bin / "fedlink"), "--version"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == VERSION_LINE


def test_console_script_prints_help(venv_bin: Path) -> None:
    result = subprocess.run(
        tied([str(venv_bin / "fedlink"), "--help"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage: fedlink" in result.stdout


def test_version_imports_nothing_heavy() -> None:
    # A device's `fedlink --version` must start fast: no gRPC, numpy or SQLAlchemy behind it.
    probe = (
        "import sys\n"
        "from fedlink.cli.main import main\n"
        "sys.argv = ['fedlink', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('grpc', 'numpy', 'sqlalchemy', 'fedlink.server') if m in sys.modules))\n"
    )
    result = subprocess.run(
        tied([sys.executable, "-c", probe]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [VERSION_LINE, "[]"]
