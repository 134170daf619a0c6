"""``fedlink job``: submit, list, show, watch, abort, delete and download jobs on a running coordinator."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any, Final

import click
import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from fedlink.common.errors import FedlinkError
from fedlink.server.cli.client import (
    CALL_TIMEOUT_S,
    ConnectionOptions,
    ControlClient,
    collect_pages,
    connection_options,
    control_client,
    echo_json,
    echo_table,
    fail,
    format_option,
    output_file,
)
from fedlink.server.cli.jobfile import load_job_file
from fedlink.server.cli.plot import job_plot_command
from fedlink.server.domain import WorkflowSpec
from fedlink.server.workflows import registry
from fedlink.server.workflows.wire import CUSTOM, spec_from_wire
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import states_pb2

#: Bytes per upload message (the control protocol's limit is larger; 1 MiB keeps each message small).
UPLOAD_CHUNK_BYTES: Final = 1024 * 1024
#: How many times an interrupted upload, download or watch stream is resumed before giving up.
STREAM_ATTEMPTS: Final = 5
# Codes of a dropped connection or a restarting coordinator: worth resuming the stream.
_TRANSIENT: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL}
)
_FINAL_STATES: Final = frozenset(
    {states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED}
)
_STATE_NAMES: Final = ("pending", "running", "finished", "failed", "aborted")


def _transient(error: grpc.RpcError) -> bool:
    return isinstance(error, grpc.Call) and error.code() in _TRANSIENT


def _backoff(attempt: int) -> None:
    time.sleep(min(0.1 * 2**attempt, 2.0))


def state_name(state: int) -> str:
    """``JOB_STATE_RUNNING`` -> ``RUNNING``."""
    return states_pb2.JobState.Name(state).removeprefix("JOB_STATE_")  # type: ignore[arg-type]


def _time(stamp: Timestamp) -> str:
    if not stamp.seconds and not stamp.nanos:
        return ""
    return stamp.ToDatetime(tzinfo=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# ---- transfers ---------------------------------------------------------------------------------------


def upload_model(
    client: ControlClient,
    data: bytes,
    *,
    chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    notify: Callable[[str], None] = lambda _: None,
) -> tuple[str, int]:
    """Uploads a serialized model, resuming from what the coordinator holds after a dropped stream.

    Returns:
        The model's sha256 and size.
    """
    sha = hashlib.sha256(data).hexdigest()

    def parts(offset: int) -> Iterator[cpb.UploadModelRequest]:
        header = cpb.UploadModelRequest()
        header.header.sha256, header.header.size_bytes, header.header.offset = sha, len(data), offset
        yield header
        for start in range(offset, len(data), chunk_bytes):
            yield cpb.UploadModelRequest(chunk=data[start : start + chunk_bytes])

    for attempt in range(1, STREAM_ATTEMPTS + 1):
        status = client.stub.GetModelUploadStatus(
            cpb.GetModelUploadStatusRequest(sha256=sha),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
            wait_for_ready=attempt > 1,  # after a drop, wait for the channel to reconnect
        )
        if status.complete:
            return sha, len(data)
        if attempt > 1:
            notify(f"upload interrupted; resuming from byte {status.received_bytes} of {len(data)}")
        try:
            reply = client.stub.UploadModel(parts(status.received_bytes), metadata=client.metadata)
        except grpc.RpcError as exc:
            if not _transient(exc) or attempt == STREAM_ATTEMPTS:
                raise
            _backoff(attempt)
            continue
        if reply.model.sha256 != sha:
            fail(f"the coordinator stored the model as {reply.model.sha256}, not {sha}")
        return sha, len(data)
    raise AssertionError("unreachable")  # the last attempt returns or raises


def download_model(client: ControlClient, job_id: str, round_no: int) -> tuple[bytes, int]:
    """Downloads a job's model (resuming a dropped stream) and checks its size and sha256.

    Returns:
        The serialized model and the round it belongs to.
    """
    received = bytearray()
    size = -1
    sha = ""
    got_round = 0
    for attempt in range(1, STREAM_ATTEMPTS + 1):
        request = cpb.DownloadModelRequest(job_id=job_id, round=round_no, offset=len(received))
        try:
            for chunk in client.stub.DownloadModel(
                request, metadata=client.metadata, wait_for_ready=attempt > 1
            ):
                if chunk.offset != len(received):
                    fail(f"the download skipped from byte {len(received)} to {chunk.offset}")
                if sha and (chunk.sha256 != sha or chunk.size_bytes != size):
                    fail("the model changed while it was being downloaded; try again")
                sha, size, got_round = chunk.sha256, chunk.size_bytes, chunk.round
                received += chunk.data
            break
        except grpc.RpcError as exc:
            if not _transient(exc) or attempt == STREAM_ATTEMPTS:
                raise
            _backoff(attempt)
    if len(received) != size:
        fail(f"the download ended after {len(received)} of {size} bytes")
    digest = hashlib.sha256(received).hexdigest()
    if digest != sha:
        fail(f"the downloaded model's sha256 is {digest}, but the coordinator announced {sha}")
    return bytes(received), got_round


# ---- presentation ------------------------------------------------------------------------------------


def _workflow_of(job: cpb.Job) -> WorkflowSpec | None:
    """The job's workflow spec, or None if this CLI does not know the coordinator's workflow field."""
    try:
        return spec_from_wire(job.spec)
    except FedlinkError:
        return None


def _workflow_section(spec: WorkflowSpec | None) -> tuple[str, dict[str, object]]:
    """The key of a job's parameters (the wire oneof's: ``fedavg``, ..., ``custom``) and the parameters."""
    if spec is None:
        return CUSTOM, {"name": "(unknown to this fedlink)"}
    if spec.is_import_path:
        return CUSTOM, {"name": spec.name, "config": dict(spec.config)}
    return spec.name, registry.describe(spec)


def job_dict(job: cpb.Job) -> dict[str, object]:
    """A job as the JSON that ``--format json`` prints."""
    try:
        job_data: object = json.loads(job.spec.job_data) if job.spec.job_data else {}
    except ValueError:
        job_data = job.spec.job_data
    spec = _workflow_of(job)
    section, described = _workflow_section(spec)
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "state": state_name(job.state),
        "current_round": job.current_round,
        "completed_rounds": job.completed_rounds,
        "num_rounds": 0 if spec is None else registry.num_steps(spec),
        "workflow": "" if spec is None else spec.name,
        "message": job.message,
        "metrics": dict(sorted(job.metrics.items())),
        "create_time": _time(job.create_time),
        "update_time": _time(job.update_time),
        "device_selector": dict(sorted(job.spec.device_selector.items())),
        "initial_model": {
            "sha256": job.spec.initial_model.sha256,
            "size_bytes": job.spec.initial_model.size_bytes,
        },
        section: described,
        "job_data": job_data,
    }


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _show_job(job: cpb.Job) -> None:
    d = job_dict(job)
    spec = _workflow_of(job)
    section, described = _workflow_section(spec)
    summary = "" if spec is None or spec.is_import_path else registry.builtin(spec.name).summary
    lines = [
        ("job", job.job_id),
        ("name", job.spec.name),
        ("state", d["state"]),
        # FedBuff has model versions, not rounds (a checkpoint per version all the same).
        ("version" if d["workflow"] == "fedbuff" else "round", _round_text(job, int(str(d["num_rounds"])))),
        ("workflow", f"{d['workflow']} ({summary})" if summary else str(d["workflow"])),
        ("message", job.message),
        ("created", d["create_time"]),
        ("updated", d["update_time"]),
        ("model", job.spec.initial_model.sha256),
        ("selector", _pairs(dict(sorted(job.spec.device_selector.items()))) or "(every device)"),
        (section, _pairs(described)),
        ("metrics", _pairs(dict(sorted(job.metrics.items())))),
    ]
    for key, value in lines:
        if value:
            click.echo(f"{key + ':':<10}{value}")


def _steps(job: cpb.Job) -> int:
    spec = _workflow_of(job)
    return 0 if spec is None else registry.num_steps(spec)


def _round_text(job: cpb.Job, num_rounds: int) -> str:
    total = f" of {num_rounds}" if num_rounds else ""
    return f"{job.current_round}{total} ({job.completed_rounds} completed)"


def event_dict(event: cpb.WatchJobResponse) -> dict[str, object]:
    """A job event as one line of ``job watch --format json``."""
    kind = event.WhichOneof("event") or "unknown"
    body: dict[str, object] = {
        "sequence": event.sequence,
        "time": _time(event.event_time),
        "state": state_name(event.state),
        "round": event.round,
        "event": kind,
    }
    if kind == "round_started":
        body["num_devices"] = event.round_started.num_devices
    elif kind == "result_received":
        body["device_id"] = event.result_received.device_id
        body["status"] = states_pb2.ResultStatus.Name(event.result_received.status).removeprefix(
            "RESULT_STATUS_"
        )
        body["num_results"] = event.result_received.num_results
        if event.result_received.error_message:
            body["error"] = event.result_received.error_message
    elif kind == "round_closed":
        body["num_results"] = event.round_closed.num_results
        body["metrics"] = dict(sorted(event.round_closed.metrics.items()))
    elif kind == "model_version":
        version = event.model_version
        body["num_updates"] = version.num_updates
        body["staleness"] = {str(k): n for k, n in enumerate(version.staleness_counts) if n}
        body["metrics"] = dict(sorted(version.metrics.items()))
        body["selection"] = version.selection
        body["failed"], body["lost"], body["stale"] = version.num_failed, version.num_lost, version.num_stale
    elif kind == "job_state_changed":
        body["message"] = event.job_state_changed.message
    return body


def event_line(event: cpb.WatchJobResponse) -> str:
    """A job event as one readable line."""
    d = event_dict(event)
    at = str(d["time"])[11:19]
    kind = d["event"]
    if kind == "round_started":
        text = f"round {event.round} started: {d['num_devices']} devices"
    elif kind == "result_received":
        text = (
            f"round {event.round}: result from {d['device_id']} {str(d['status']).lower()} "
            f"({d['num_results']} in)" + (f": {d['error']}" if "error" in d else "")
        )
    elif kind == "round_closed":
        metrics = _pairs(dict(sorted(event.round_closed.metrics.items())))
        text = f"round {event.round} closed: {d['num_results']} results" + (f"; {metrics}" if metrics else "")
    elif kind == "model_version":
        version = event.model_version
        stale = " ".join(f"{k}:{n}" for k, n in enumerate(version.staleness_counts) if n)
        metrics = _pairs({k: v for k, v in sorted(version.metrics.items()) if k != "num_updates"})
        text = (
            f"model version {event.round}: {version.num_updates} updates (staleness {stale or '-'}), "
            f"selection {version.selection}" + (f"; {metrics}" if metrics else "")
        )
    elif kind == "job_state_changed":
        text = f"job {d['state']}" + (f": {d['message']}" if d["message"] else "")
    else:
        text = f"event {kind}"
    return f"{at} {text}"


# ---- commands ----------------------------------------------------------------------------------------


@click.group(name="job")
def job_group() -> None:
    """Submit and follow jobs on a running coordinator."""


@job_group.command("submit")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@format_option(("text", "json"))
@connection_options
def submit_command(job_file: Path, output_format: str, connection: ConnectionOptions) -> None:
    """Upload JOB_FILE's model and submit the job (TOML or JSON); prints the job id."""
    try:
        job = load_job_file(job_file)
    except FedlinkError as exc:
        fail(exc.message)
    with control_client(connection) as client:
        sha, size = upload_model(client, job.model_bytes, notify=lambda text: click.echo(text, err=True))
        reply = client.stub.SubmitJob(
            cpb.SubmitJobRequest(spec=job.spec(sha, size), request_id=str(uuid.uuid4())),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
        )
    if output_format == "json":
        echo_json(job_dict(reply.job))
    else:
        click.echo(reply.job.job_id)


