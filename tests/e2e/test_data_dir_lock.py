"""One coordinator per data directory: a second one on it is refused at start with an error naming the
first (pid and address), and the directory is free again once the first has exited, however it exited.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.orphans import tied
from fedlink.server.app import Coordinator
from fedlink.server.data_dir import DataDirInUse
from fedlink.server.store import migrate

from .conftest import local_settings
from .test_serve_process import Serve


def serve_beside(data_dir: Path) -> tuple[int, str]:
    """A second ``fedlink serve`` on ``data_dir``, on another port: its exit code and output.

    One that starts serving instead is stopped at once (the test then fails on its exit code).
    """
    fedlink = str(Path(sys.executable).parent / "fedlink")
    args = [fedlink, "serve", "--data-dir", str(data_dir), "--listen-address", "127.0.0.1:0", "--insecure"]
    with subprocess.Popen(tied(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("fedlink coordinator listening on "):
                process.kill()
        return process.wait(timeout=60), "".join(lines)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        return int(reply.status)


@pytest.mark.slow  # three coordinator processes, one after another, and one refused beside them
def test_a_second_serve_on_one_data_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Serve(data, None)
    first.start()
    try:
        assert first.process is not None
        code, output = serve_beside(data)
        assert code == 1, output
        assert (
            f"error: cannot start the coordinator: the data directory {data} is in use by another "
            f"coordinator (pid {first.process.pid}, listening on {first.address})"
        ) in output
        assert "Traceback" not in output
        assert health(first.address) == health_pb2.HealthCheckResponse.SERVING  # the first goes on
    finally:
        assert first.stop() == 0

    # Released by a clean exit, and by SIGKILL too: the kernel drops the lock with the process.
    second = Serve(data, None)
    second.start()
    second.kill()
    third = Serve(data, None)
    third.start()
    assert health(third.address) == health_pb2.HealthCheckResponse.SERVING
    assert third.stop() == 0


async def test_a_second_coordinator_in_process_is_refused_until_the_first_stops(tmp_path: Path) -> None:
    settings = local_settings(tmp_path)
    async with Coordinator(settings) as first:
        assert first.endpoint is not None
        with pytest.raises(DataDirInUse) as refused:
            async with Coordinator(settings):
                pass
        assert f"(pid {os.getpid()}, listening on {first.endpoint.address})" in refused.value.message
        assert str(settings.data_dir) in refused.value.message
    async with Coordinator(settings) as again:  # stopped: the directory is free
        assert again.endpoint is not None


@pytest.mark.postgres
async def test_the_data_dir_is_locked_whatever_the_database(tmp_path: Path, pg_database: str) -> None:
    # Two processes on one data directory share its coordinator-id, the owner of run leases: with
    # PostgreSQL too, they would both drive the same runs. Replicas each have their own directory.
    await migrate.upgrade(pg_database)
    shared = local_settings(tmp_path, db_url=pg_database)
    async with Coordinator(shared):
        with pytest.raises(DataDirInUse):
            async with Coordinator(shared):
                pass
        async with Coordinator(local_settings(tmp_path / "replica", db_url=pg_database)) as replica:
            assert replica.endpoint is not None


async def test_one_sqlite_file_serves_one_coordinator_whatever_their_data_dirs(tmp_path: Path) -> None:
    database = tmp_path / "shared" / "fedlink.db"
    database.parent.mkdir()
    url = f"sqlite+aiosqlite:///{database}"
    async with Coordinator(local_settings(tmp_path / "a", db_url=url)) as first:
        assert first.endpoint is not None
        with pytest.raises(DataDirInUse) as refused:
            async with Coordinator(local_settings(tmp_path / "b", db_url=url)):
                pass
        message = refused.value.message
        assert f"the SQLite database {database} is in use by another coordinator" in message
        assert f"(pid {os.getpid()}, listening on {first.endpoint.address})" in message
        assert "PostgreSQL" in message  # what to do instead
        # The refused one let its own data directory go: it starts on another database.
        async with Coordinator(local_settings(tmp_path / "b")) as other:
            assert other.endpoint is not None
    async with Coordinator(local_settings(tmp_path / "b", db_url=url)) as second:  # free once stopped
        assert second.endpoint is not None
