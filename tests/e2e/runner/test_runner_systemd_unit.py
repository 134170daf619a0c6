"""The runner's systemd unit verifies with systemd-analyze, pointing at the installed fedlink."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

# Settings newer than some systemd versions still in use; older ones ignore them with this warning.
_NEWER_KEYS = {"RestartSteps", "RestartMaxDelaySec"}


def test_the_unit_file_verifies(repo_root: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    fedlink = Path(sys.executable).parent / "fedlink"
    assert fedlink.exists(), "the fedlink console script is not installed next to the interpreter"
    text = (repo_root / "deploy" / "fedlink-runner.service").read_text()
    assert "ExecStart=/usr/local/bin/fedlink runner --config /etc/fedlink/runner.toml" in text
    for required in (
        "StateDirectory=fedlink-runner",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "KillSignal=SIGTERM",
    ):
        assert required in text
    grace = 30  # the runner's default shutdown_grace
    stop = int(re.search(r"^TimeoutStopSec=(\d+)s$", text, re.M).group(1))  # type: ignore[union-attr]
    assert stop > grace
    unit = tmp_path / "fedlink-runner.service"
    unit.write_text(text.replace("/usr/local/bin/fedlink", str(fedlink)))

    done = subprocess.run(
        tied([analyze, "verify", str(unit)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if str(unit) in line and not any(f"Unknown key '{key}'" in line for key in _NEWER_KEYS)
    ]
    assert problems == []
