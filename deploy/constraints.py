"""Writes (or checks) deploy/constraints.txt: exact pins of every package fedlink's extras need.

The pins are the versions installed in the running interpreter's environment (the checkout's .venv),
for the packages that pyproject.toml's dependencies and extras (``dev`` includes all the others)
require, followed transitively through the installed packages' own metadata. fedlink itself is left
out, and so are CUDA libraries that a default torch wheel would bring (the CPU build needs none).

    .venv/bin/python deploy/constraints.py            # rewrite deploy/constraints.txt
    .venv/bin/python deploy/constraints.py --check    # exit 1, naming the differences, if it is stale

The image build (Dockerfile), .ci/test and tests/deploy install with ``pip install -c
deploy/constraints.txt``; see docs/deploying.md for when and how to refresh it.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Final

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT: Final = Path(__file__).resolve().parent.parent
CONSTRAINTS: Final = ROOT / "deploy" / "constraints.txt"
#: Never pinned: CUDA runtime wheels and Triton come only with a CUDA build of torch.
_EXCLUDED: Final = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")
_HEADER: Final = """\
# Exact versions of everything fedlink's dependencies and extras (dev included) need, as installed in
# the checkout's .venv. Written by `python deploy/constraints.py`; do not edit by hand (see
# docs/deploying.md, "Refreshing the pins"). Used as `pip install -c deploy/constraints.txt ...` by the
# Dockerfile, .ci/test and tests/deploy.
"""


def _project_requirements(pyproject: Path) -> list[Requirement]:
    """fedlink's own requirements with every extra, its self-references (``fedlink[...]``) expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: list[Requirement] = []
    pending = [Requirement(text) for text in project["dependencies"]]
    pending += [Requirement(text) for texts in extras.values() for text in texts]
    while pending:
        requirement = pending.pop()
        if canonicalize_name(requirement.name) == "fedlink":
            pending += [Requirement(text) for extra in requirement.extras for text in extras.get(extra, [])]
        else:
            found.append(requirement)
    return found


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    marker = requirement.marker
    return any(marker.evaluate({"extra": extra}) for extra in extras or {""})


def pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Canonical package name -> installed version, for the closure of fedlink's requirements.

    Raises:
        SystemExit: a required package is not installed (install ``.[dev]`` first).
    """
    found: dict[str, str] = {}
    pending = [(r, set(r.extras)) for r in _project_requirements(pyproject) if _applies(r, set())]
    missing: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, extras = pending.pop()
        name = canonicalize_name(requirement.name)
        if _EXCLUDED.match(name) or name == "fedlink":
            continue
        try:
            dist = distribution(requirement.name)
        except PackageNotFoundError:
            missing.append(str(requirement))
            continue
        key = (name, frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        found[name] = dist.version
        for text in dist.requires or []:
            child = Requirement(text)
            if _applies(child, extras):
                pending.append((child, set(child.extras)))
    if missing:
        sys.exit("not installed (run `pip install -e '.[dev]'` first): " + ", ".join(sorted(missing)))
    return found


def render(pinned: dict[str, str]) -> str:
    """The constraints file's text: the header, then ``name==version`` sorted by name."""
    return _HEADER + "".join(f"{name}=={pinned[name]}\n" for name in sorted(pinned))


def read(path: Path = CONSTRAINTS) -> dict[str, str]:
    """The pins of a constraints file, by canonical name."""
    result: dict[str, str] = {}
    for line in path.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            name, _, version = text.partition("==")
            result[canonicalize_name(name)] = version
    return result


def main() -> int:
    """Writes the constraints file, or with ``--check`` compares it with what it would be."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if stale")
    args = parser.parse_args()
    wanted = pins()
    if not args.check:
        CONSTRAINTS.write_text(render(wanted))
        print(f"wrote {len(wanted)} pins to {CONSTRAINTS.relative_to(ROOT)}")
        return 0
    present = read()
    problems = [f"missing: {n}=={wanted[n]}" for n in sorted(wanted.keys() - present.keys())]
    problems += [f"not needed: {n}=={present[n]}" for n in sorted(present.keys() - wanted.keys())]
    problems += [
        f"differs: {n}=={present[n]} pinned, {wanted[n]} installed"
        for n in sorted(wanted.keys() & present.keys())
        if wanted[n] != present[n]
    ]
    for problem in problems:
        print(problem)
    if problems:
        print(
            f"{CONSTRAINTS.relative_to(ROOT)} is stale: run `python deploy/constraints.py`", file=sys.stderr
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
