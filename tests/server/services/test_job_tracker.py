"""The job tracker against real sinks (MLflow on a SQLite store, TensorBoard event files): a round whose
event reaches the tracker after its job's final state (the driver closed it as an operator aborted the
job) is logged, and the job's runs still end as the job did.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from fedlink.server.domain import Job, JobState, WorkflowSpec
from fedlink.server.protocol.events import JOB_STATE_CHANGED
from fedlink.server.services.tracking import JobTracker
from fedlink.server.tracking import MlflowSink, TensorBoardSink

pytestmark = [
    # MLflow's SQL store uses SQLAlchemy 2.1's deprecated noload; it is MLflow's, not ours.
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _job(job_id: str) -> Job:
    return Job(
        job_id=job_id,
        name="digits",
        state=JobState.RUNNING,
        spec_json=WorkflowSpec(name="fedavg", config={"num_rounds": 50}).to_json(),
        job_data="{}",
        initial_model_sha256=None,
        device_selector={},
        message="",
        created_at=T0,
        updated_at=T0,
    )


def _round(tracker: JobTracker, job: Job, number: int) -> None:
    tracker.heard(job, "round_started", number, {"num_devices": 2})
    tracker.heard(job, "round_closed", number, {"num_results": 2, "metrics": {"loss": 1.0 / number}})


@pytest.mark.parametrize("final", [JobState.ABORTED, JobState.FINISHED])
async def test_a_round_heard_after_the_jobs_end_is_logged_and_the_run_stays_ended(
    tmp_path: Path, final: JobState
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tensorboard = TensorBoardSink(tmp_path / "tb")
    tracker = JobTracker([MlflowSink(uri), tensorboard])
    job = _job("j1")
    _round(tracker, job, 1)
    tracker.heard(job, "round_started", 2, {"num_devices": 2})
    tracker.heard(job, JOB_STATE_CHANGED, 0, {"state": final.value, "message": ""})
    # Closed by the driver before the end (the store has it first); heard after.
    tracker.heard(job, "round_closed", 2, {"num_results": 2, "metrics": {"loss": 0.5}})
    await tracker.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedlink")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == {JobState.ABORTED: "KILLED", JobState.FINISHED: "FINISHED"}[final]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5)]
    sampled = client.get_metric_history(run.info.run_id, "fedlink/num_devices")
    assert sorted((m.step, m.value) for m in sampled) == [(1, 2.0), (2, 2.0)]  # the late round's start kept

    events = EventAccumulator(str(tmp_path / "tb" / "digits-j1"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5)]


async def test_a_round_started_after_the_jobs_end_leaves_nothing_behind(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = JobTracker([MlflowSink(uri)])
    job = _job("j2")
    _round(tracker, job, 1)
    tracker.heard(job, JOB_STATE_CHANGED, 0, {"state": JobState.ABORTED.value, "message": ""})
    tracker.heard(job, "round_started", 2, {"num_devices": 2})
    await tracker.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedlink")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]
    assert tracker._round_starts == {}
