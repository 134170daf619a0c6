"""The wire API passes buf's STANDARD and COMMENTS lint and is formatted the way buf formats it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench.orphans import tied


@pytest.fixture(scope="module")
def buf(venv_bin: Path) -> str:
    """The buf binary that the buf-bin package (dev extra) puts beside the test interpreter."""
    found = shutil.which("buf", path=str(venv_bin))
    # A missing linter must fail the suite: skipping would let an unlinted API through CI.
    assert found is not None, f"buf is not in {venv_bin}; install the dev extra: pip install -e '.[dev]'"
    return found


def run_buf(buf: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs buf in ``cwd`` (a folder holding buf.yaml) and returns what it did."""
    return subprocess.run(
        tied([buf, *args]),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_buf_lint_passes(buf: str, repo_root: Path) -> None:
    result = run_buf(buf, "lint", cwd=repo_root / "proto")
    assert result.returncode == 0, f"buf lint found problems:\n{result.stdout}{result.stderr}"


def test_buf_format_leaves_the_protos_unchanged(buf: str, repo_root: Path) -> None:
    result = run_buf(buf, "format", "--diff", "--exit-code", cwd=repo_root / "proto")
    assert result.returncode == 0, f"run `buf format -w` in proto/:\n{result.stdout}{result.stderr}"


def test_buf_lint_catches_an_undocumented_message(buf: str, repo_root: Path, tmp_path: Path) -> None:
    # Proves the lint configuration is live (COMMENTS included), so the passing test above means something.
    copy = tmp_path / "proto"
    shutil.copytree(repo_root / "proto", copy, ignore=shutil.ignore_patterns("gen", "*.py"))
    dxo = copy / "fedlink" / "v1" / "dxo.proto"
    dxo.write_text(dxo.read_text() + "\nmessage Undocumented {\n  string name = 1;\n}\n")
    result = run_buf(buf, "lint", cwd=copy)
    assert result.returncode != 0
    assert "Undocumented" in result.stdout + result.stderr


#: The wire API as released (fedlink.v1 before the workflows issue): ``buf build -o`` of proto/ then.
#: Changes to v1 must be additive; a breaking one needs a fedlink.v2 package, not an edit here.
BASELINE = Path("baseline") / "fedlink-v1.binpb"


def test_buf_breaking_finds_no_change_that_breaks_the_released_v1(buf: str, repo_root: Path) -> None:
    result = run_buf(buf, "breaking", "--against", str(BASELINE), cwd=repo_root / "proto")
    assert result.returncode == 0, f"a breaking change to fedlink.v1:\n{result.stdout}{result.stderr}"


def test_buf_breaking_catches_a_removed_field(buf: str, repo_root: Path, tmp_path: Path) -> None:
    # Proves the check is live: dropping a field of the released API must fail it.
    copy = tmp_path / "proto"
    shutil.copytree(repo_root / "proto", copy, ignore=shutil.ignore_patterns("gen", "*.py"))
    control = copy / "fedlink" / "v1" / "control_service.proto"
    text = control.read_text()
    assert "  string message = 7;\n" in text
    control.write_text(
        text.replace("  // Why the job failed or was aborted; empty otherwise.\n  string message = 7;\n", "")
    )
    result = run_buf(buf, "breaking", "--against", str(BASELINE), cwd=copy)
    assert result.returncode != 0
    assert "message" in result.stdout + result.stderr
