"""The wheel: its layout, and a runner-only install of it (no extras) in a fresh venv."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.orphans import tied
from fedlink.common.version import PROTOCOL_VERSION, __version__
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings

pytestmark = pytest.mark.slow


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs a command outside the checkout, with no PYTHONPATH to leak the editable install in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        tied([str(a) for a in args]),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the checkout into a temporary folder."""
    dist = tmp_path_factory.mktemp("dist")
    # --no-isolation builds with this venv's hatchling (dev extra): no download, nothing left in the repo.
    result = run(
        sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, repo_root, cwd=dist
    )
    assert result.returncode == 0, f"wheel build failed:\n{result.stdout}{result.stderr}"
    (built,) = dist.glob("fedlink-*.whl")
    return built


@pytest.fixture(scope="module")
def runner_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed without extras, as on a device; returns its bin folder."""
    venv = tmp_path_factory.mktemp("runner-venv")
    created = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv)
    assert created.returncode == 0, created.stderr
    # This venv's pip installs into the new one (pip --python), which saves bootstrapping a second pip.
    installed = run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", wheel, cwd=venv
    )
    assert installed.returncode == 0, (
        f"pip install of the wheel failed:\n{installed.stdout}{installed.stderr}"
    )
    return venv / "bin"


def test_wheel_holds_the_three_namespace_roots_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert top == {"fedlink", f"fedlink-{__version__}.dist-info"}, f"unexpected top-level entries: {top}"
    for package in ("fedlink/server/", "fedlink/runner/", "fedlink/v1/", "fedlink/common/", "fedlink/cli/"):
        assert any(name.startswith(package) for name in names), f"{package} is missing from the wheel"
    # PEP 420: an __init__.py in fedlink/ would hide every other distribution's part of the namespace.
    assert "fedlink/__init__.py" not in names
    assert "fedlink/v1/py.typed" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_runner_install_prints_the_version(runner_venv: Path, tmp_path: Path) -> None:
    result = run(runner_venv / "fedlink", "--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fedlink {__version__} (device protocol {PROTOCOL_VERSION})"


def test_runner_install_imports_shared_code_and_wire_api(runner_venv: Path, tmp_path: Path) -> None:
    probe = "import fedlink.common.errors, fedlink.v1.runner_service_pb2 as m; print(m.__file__)"
    result = run(runner_venv / "python", "-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # Imported from the new venv, not from the checkout.
    assert Path(result.stdout.strip()).is_relative_to(runner_venv.parent)


def test_runner_install_has_no_sqlalchemy(runner_venv: Path, tmp_path: Path) -> None:
    probe = "import sqlalchemy"
    result = run(runner_venv / "python", "-c", probe, cwd=tmp_path)
    assert result.returncode == 1
    assert "ModuleNotFoundError: No module named 'sqlalchemy'" in result.stderr


def test_runner_install_explains_the_server_extra(runner_venv: Path, tmp_path: Path) -> None:
    result = run(runner_venv / "fedlink", "serve", cwd=tmp_path)
    assert result.returncode == 2
    assert "fedlink serve needs the server extra: pip install 'fedlink[server]'" in result.stderr


async def test_runner_install_runs_the_operator_commands(runner_venv: Path, tmp_path: Path) -> None:
    # fedlink job / device are gRPC clients: no server extra needed, TLS with the coordinator's CA included.
    settings = CoordinatorSettings(data_dir=tmp_path / "data", listen_address="127.0.0.1:0")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    async with Coordinator(settings) as coordinator:
        endpoint = coordinator.endpoint
        assert endpoint is not None and endpoint.ca_cert is not None
        connection = ["--server", endpoint.address, "--ca-cert", str(endpoint.ca_cert),
                      "--data-dir", str(settings.data_dir), "--format", "json"]  # fmt: skip
        for command in (["job", "list"], ["device", "list"]):
            # Asynchronously: the coordinator answers on this event loop meanwhile.
            process = await asyncio.create_subprocess_exec(
                *tied([str(runner_venv / "fedlink"), *command, *connection]),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=tmp_path,
                env=env,
            )
            out, err = await asyncio.wait_for(process.communicate(), timeout=300)
            assert process.returncode == 0, f"fedlink {' '.join(command)}: {err.decode()}"
            assert json.loads(out) == []
