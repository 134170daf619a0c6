"""Regenerates the Python code for the fedlink.v1 wire API.

Run from anywhere: ``python proto/generate.py``. Uses the pinned grpcio-tools and mypy-protobuf from the
dev extra, so the committed output is reproducible; ``tests/proto/test_proto_generated.py`` checks that it is.
"""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
OUT = PROTO_ROOT / "gen" / "python"
PACKAGE_DIR = Path("fedlink") / "v1"


def generate(out: Path = OUT) -> list[Path]:
    """Generates messages, gRPC stubs and type stubs under ``out``; returns the written files."""
    target = out / PACKAGE_DIR
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    # protoc finds the mypy-protobuf plugins on PATH; they live beside this interpreter. PATH is put
    # back afterwards because the tests call generate() in-process.
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + (saved_path or "")
    try:
        code = protoc.main(args)
    finally:
        if saved_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved_path
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    (target / "__init__.py").write_text('"""Generated code for the fedlink.v1 wire API. Do not edit."""\n')
    (target / "py.typed").write_text("")
    return sorted(target.iterdir())


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path)
