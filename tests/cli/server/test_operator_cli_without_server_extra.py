"""The operator's commands (``fedlink job``, ``fedlink device``) are plain gRPC clients: they work in an
install without the server extra. Here a ``fedlink`` process runs with every module of that extra made
unimportable (as in a runner-only install; tests/packaging checks the real one) against a real TLS
coordinator: it submits a job from a job file, lists and shows it, and lists the devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.orphans import tied
from fedlink.server.settings import CoordinatorSettings

from .conftest import CoordinatorThread

#: The import names of the server extra's packages (pyproject's ``server`` extra).
SERVER_EXTRA = ("sqlalchemy", "alembic", "aiosqlite", "asyncpg", "uvloop", "grpc_health",
                "grpc_reflection", "prometheus_client", "cryptography")  # fmt: skip

#: ``fedlink`` with the server extra gone: ``sys.modules[name] = None`` makes every import of it fail
#: and ``find_spec`` (how the CLI detects the extra) answer None, as when it is not installed.
WITHOUT_SERVER_EXTRA = f"""
import sys
for name in {SERVER_EXTRA!r}:
    sys.modules[name] = None
from fedlink.cli.main import main
try:
    main()
finally:
    loaded = sorted(name for name in {SERVER_EXTRA!r} if sys.modules.get(name) is not None)
    assert not loaded, loaded
"""


def fedlink(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDLINK_")}
    return subprocess.run(
        tied([sys.executable, "-c", WITHOUT_SERVER_EXTRA, *args]),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=cwd,
        env=env,
    )


def test_the_store_package_loads_its_sql_side_only_when_asked() -> None:
    # What makes the rest possible: the workflows import the store's protocol, not SQLAlchemy.
    probe = (
        "import sys, fedlink.server.store as store, fedlink.server.cli.jobs, fedlink.server.cli.devices\n"
        "print(sorted(m for m in ('sqlalchemy', 'alembic') if m in sys.modules))\n"
        "print([name for name in store.__all__ if getattr(store, name, None) is None])\n"
        "print(sorted(m for m in ('sqlalchemy', 'alembic') if m in sys.modules))\n"
    )
    result = subprocess.run(
        tied([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    # Nothing of the extra at first; every exported name resolves (which loads it).
    assert result.stdout.splitlines() == ["[]", "[]", "['alembic', 'sqlalchemy']"]


@pytest.mark.slow  # CLI processes
def test_job_and_device_commands_work_without_the_server_extra(tmp_path: Path) -> None:
    np.savez(tmp_path / "initial.npz", w=np.zeros((4, 2), np.float32), b=np.zeros(2, np.float32))
    (tmp_path / "job.toml").write_text(
        'name = "no-extra"\nmodel = "initial.npz"\n\n[fedavg]\nnum_rounds = 2\n\n'
        '[job_data]\ncomponents = [ { type = "SoftmaxRegressionTrainer", name = "t" } ]\n'
        'executors = { "*" = "@t" }\n'
    )
    settings = CoordinatorSettings(data_dir=tmp_path / "data", listen_address="127.0.0.1:0")  # TLS
    with CoordinatorThread(settings) as coordinator:
        assert coordinator.coordinator is not None and coordinator.coordinator.endpoint is not None
        ca = coordinator.coordinator.endpoint.ca_cert
        assert ca is not None
        connection = [
            "--server",
            coordinator.address,
            "--ca-cert",
            str(ca),
            "--data-dir",
            str(settings.data_dir),
        ]

        listed = fedlink("--help", cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        commands = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
        for name in ("serve", "db", "simulate"):  # stand-ins saying which extra to install
            assert "Needs the server extra" in commands[name], listed.stdout
        for name in ("job", "device"):  # the real commands
            assert "server extra" not in commands[name], listed.stdout

        submitted = fedlink("job", "submit", "job.toml", *connection, cwd=tmp_path)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()

        jobs = fedlink("job", "list", "--format", "json", *connection, cwd=tmp_path)
        assert jobs.returncode == 0, jobs.stderr
        assert [(j["job_id"], j["name"]) for j in json.loads(jobs.stdout)] == [(job_id, "no-extra")]

        shown = fedlink("job", "show", job_id, *connection, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert job_id in shown.stdout and "fedavg" in shown.stdout

        devices = fedlink("device", "list", "--format", "json", *connection, cwd=tmp_path)
        assert devices.returncode == 0, devices.stderr
        assert json.loads(devices.stdout) == []

        serve = fedlink("serve", cwd=tmp_path)
        assert serve.returncode == 2
        assert "fedlink serve needs the server extra: pip install 'fedlink[server]'" in serve.stderr
