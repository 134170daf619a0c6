"""Fixtures of the deployment tests: the deploy/ folder, the compose file as data, the secret files
deploy/make_secrets.py writes, and where a compose service's /run/secrets/NAME is on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.make_secrets import make_secrets

#: deploy/compose.yaml's coordinator replicas, one PostgreSQL database under them.
COORDINATORS = ("coordinator", "coordinator-2")


@pytest.fixture(scope="session")
def deploy_dir(repo_root: Path) -> Path:
    """The checkout's deploy/ folder."""
    return repo_root / "deploy"


@pytest.fixture(scope="session")
def compose(deploy_dir: Path) -> dict[str, Any]:
    """deploy/compose.yaml as YAML data (anchors and ``<<`` merges resolved)."""
    loaded: dict[str, Any] = yaml.safe_load((deploy_dir / "compose.yaml").read_text())
    return loaded


@pytest.fixture(scope="session")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files deploy/make_secrets.py writes, as for compose (its default host names)."""
    out = tmp_path_factory.mktemp("deploy") / "secrets"
    make_secrets(out)
    return out


def service_environment(
    compose: dict[str, Any], service: str, secrets_dir: Path, deploy_dir: Path
) -> dict[str, str]:
    """A compose service's environment with each ``/run/secrets/NAME`` replaced by the file compose
    would mount there (the secret's ``file:``, found in ``secrets_dir``)."""
    files = {name: Path(spec["file"]).name for name, spec in compose["secrets"].items()}
    environment: dict[str, str] = {}
    for key, value in compose["services"][service].get("environment", {}).items():
        text = str(value)
        if text.startswith("/run/secrets/"):
            name = text.removeprefix("/run/secrets/")
            assert name in compose["services"][service].get("secrets", []), (
                f"{service}: {key} names secret {name}, which the service does not mount"
            )
            text = str(secrets_dir / files[name])
        environment[key] = text
    return environment
