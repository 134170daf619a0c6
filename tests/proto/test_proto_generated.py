"""The committed Python code for fedlink.v1 is exactly what proto/generate.py produces today."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path


def load_generate(repo_root: Path) -> Callable[[Path], list[Path]]:
    """Loads ``generate()`` from proto/generate.py, a script rather than an installed module."""
    spec = importlib.util.spec_from_file_location(
        "fedlink_proto_generate", repo_root / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generate: Callable[[Path], list[Path]] = module.generate
    return generate


def test_regenerating_changes_nothing(repo_root: Path, tmp_path: Path) -> None:
    committed = repo_root / "proto" / "gen" / "python" / "fedlink" / "v1"
    written = load_generate(repo_root)(tmp_path)
    fresh = tmp_path / "fedlink" / "v1"
    assert written, "generate() wrote nothing"

    fresh_names = sorted(p.name for p in fresh.iterdir())
    committed_names = sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    assert fresh_names == committed_names, "files differ: run `python proto/generate.py` and commit"
    changed = [name for name in fresh_names if (fresh / name).read_bytes() != (committed / name).read_bytes()]
    assert not changed, f"stale generated code in {changed}: run `python proto/generate.py` and commit"
