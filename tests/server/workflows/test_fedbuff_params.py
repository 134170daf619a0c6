"""FedBuff's parameters through every door: the job file, the registry, the wire form, the coordinator's
checks, and how ``fedlink job watch`` shows its model versions."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.api.control_servicer import event_message
from fedlink.server.cli.jobfile import load_job_file
from fedlink.server.cli.jobs import event_dict, event_line
from fedlink.server.domain import JobEvent, WorkflowSpec
from fedlink.server.workflows import registry
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.server.workflows.registry import WorkflowLimits, Workflows
from fedlink.server.workflows.wire import spec_from_wire, spec_to_wire
from fedlink.v1 import control_service_pb2 as cpb

JOB = """
name = "buffered"
model = "initial.npz"
[fedbuff]
max_model_version = 20
num_updates_for_model = 50
max_model_history = 5
global_lr = 0.05
staleness_weight = true
update_weight = "device"
device_selection_size = 200
min_hole_to_fill = 10
device_reuse = false
device_sampling_strategy = "random"
device_wait_timeout = "10m"
task_timeout = "1h"
pickup_timeout = "45s"
seed = 7
keep_checkpoints = 2
[job_data]
components = [{ type = "SoftmaxRegressionTrainer", name = "trainer" }]
"""


def test_a_job_file_section_maps_to_the_parameters_and_the_wire_spec(tmp_path: Path) -> None:
    np.savez(tmp_path / "initial.npz", w=np.ones((2, 2), np.float32))
    (tmp_path / "job.toml").write_text(JOB)
    job = load_job_file(tmp_path / "job.toml")
    params = registry.parse(job.workflow)
    assert params == FedBuffParams(
        max_model_version=20,
        num_updates_for_model=50,
        max_model_history=5,
        global_lr=0.05,
        staleness_weight=True,
        update_weight="device",
        device_selection_size=200,
        min_hole_to_fill=10,
        device_reuse=False,
        device_sampling_strategy="random",
        device_wait_timeout_s=600.0,
        task_timeout_s=3600.0,
        pickup_timeout_s=45.0,
        seed=7,
        keep_checkpoints=2,
    )
    wire = job.spec("ab" * 32, 10).fedbuff
    assert wire.device_wait_timeout.ToSeconds() == 600 and wire.task_timeout.ToSeconds() == 3600
    assert wire.update_weight == cpb.UPDATE_WEIGHT_DEVICE
    assert wire.device_sampling_strategy == cpb.DEVICE_SAMPLING_STRATEGY_RANDOM
    assert registry.num_steps(job.workflow) == 20
    assert registry.task_names(job.workflow) == ("train",)


def test_a_job_file_duration_is_written_as_a_duration(tmp_path: Path) -> None:
    np.savez(tmp_path / "initial.npz", w=np.ones(2, np.float32))
    (tmp_path / "job.toml").write_text(JOB.replace('task_timeout = "1h"', "task_timeout_s = 3600"))
    with pytest.raises(InvalidArgument, match="write task_timeout_s as task_timeout = '60s'"):
        load_job_file(tmp_path / "job.toml")


@pytest.mark.parametrize(
    "config",
    [
        {"max_model_version": 3},
        FedBuffParams(max_model_version=4, device_wait_timeout_s=5.0, update_weight="device").to_config(),
    ],
    ids=["defaults", "every_field"],
)
def test_the_wire_form_round_trips_every_parameter(config: dict[str, object]) -> None:
    checked = Workflows().check(WorkflowSpec(name="fedbuff", config=config), model_bytes=100)
    spec = cpb.JobSpec()
    spec_to_wire(checked, spec)
    assert spec.WhichOneof("workflow") == "fedbuff"
    back = Workflows().check(spec_from_wire(spec), model_bytes=100)
    assert back == checked
    assert back.config == FedBuffParams(**checked.config).to_config()  # every field written out


def test_unset_wire_fields_mean_the_defaults() -> None:
    spec = cpb.JobSpec()
    spec.fedbuff.max_model_version = 2
    params = registry.parse(spec_from_wire(spec))
    assert params == FedBuffParams(max_model_version=2)
    assert isinstance(params, FedBuffParams)
    assert (params.num_updates_for_model, params.max_model_history, params.global_lr) == (100, 10, 1.0)
    assert (params.device_selection_size, params.min_hole_to_fill, params.device_reuse) == (100, 1, True)
    assert params.device_sampling_strategy == "balanced" and params.update_weight == "num_examples"


def test_a_buffer_beyond_max_buffered_round_bytes_is_refused_naming_the_setting() -> None:
    workflows = Workflows(WorkflowLimits(max_buffered_round_bytes=10_000))
    spec = WorkflowSpec(name="fedbuff", config={"max_model_version": 3, "max_model_history": 5})
    with pytest.raises(InvalidArgument, match="max_buffered_round_bytes"):
        workflows.check(spec, model_bytes=1_000)  # 5 versions x 4 x 1,000 bytes
    assert workflows.check(spec, model_bytes=400).name == "fedbuff"


def test_a_model_version_event_is_shown_by_job_watch() -> None:
    body = {
        "round": 7,
        "num_updates": 5,
        "staleness": {"0": 3, "2": 2},
        "metrics": {"train_loss": 0.25, "num_updates": 5.0, "mean_staleness": 0.8},
        "selection": 9,
        "counters": {"updates": 40, "failed": 1, "lost": 2, "stale": 3, "handed_out": 50},
    }
    event = JobEvent(
        job_id="j",
        sequence=4,
        time=datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC),
        kind="model_version",
        payload_json=json.dumps(body),
    )
    message = event_message(event)
    assert message.round == 7 and message.WhichOneof("event") == "model_version"
    assert list(message.model_version.staleness_counts) == [3, 0, 2]
    assert (message.model_version.num_failed, message.model_version.num_lost) == (1, 2)
    assert message.model_version.num_stale == 3
    line = event_line(message)
    assert "model version 7: 5 updates (staleness 0:3 2:2), selection 9" in line
    assert "train_loss=0.25" in line
    shown = event_dict(message)
    assert shown["staleness"] == {"0": 3, "2": 2} and shown["num_updates"] == 5
    assert (shown["failed"], shown["lost"], shown["stale"]) == (1, 2, 3)
