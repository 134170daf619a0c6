"""Both systemd units: `systemd-analyze verify` in a scratch root (the machine's own unit files, and a
stand-in for /usr/local/bin/fedlink, which verify requires to be executable), and the stop timeout
against the drain it has to leave room for."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.orphans import tied

UNITS = ("fedlink-runner.service", "fedlink-coordinator.service")
#: What systemd older than 254 says about the runner's RestartSteps= / RestartMaxDelaySec= (ignored there).
_KNOWN_OLD_SYSTEMD = re.compile(r"Unknown key '(RestartSteps|RestartMaxDelaySec)' in section \[Service\]")
SYSTEMD_UNITS = Path("/usr/lib/systemd/system")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch file-system root holding this machine's system units."""
    if shutil.which("systemd-analyze") is None or not SYSTEMD_UNITS.is_dir():
        pytest.skip("systemd-analyze or /usr/lib/systemd/system is absent: the units were not verified")
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(SYSTEMD_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    executable = root / "usr/local/bin/fedlink"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    (root / "etc/systemd/system").mkdir(parents=True)
    return root


def _verify(root: Path, unit: Path) -> tuple[int, list[str]]:
    installed = root / "etc/systemd/system" / unit.name
    shutil.copyfile(unit, installed)
    result = subprocess.run(
        tied(["systemd-analyze", "verify", f"--root={root}", "--man=no", str(installed)]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return result.returncode, [line for line in lines if not _KNOWN_OLD_SYSTEMD.search(line)]


@pytest.mark.parametrize("name", UNITS)
def test_unit_passes_systemd_analyze_verify(root: Path, deploy_dir: Path, name: str) -> None:
    status, complaints = _verify(root, deploy_dir / name)
    assert status == 0 and complaints == [], "\n".join(complaints)


def test_verify_catches_a_broken_unit(root: Path, deploy_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "fedlink-coordinator.service"
    text = (deploy_dir / "fedlink-coordinator.service").read_text()
    broken.write_text(text.replace("ExecStart=/usr/local/bin/fedlink", "ExecStart=/usr/local/bin/fedlinc"))
    status, complaints = _verify(root, broken)
    assert status != 0 and any("fedlinc" in line for line in complaints)


def _setting(text: str, key: str) -> str:
    (value,) = re.findall(rf"^{key}=(.+)$", text, re.MULTILINE)
    return str(value)


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)s", value)
    assert match, value
    return float(match.group(1))


def test_coordinator_drains_within_the_stop_timeout(deploy_dir: Path) -> None:
    text = (deploy_dir / "fedlink-coordinator.service").read_text()
    grace = _seconds(_setting(text, "Environment=FEDLINK_SHUTDOWN_GRACE"))
    assert grace < _seconds(_setting(text, "TimeoutStopSec")) and _setting(text, "KillSignal") == "SIGTERM"
    assert _setting(text, "StateDirectory") == "fedlink"
    assert _setting(text, "Environment=FEDLINK_DATA_DIR") == "%S/fedlink"
    credentials = dict(v.split(":", 1) for v in re.findall(r"^LoadCredential=(.+)$", text, re.MULTILINE))
    assert set(credentials) == {"join-secret", "admin-token"}
    for name in credentials:
        assert f"=%d/{name}" in text, f"the {name} credential is loaded but not used"
