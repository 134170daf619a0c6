"""The Dockerfile without a container engine: hadolint, and the shape the images promise (two targets
on python:3.11-slim, non-root, only a venv copied into the final stages, every install pinned by
deploy/constraints.txt, a HEALTHCHECK over gRPC health on the coordinator)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied


def _hadolint(venv_bin: Path, path: Path) -> subprocess.CompletedProcess[str]:
    command = [str(venv_bin / "hadolint"), "--no-color", str(path)]
    return subprocess.run(tied(command), capture_output=True, text=True, timeout=60, check=False)


def stages(dockerfile: Path) -> dict[str, str]:
    """Each stage's name and its text, from its FROM line to the next one."""
    parts = re.split(r"^(?=FROM )", dockerfile.read_text(), flags=re.MULTILINE)
    found = {}
    for part in parts:
        match = re.match(r"FROM \S+ AS (\S+)", part)
        if match:
            found[match.group(1)] = part
    return found


@pytest.fixture(scope="module")
def dockerfile(repo_root: Path) -> Path:
    return repo_root / "Dockerfile"


def test_hadolint_finds_nothing(venv_bin: Path, dockerfile: Path) -> None:
    result = _hadolint(venv_bin, dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_an_unpinned_install(venv_bin: Path, dockerfile: Path, tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    text = dockerfile.read_text().replace(" -c /tmp/constraints.txt build hatchling", " build hatchling", 1)
    broken.write_text(text)
    result = _hadolint(venv_bin, broken)
    assert result.returncode == 1 and "DL3013" in result.stdout


def test_two_targets_non_root_with_only_the_venv(dockerfile: Path) -> None:
    found = stages(dockerfile)
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile.read_text()
    assert re.search(r"^USER 10001:10001$", found["base"], re.MULTILINE)
    for target in ("runner", "coordinator"):
        text = found[target]
        assert text.startswith(f"FROM base AS {target}")
        # Nothing of the build (compilers, wheels, pip) reaches the final stage: only the venv.
        assert re.findall(r"^(COPY|ADD|RUN)\b.*$", text, re.MULTILINE) == ["COPY"]
        assert f"COPY --from={target}-venv /opt/fedlink /opt/fedlink" in text
        assert "USER" not in text  # stays the base's non-root user
    assert list(found)[-1] == "coordinator"  # the default target


def test_every_install_is_pinned_by_the_constraints(dockerfile: Path) -> None:
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    installs = re.findall(r"pip install [^&\n]*", text)
    assert len(installs) == 3
    for command in installs:
        assert "-c /tmp/constraints.txt" in command, command
    assert text.count("COPY deploy/constraints.txt /tmp/constraints.txt") == 3


def test_coordinator_health_check_asks_grpc_health(dockerfile: Path) -> None:
    coordinator = stages(dockerfile)["coordinator"].replace("\\\n", " ")
    (check,) = re.findall(r"^HEALTHCHECK .*$", coordinator, re.MULTILINE)
    assert "exec fedlink health " in check and "--server" in check and "--ca-cert" in check
    assert "HEALTHCHECK NONE" in stages(dockerfile)["runner"]  # a runner serves nothing to probe


def test_constraints_file_is_current(repo_root: Path) -> None:
    # Every package the extras need is pinned, at the version this venv has (.ci/test installs from it).
    result = subprocess.run(
        tied([sys.executable, str(repo_root / "deploy" / "constraints.py"), "--check"]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
