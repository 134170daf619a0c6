"""FedBuff under `fedlink serve` as its own process: a coordinator SIGKILLed with acknowledged updates in
its buffer resumes with every one of them counted once, on SQLite and PostgreSQL.

The job is FedBuff set up as FedAvg (selection = every device, K = selection, history 1, global_lr 1),
so which updates make each version is known, and the final model is FedAvg's: an update lost makes the
version wait for ever (the test times out), one counted twice moves the model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import weights_dxo
from .test_serve_process import SHAPES, Device, Serve, expected_model, final_model

pytestmark = pytest.mark.slow

DEVICES = 3


@pytest.fixture(params=["sqlite", "postgres"])
def serve(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Serve]:
    db_url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    process = Serve(tmp_path / "data", db_url)
    try:
        yield process
    finally:
        if process.process is not None and process.process.poll() is None:
            process.process.kill()
        process.stop()


def _submit(serve: Serve, initial: dict[str, np.ndarray], versions: int) -> str:
    control = cgrpc.ControlServiceStub(grpc.insecure_channel(serve.address))
    data = weights_dxo(initial).SerializeToString(deterministic=True)
    sha = hashlib.sha256(data).hexdigest()
    header = dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data))
    control.UploadModel(
        iter([cpb.UploadModelRequest(header=header), cpb.UploadModelRequest(chunk=data)]),
        metadata=serve.admin,
    )
    spec = cpb.JobSpec(name="kill-fedbuff", initial_model=dxo_pb2.BlobRef(sha256=sha))
    config = spec.fedbuff
    config.max_model_version = versions
    config.device_selection_size = config.num_updates_for_model = config.min_hole_to_fill = DEVICES
    config.max_model_history = 1
    config.global_lr = 1.0
    config.task_timeout.FromSeconds(600)  # versions come from their updates; a bound, not a wait
    submitted = control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id="fedbuff-1"), metadata=serve.admin
    )
    return str(submitted.job.job_id)


def _report(serve: Serve, device: Device, job_id: str, task: rpb.GetTaskResponse, request_id: str) -> int:
    # the update of model version v is the one FedAvg's round v + 1 expects (see expected_model)
    return int(device.report(serve.address, job_id, task, task.model_version + 1, request_id).status)


def test_sigkill_with_updates_in_the_buffer_counts_every_acknowledged_update_once(serve: Serve) -> None:
    initial = {
        name: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for name, s in SHAPES.items()
    }
    serve.migrate()
    serve.start()
    devices = [Device(i) for i in range(DEVICES)]
    for device in devices:
        device.enroll(serve.address)
        # as a runner does: asking for work (of any job) makes the device one the workflow samples
        device.stub(serve.address).GetJob(rpb.GetJobRequest(protocol_version="1.0"), metadata=device.meta)
    job_id = _submit(serve, initial, versions=2)

    # Version 0's tasks: two updates acknowledged into the buffer, then the coordinator dies.
    tasks = {d.index: d.next_task(serve.address, job_id) for d in devices}
    assert {t.model_version for t in tasks.values()} == {0}
    for device in devices[:2]:
        assert (
            _report(serve, device, job_id, tasks[device.index], f"v0-{device.index}") == rpb.RUNNER_STATUS_OK
        )
    serve.kill()

    serve.start()  # same data directory and database
    # A retry of an acknowledged report gets the original OK, and is not counted again.
    assert _report(serve, devices[0], job_id, tasks[0], "v0-0") == rpb.RUNNER_STATUS_OK
    assert _report(serve, devices[2], job_id, tasks[2], "v0-2") == rpb.RUNNER_STATUS_OK  # version 1
    for device in devices:
        task = device.next_task(serve.address, job_id)
        assert task.status == rpb.RUNNER_STATUS_OK and task.model_version == 1
        assert task.task_id != tasks[device.index].task_id
        assert _report(serve, device, job_id, task, f"v1-{device.index}") == rpb.RUNNER_STATUS_OK

    state, model = final_model(serve, job_id)
    assert state == states_pb2.JOB_STATE_FINISHED
    expected = expected_model(initial, devices, rounds=2)
    for name, value in expected.items():
        # within float32 rounding of FedAvg's: an update lost or counted twice moves it much further
        np.testing.assert_array_max_ulp(model[name], value, maxulp=1)
    for device in devices:
        assert device.next_task(serve.address, job_id).status == rpb.RUNNER_STATUS_DONE
    assert serve.stop() == 0
