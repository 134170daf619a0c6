"""What starting a runner or the CLI imports: not ml_dtypes (a second or more of every start) until a
bfloat16 tensor needs it, and nothing of the server extra for the runner. In fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

from bench.orphans import tied

PROBE = """
import sys
import fedlink.runner, fedlink.runner.daemon, fedlink.runner.settings, fedlink.cli.main, fedlink.cli.runner
import fedlink.common.dtypes, fedlink.common.dxo, fedlink.common.tensors
from fedlink.cli.main import build_cli
for args in (["--help"], ["runner", "--help"], ["job", "--help"], ["device", "--help"]):
    try:
        build_cli(server_extra=False).main(args, prog_name="fedlink", standalone_mode=False)
    except SystemExit:
        pass
print("LOADED", *sorted(m for m in ("ml_dtypes", "sqlalchemy", "alembic") if m in sys.modules))
"""

BFLOAT16 = """
import sys
import numpy as np
from fedlink.common.dxo import DXO, DataKind
from fedlink.v1 import dxo_pb2
wire = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
wire.data["w"].dtype = "bfloat16"
wire.data["w"].shape.extend([2])
wire.data["w"].dense.data = np.array([0x3F80, 0x4000], "<u2").tobytes()  # 1.0 and 2.0
print("BEFORE", "ml_dtypes" in sys.modules)
w = DXO.from_proto(wire).data["w"]
print("AFTER", "ml_dtypes" in sys.modules, w.dtype.name, w.astype("float32").tolist())
"""


def python(code: str) -> str:
    result = subprocess.run(
        tied([sys.executable, "-c", code]), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_runner_and_the_cli_start_without_ml_dtypes_or_the_server_extra() -> None:
    loaded = [line for line in python(PROBE).splitlines() if line.startswith("LOADED")]
    assert loaded == ["LOADED"], loaded


def test_ml_dtypes_comes_with_the_first_bfloat16_tensor() -> None:
    lines = python(BFLOAT16).splitlines()
    assert lines == ["BEFORE False", "AFTER True bfloat16 [1.0, 2.0]"]