@job_group.command("list")
@click.option(
    "--state", type=click.Choice(_STATE_NAMES, case_sensitive=False), help="Only jobs in this state."
)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="At most this many.")
@format_option()
@connection_options
def list_command(state: str | None, limit: int, output_format: str, connection: ConnectionOptions) -> None:
    """List jobs, newest first."""
    wanted = (
        states_pb2.JobState.Value(f"JOB_STATE_{state.upper()}") if state else states_pb2.JOB_STATE_UNSPECIFIED
    )
    with control_client(connection) as client:

        def page(size: int, token: str) -> tuple[Sequence[cpb.Job], str]:
            request = cpb.ListJobsRequest(page_size=size, page_token=token, state=wanted)
            reply = client.stub.ListJobs(request, metadata=client.metadata, timeout=CALL_TIMEOUT_S)
            return reply.jobs, reply.next_page_token

        jobs = collect_pages(page, limit)
    if output_format == "json":
        echo_json([job_dict(job) for job in jobs])
        return
    rows = [
        [
            job.job_id,
            job.spec.name,
            state_name(job.state),
            f"{job.current_round}/{_steps(job) or '?'}",
            _time(job.update_time),
        ]
        for job in jobs
    ]
    echo_table(["JOB ID", "NAME", "STATE", "ROUND", "UPDATED"], rows)


