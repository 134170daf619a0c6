"""Each image target's install step, run as a venv: the wheel of this checkout installed as the
Dockerfile's stage installs it (the same extras, ``-c deploy/constraints.txt``), then the entrypoint the
image runs. An image that cannot start fails here, not on the user's machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

from .test_dockerfile import stages

pytestmark = pytest.mark.slow

#: The wheel the pip install of a ``*-venv`` stage names after its constraints, and its extras.
_INSTALL = re.compile(r'-c /tmp/constraints\.txt\s+(?:/wheels/fedlink-\*\.whl|"\$\{wheel\}\[([\w,]+)\]")')


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs a command outside the checkout, with no PYTHONPATH to leak the editable install in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        tied([str(a) for a in args]), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def image_extras(dockerfile: Path, target: str) -> str:
    """The extras the Dockerfile's ``<target>-venv`` stage installs the wheel with ("" for none)."""
    (match,) = _INSTALL.finditer(stages(dockerfile)[f"{target}-venv"].replace("\\\n", " "))
    return match.group(1) or ""


@pytest.fixture(scope="module")
def wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the checkout (as tests/packaging builds it: --no-isolation, no download)."""
    dist = tmp_path_factory.mktemp("dist")
    result = run(
        sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, repo_root, cwd=dist
    )
    assert result.returncode == 0, f"wheel build failed:\n{result.stdout}{result.stderr}"
    (built,) = dist.glob("fedlink-*.whl")
    return built


def _image_venv(target: str, wheel: Path, repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    extras = image_extras(repo_root / "Dockerfile", target)
    venv = tmp_path_factory.mktemp(f"{target}-venv")
    created = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv)
    assert created.returncode == 0, created.stderr
    requirement = f"{wheel}[{extras}]" if extras else str(wheel)
    constraints = repo_root / "deploy" / "constraints.txt"
    installed = run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-cache-dir",
        "-c", constraints, requirement, cwd=venv, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, (
        f"the {target} image's install failed:\n{installed.stdout}{installed.stderr}"
    )
    return venv / "bin"


@pytest.fixture(scope="module")
def runner_image(wheel: Path, repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _image_venv("runner", wheel, repo_root, tmp_path_factory)


@pytest.fixture(scope="module")
def coordinator_image(wheel: Path, repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _image_venv("coordinator", wheel, repo_root, tmp_path_factory)


def _installed_versions(venv_bin: Path, cwd: Path) -> dict[str, str]:
    probe = (
        "import json, importlib.metadata as m, re; print(json.dumps({re.sub(r'[-_.]+', '-', "
        "d.metadata['Name']).lower(): d.version for d in m.distributions()}))"
    )
    result = run(venv_bin / "python", "-c", probe, cwd=cwd)
    assert result.returncode == 0, result.stderr
    versions: dict[str, str] = json.loads(result.stdout)
    return versions


def _pins(repo_root: Path) -> dict[str, str]:
    lines = (repo_root / "deploy" / "constraints.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))


def test_the_dockerfile_installs_runner_plain_and_coordinator_with_the_server_extra(repo_root: Path) -> None:
    assert image_extras(repo_root / "Dockerfile", "runner") == ""
    assert image_extras(repo_root / "Dockerfile", "coordinator") == "server"


def test_runner_image_starts_without_server_dependencies(
    runner_image: Path, repo_root: Path, tmp_path: Path
) -> None:
    result = run(runner_image / "fedlink", "runner", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--join-secret-file" in result.stdout
    assert run(runner_image / "python", "-c", "import sqlalchemy", cwd=tmp_path).returncode == 1
    versions = _installed_versions(runner_image, tmp_path)
    pins = _pins(repo_root)
    assert {"grpcio", "protobuf", "numpy", "click"} <= versions.keys()
    assert {n: v for n, v in versions.items() if n != "fedlink"} == {
        n: pins[n] for n in versions if n != "fedlink"
    }


def test_coordinator_image_serves_and_migrates(
    coordinator_image: Path, repo_root: Path, tmp_path: Path
) -> None:
    result = run(coordinator_image / "fedlink", "serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "FEDLINK_METRICS_ADDRESS" in result.stdout
    # compose's migrate service: `fedlink db upgrade` finds its migrations in the installed wheel.
    upgraded = run(
        coordinator_image / "fedlink",
        "db",
        "upgrade",
        "--db",
        f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
        cwd=tmp_path,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.startswith("database at revision ")
    versions = _installed_versions(coordinator_image, tmp_path)
    pins = _pins(repo_root)
    assert {
        "sqlalchemy",
        "alembic",
        "asyncpg",
        "grpcio-health-checking",
        "prometheus-client",
    } <= versions.keys()
    assert {n: v for n, v in versions.items() if n != "fedlink"} == {
        n: pins[n] for n in versions if n != "fedlink"
    }


def test_coordinator_image_has_its_healthcheck_command(coordinator_image: Path, tmp_path: Path) -> None:
    # The image's HEALTHCHECK runs `fedlink health --server ... --ca-cert ...`.
    result = run(coordinator_image / "fedlink", "health", "--help", cwd=tmp_path)
    assert result.returncode == 0, f"fedlink health is missing from the coordinator image:\n{result.stderr}"
    assert "--server" in result.stdout and "--ca-cert" in result.stdout
