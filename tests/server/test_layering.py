"""The coordinator's layering is checked: import-linter's contracts hold, and only the workflows name
FedAvg's types."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.orphans import tied

#: FedAvg's own types: outside the workflows layer, everything goes through the workflow registry.
FEDAVG_NAMES = frozenset({"FedAvg", "FedAvgParams", "FedAvgConfig", "RoundFold", "WeightedAverage"})


@pytest.fixture(scope="module")
def lint_imports(venv_bin: Path) -> str:
    found = shutil.which("lint-imports", path=str(venv_bin))
    assert found is not None, (
        f"lint-imports is not in {venv_bin}; install the dev extra: pip install -e '.[dev]'"
    )
    return found


def run(lint_imports: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        tied([lint_imports, "--no-cache", *args]),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_import_contract_is_kept(lint_imports: str, repo_root: Path) -> None:
    result = run(lint_imports, cwd=repo_root)
    assert result.returncode == 0, f"an import contract is broken:\n{result.stdout}{result.stderr}"
    assert "0 broken" in result.stdout


def test_lint_imports_sees_the_real_import_graph(lint_imports: str, repo_root: Path, tmp_path: Path) -> None:
    # Proves the passing check means something: a contract our code does break is reported broken.
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["fedlink.server"]\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "workflows may not use the domain"\ntype = "forbidden"\n'
        'source_modules = ["fedlink.server.workflows"]\nforbidden_modules = ["fedlink.server.domain"]\n'
    )
    result = run(lint_imports, str(config), cwd=repo_root)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert "fedlink.server.workflows" in result.stdout


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.rsplit(".", 1)[-1])
    return found


def test_nothing_outside_the_workflows_names_fedavg_types(repo_root: Path) -> None:
    workflows = repo_root / "server" / "fedlink" / "server" / "workflows"
    offenders = {}
    for root in (repo_root / "server", repo_root / "runner"):
        for path in sorted(root.rglob("*.py")):
            if workflows in path.parents:
                continue
            named = _names(path) & FEDAVG_NAMES
            if named:
                offenders[str(path.relative_to(repo_root))] = sorted(named)
    assert not offenders, f"these name FedAvg's types instead of going through the registry: {offenders}"
    assert _names(workflows / "fedavg.py") & FEDAVG_NAMES  # the scan sees names where they are