@job_group.command("show")
@click.argument("job_id")
@format_option()
@connection_options
def show_command(job_id: str, output_format: str, connection: ConnectionOptions) -> None:
    """Show one job: its state, round, parameters and latest metrics."""
    with control_client(connection) as client:
        job = client.stub.DescribeJob(
            cpb.DescribeJobRequest(job_id=job_id), metadata=client.metadata, timeout=CALL_TIMEOUT_S
        ).job
    if output_format == "json":
        echo_json(job_dict(job))
    else:
        _show_job(job)


@job_group.command("watch")
@click.argument("job_id")
@click.option(
    "--results/--no-results",
    default=True,
    show_default=True,
    help="Show every result as it arrives (a line per device per round), or rounds and states only.",
)
@format_option(("text", "json"))
@connection_options
def watch_command(job_id: str, results: bool, output_format: str, connection: ConnectionOptions) -> None:
    """Stream a job's progress until it ends; exit 0 if it FINISHED, 1 otherwise."""
    after = 0
    failures = 0
    with control_client(connection) as client:
        while True:
            try:
                stream = client.stub.WatchJob(
                    cpb.WatchJobRequest(job_id=job_id, after_sequence=after),
                    metadata=client.metadata,
                    wait_for_ready=failures > 0,
                )
                for event in stream:
                    after = event.sequence
                    failures = 0
                    if not results and event.HasField("result_received"):
                        continue
                    line = json.dumps(event_dict(event), sort_keys=True) if output_format == "json" else None
                    click.echo(line if line is not None else event_line(event))
            except grpc.RpcError as exc:
                failures += 1
                if not _transient(exc) or failures >= STREAM_ATTEMPTS:
                    raise
                _backoff(failures)
                continue
            job = client.stub.DescribeJob(
                cpb.DescribeJobRequest(job_id=job_id), metadata=client.metadata, timeout=CALL_TIMEOUT_S
            ).job
            if job.state in _FINAL_STATES:
                break
            _backoff(1)  # the stream ended early (a coordinator shutting down): watch again
    if job.state != states_pb2.JOB_STATE_FINISHED:
        raise click.exceptions.Exit(1)


@job_group.command("abort")
@click.argument("job_id")
@click.option("--reason", default="aborted by the operator", show_default=True, help="Recorded on the job.")
@connection_options
def abort_command(job_id: str, reason: str, connection: ConnectionOptions) -> None:
    """Abort a pending or running job."""
    with control_client(connection) as client:
        job = client.stub.AbortJob(
            cpb.AbortJobRequest(job_id=job_id, reason=reason, request_id=str(uuid.uuid4())),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
        ).job
    click.echo(f"job {job.job_id} {state_name(job.state)}")


@job_group.command("delete")
@click.argument("job_id")
@connection_options
def delete_command(job_id: str, connection: ConnectionOptions) -> None:
    """Delete a finished, failed or aborted job with its models and results."""
    with control_client(connection) as client:
        reply = client.stub.DeleteJob(
            cpb.DeleteJobRequest(job_id=job_id, request_id=str(uuid.uuid4())),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
        )
    click.echo(f"job {job_id} deleted; freed {reply.freed_bytes} bytes")


@job_group.command("download")
@click.argument("job_id")
@click.option(
    "--round", "round_no", type=click.IntRange(min=0), default=0, help="A kept round (default: the latest)."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The .npz file to write (default: <job id>.npz).",
)
@connection_options
def download_command(job_id: str, round_no: int, output: Path | None, connection: ConnectionOptions) -> None:
    """Download a job's model and write its arrays to an .npz file (sha256-checked)."""
    import numpy as np  # only this command needs numpy

    from fedlink.common.dxo import DXO, DataKind

    target = output_file(output, Path(f"{job_id}.npz"), ".npz", "the model")
    with control_client(connection) as client:
        job = client.stub.DescribeJob(
            cpb.DescribeJobRequest(job_id=job_id), metadata=client.metadata, timeout=CALL_TIMEOUT_S
        ).job
        data, got_round = download_model(client, job_id, round_no)
    try:
        model = DXO.from_bytes(data)
    except FedlinkError as exc:
        fail(f"the downloaded model does not decode: {exc.message}")
    if model.kind is not DataKind.WEIGHTS:
        fail(f"the downloaded model is a {model.kind} DXO, not WEIGHTS")
    # Written beside the target and renamed, so an interrupted run never leaves half a file.
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            np.savez(file, **model.data)  # type: ignore[arg-type]  # numpy's stub types **kwds loosely
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    which = "the initial model (round 0)" if got_round == 0 else f"the model of round {got_round}"
    click.echo(f"wrote {which} ({len(model.data)} arrays) to {target}")
    if job.state != states_pb2.JOB_STATE_FINISHED and round_no == 0:
        # Not a finished job's result: say so, rather than let the initial model pass for a final one.
        click.echo(
            f"note: job {job_id} is {state_name(job.state)}: this is its latest completed round's model, "
            "not a finished job's"
            + (" (no round has completed: the initial model)" if got_round == 0 else ""),
            err=True,
        )


# In a module of its own, with the drawing it shares with `fedlink simulate --plot`.
job_group.add_command(job_plot_command)

__all__ = ["download_model", "event_dict", "event_line", "job_dict", "job_group", "upload_model"]
