"""Runner benchmark: the edge runner's own cost per task, and the upload of a 100 MB update, vs bare gRPC.

Run from the repository root::

    .venv/bin/python -m bench.runner_bench [--quick] [--json out.json] [--rounds N] [--update-mb M]

1. **Overhead per task.** A FedAvg job with one device per round (``min_results = 1``) and an executor
   that returns a tiny zero WEIGHT_DIFF at once. Three clients, one after the other, each against a
   fresh coordinator process on uvloop, all on this process's plain asyncio loop (as the daemon runs):
   the real :class:`Runner` over its gRPC transport (timed by :mod:`bench.runner_probes`); a *bare
   device* that speaks GetTask → ReportResult through the generated stubs with a prebuilt result (the
   protocol's floor: two RPCs plus the coordinator's round boundary, with no runner code); and a unary
   call to a bare grpc.aio echo server (``bench.echo_server``) with the report's payload size.
2. **Upload.** The Runner reports a 100 MB WEIGHT_DIFF (25M float32) through the blob path
   (GetBlobUploadStatus, UploadBlob in 1 MiB chunks, ReportResult with the blob ref), against a raw
   grpc.aio client-streaming upload of the same bytes in 1 MiB chunks to a bare server
   (``bench.upload_sink``). The coordinator's peak RSS is taken over the report only (VmHWM reset
   just before it). The stored result's sha256 (and the sha256 of the stored blob's bytes) must be
   the update's.

Machines are shared and noisy: read the medians and the ratios to the baselines of the same run.
The run exits 1 if a correctness check failed (every task acknowledged once, jobs finished, echo
replies intact, uploaded update stored bit-exact).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import proc_stats
from bench.bare_device import bare_device_tasks
from bench.child_processes import ServerProcess, cpu_count
from bench.coordinator_admin import ModelFile, admin_metadata, job_outcome, upload_model, write_model_file
from bench.coordinator_process import settings_from_json
from bench.echo_server import UNARY_METHOD
from bench.runner_probes import Probe, TaskTimes, TimedGrpcTransport, registry
from bench.upload_sink import UPLOAD_METHOD
from fedlink.common.dxo import DXO, DataKind
from fedlink.runner.loop import Runner
from fedlink.runner.transport.grpc_transport import GrpcTransportConfig
from fedlink.server.store import open_store
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2

MiB = 1024**2
MB = 1_000_000
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The sizes of one benchmark run."""

    #: FedAvg rounds (= tasks) of the overhead jobs, for the Runner and for the bare device each.
    rounds: int = 300
    #: First tasks left out of the figures (connection set-up, first round, caches).
    warmup_tasks: int = 5
    #: Sequential echo calls of the bare round trip.
    echo_calls: int = 2000
    #: float32 elements of the overhead job's model (a tiny update).
    tiny_floats: int = 10
    #: float32 elements of the uploaded update (25M: 100 MB).
    update_elements: int = 25_000_000
    #: Uploads by the Runner (each its own one-round job with a different update).
    upload_repeats: int = 3
    #: Raw uploads of the baseline.
    raw_repeats: int = 3


QUICK = Config(rounds=12, warmup_tasks=2, echo_calls=200, update_elements=768 * 1024, upload_repeats=1)


def _summary(seconds: Sequence[float]) -> dict[str, float]:
    """Count, median, p99 (nearest rank) and mean, in milliseconds."""
    if not seconds:
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, max(0, int(np.ceil(0.99 * len(ordered))) - 1))]
    return {
        "count": len(ordered),
        "p50_ms": round(float(np.median(ordered)) * 1e3, 3),
        "p99_ms": round(p99 * 1e3, 3),
        "mean_ms": round(float(np.mean(ordered)) * 1e3, 3),
    }


def _coordinator_args(data_dir: Path) -> list[str]:
    """Long leases and no offline sweeps: nothing but the measured traffic happens."""
    settings = {
        "data_dir": str(data_dir),
        "lease": 3600,
        "max_task_wait": 30,
        "default_task_wait": 20,
        "device_offline_after": 3600,
        # Thousands of devices enrol at once: the enrolment rate limit is not what is measured.
        "enrolments_per_minute": 0,
        "log_level": "WARNING",
        # The bench's devices register their executors under these names (bench.runner_probes).
        "component_types": ["NoopExecutor", "FixedUpdateExecutor"],
    }
    return ["--settings", json.dumps(settings)]


async def _submit(
    control: cgrpc.ControlServiceAsyncStub,
    admin: Any,
    model: ModelFile,
    name: str,
    rounds: int,
    executor: str,
) -> str:
    """A FedAvg job with one device per round whose tasks all go to ``executor``."""
    job_data = {
        "components": [{"type": executor, "name": "executor", "args": {}}],
        "executors": {"*": "@executor"},
    }
    spec = cpb.JobSpec(
        name=name, initial_model=dxo_pb2.BlobRef(sha256=model.sha256), job_data=json.dumps(job_data)
    )
    spec.fedavg.num_rounds = rounds
    spec.fedavg.devices_per_round = spec.fedavg.min_results = spec.fedavg.min_devices = 1
    spec.fedavg.seed = 1
    spec.fedavg.round_timeout.FromSeconds(600)
    reply = await control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=admin
    )
    return str(reply.job.job_id)


@dataclass(frozen=True, slots=True)
class _Coordinator:
    """A coordinator process with a job on it."""

    server: ServerProcess
    control: cgrpc.ControlServiceAsyncStub
    admin: Any
    job_id: str
    data_dir: Path

    @property
    def address(self) -> str:
        return str(self.server.info["address"])


@dataclass(frozen=True, slots=True)
class _JobSpec:
    name: str
    rounds: int
    executor: str


@contextlib.asynccontextmanager
async def _with_job(workdir: Path, name: str, model: ModelFile, job: _JobSpec) -> AsyncIterator[_Coordinator]:
    data_dir = workdir / f"coordinator-{name}"
    async with ServerProcess(
        "bench.coordinator_process", _coordinator_args(data_dir), workdir, name
    ) as server:
        admin = admin_metadata(server.info["admin_token"])
        async with grpc.aio.insecure_channel(server.info["address"]) as channel:
            control = cgrpc.ControlServiceStub(channel)
            await upload_model(control, admin, model)
            job_id = await _submit(control, admin, model, job.name, job.rounds, job.executor)
            yield _Coordinator(server, control, admin, job_id, data_dir)


def _job_checks(outcome: Any, rounds: int) -> dict[str, bool]:
    return {
        "job_finished": outcome.state == "JOB_STATE_FINISHED" and outcome.current_round == rounds,
        "one_result_per_round": outcome.round_results == (1,) * rounds,
    }


def _runner(address: str, state_dir: Path, probe: Probe, job_name: str, update: DXO | None = None) -> Runner:
    transport = TimedGrpcTransport(
        GrpcTransportConfig(
            server=address, state_dir=state_dir, insecure=True, device_info={"bench": "runner"}
        ),
        probe,
    )
    return Runner(
        job_name,
        None,
        {"bench": "runner"},
        {},
        60.0,
        resolver_registry=registry(probe, update),
        transport=transport,
    )


async def _run_until_acked(runner: Runner, probe: Probe, timeout_s: float) -> None:
    """Runs the Runner until every expected task was acknowledged (or the timeout), then stops it."""
    task = asyncio.create_task(runner.run_async())
    try:
        await asyncio.wait(
            {task, asyncio.ensure_future(probe.all_acked.wait())},
            timeout=timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)


# ---- 1. overhead per task ------------------------------------------------------------------------


async def runner_overhead(cfg: Config, workdir: Path, model: ModelFile) -> dict[str, Any]:
    """The real Runner on a no-op job: per-task time minus executor time, and its parts."""
    probe = Probe(expected_acks=cfg.rounds)
    job = _JobSpec("overhead-runner", cfg.rounds, "NoopExecutor")
    async with _with_job(workdir, "coordinator-runner", model, job) as coord:
        runner = _runner(coord.address, workdir / "runner-state", probe, job.name)
        started = time.perf_counter()
        await _run_until_acked(runner, probe, 60 + cfg.rounds * 2.0)
        wall = time.perf_counter() - started
        outcome = await job_outcome(coord.control, coord.admin, coord.job_id)
    ordered = sorted((t for t in probe.tasks.values() if t.complete), key=lambda t: t.get_start)
    measured = ordered[cfg.warmup_tasks :]

    def parts(fn: Any) -> dict[str, float]:
        return _summary([fn(t) for t in measured])

    executor = parts(lambda t: t.exec_end - t.exec_start)
    history = runner.history
    return {
        "tasks": len(measured),
        "wall_s": round(wall, 2),
        "per_task": parts(lambda t: t.report_end - t.get_start),
        "overhead": parts(lambda t: t.report_end - t.get_start - (t.exec_end - t.exec_start)),
        "executor": executor,
        "get_task": parts(lambda t: t.get_end - t.get_start),
        "before_executor": parts(lambda t: t.exec_start - t.get_end),
        "after_executor": parts(lambda t: t.report_start - t.exec_end),
        "report": parts(lambda t: t.report_end - t.report_start),
        "pending_write": parts(lambda t: t.pending_put_s),
        "report_minus_pending_write": parts(lambda t: t.report_end - t.report_start - t.pending_put_s),
        "logged_duration": _summary([r.duration_s for r in history[cfg.warmup_tasks :]]),
        "job": asdict(outcome),
        "checks": {
            "every_task_acknowledged": probe.acks == cfg.rounds
            and len(history) == cfg.rounds
            and all(r.outcome == "SUCCEEDED" and r.ack == "OK" for r in history),
            **_job_checks(outcome, cfg.rounds),
        },
    }


async def bare_device_floor(cfg: Config, workdir: Path, model: ModelFile) -> dict[str, Any]:
    """The protocol's floor per task: GetTask + ReportResult from the stubs, no runner code."""
    result = DXO(
        kind=DataKind.WEIGHT_DIFF, data={"w": np.zeros(cfg.tiny_floats, np.float32)}, meta={"num_examples": 1}
    ).to_proto()
    job = _JobSpec("overhead-bare", cfg.rounds, "NoopExecutor")
    async with _with_job(workdir, "coordinator-bare", model, job) as coord:
        times, report_bytes = await asyncio.wait_for(
            bare_device_tasks(coord.address, job.name, cfg.rounds, result), 60 + cfg.rounds * 2.0
        )
        outcome = await job_outcome(coord.control, coord.admin, coord.job_id)
    measured = times[cfg.warmup_tasks :]
    return {
        "tasks": len(measured),
        "report_payload_bytes": report_bytes,
        "per_task": _summary([t.report_end - t.get_start for t in measured]),
        "get_task": _summary([t.get_end - t.get_start for t in measured]),
        "report": _summary([t.report_end - t.report_start for t in measured]),
        "job": asdict(outcome),
        "checks": {
            "every_task_acknowledged": len(times) == cfg.rounds
            and all(t.ack == "RUNNER_STATUS_OK" for t in times),
            **_job_checks(outcome, cfg.rounds),
        },
    }


async def echo_round_trip(cfg: Config, workdir: Path, payload_bytes: int) -> dict[str, Any]:
    """Sequential unary calls of ``payload_bytes`` to a bare grpc.aio server in its own process."""
    payload = os.urandom(payload_bytes)
    latencies: list[float] = []
    mismatches = 0
    async with (
        ServerProcess("bench.echo_server", [], workdir, "echo") as server,
        grpc.aio.insecure_channel(server.info["address"], options=_CHANNEL_OPTIONS) as channel,
    ):
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(UNARY_METHOD)
        for _ in range(cfg.echo_calls + 50):  # the first 50 warm the connection up
            start = time.perf_counter()
            reply = await call(payload, timeout=10)
            latencies.append(time.perf_counter() - start)
            mismatches += reply != payload
    return {
        "payload_bytes": payload_bytes,
        "latency": _summary(latencies[50:]),
        "checks": {"replies_matched": mismatches == 0},
    }


# ---- 2. upload of a large update -----------------------------------------------------------------


def _update(elements: int, seed: int) -> DXO:
    values = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32) * np.float32(1e-3)
    return DXO(kind=DataKind.WEIGHT_DIFF, data={"w": values}, meta={"num_examples": 1})


async def _stored_result(data_dir: Path, job_id: str) -> tuple[list[str], list[str]]:
    """Every result's payload sha256 as recorded, and the sha256 of each stored blob's bytes."""
    settings = settings_from_json({"data_dir": str(data_dir)})
    recorded, hashed = [], []
    async with open_store(settings.db_url, blob_dir=settings.blob_dir) as store:
        run = await store.get_current_run(job_id)
        for result in await store.list_results(run_id=run.run_id, accepted_only=False):
            recorded.append(result.payload_sha256 or "")
            if result.payload_sha256:
                digest = hashlib.sha256()
                async for chunk in store.blobs.iter_chunks(result.payload_sha256):
                    digest.update(chunk)
                hashed.append(digest.hexdigest())
    return recorded, hashed


async def runner_upload(cfg: Config, workdir: Path, repeat: int, model: ModelFile) -> dict[str, Any]:
    """One Runner reporting one large WEIGHT_DIFF through the blob path, with the coordinator's peak RSS."""
    update = _update(cfg.update_elements, seed=repeat + 1)
    update_bytes = update.to_bytes()
    expected_sha, size = hashlib.sha256(update_bytes).hexdigest(), len(update_bytes)
    del update_bytes
    probe = Probe(expected_acks=1)
    job = _JobSpec(f"upload-{repeat}", 1, "FixedUpdateExecutor")
    marks: dict[str, int] = {}
    async with _with_job(workdir, f"coordinator-upload-{repeat}", model, job) as coord:
        pid = coord.server.pid

        def before_report() -> None:
            # Peaks from here on belong to the report: the task's download is over.
            marks["coordinator_rss_before"] = proc_stats.memory_use(pid).rss_bytes
            marks["runner_rss_before"] = proc_stats.memory_use(os.getpid()).rss_bytes
            proc_stats.reset_peak(pid)
            proc_stats.reset_peak(os.getpid())

        probe.before_report = before_report
        runner = _runner(coord.address, workdir / f"upload-state-{repeat}", probe, job.name, update)
        await _run_until_acked(runner, probe, 600)
        marks["coordinator_peak"] = proc_stats.memory_use(pid).peak_bytes
        marks["runner_peak"] = proc_stats.memory_use(os.getpid()).peak_bytes
        outcome = await job_outcome(coord.control, coord.admin, coord.job_id)
    recorded, hashed = await _stored_result(coord.data_dir, coord.job_id)
    [times] = [t for t in probe.tasks.values() if t.report_end] or [TaskTimes("")]
    report_s = times.report_end - times.report_start
    upload_s = times.upload_end - times.upload_start
    return {
        "update_bytes": size,
        "report_s": round(report_s, 3),
        "report_mb_per_s": round(size / MB / report_s, 1) if report_s > 0 else 0.0,
        "upload_blob_s": round(upload_s, 3),
        "upload_blob_mb_per_s": round(size / MB / upload_s, 1) if upload_s > 0 else 0.0,
        "pending_write_s": round(times.pending_put_s, 3),
        # Encoding (to_proto, two serializations, copies) and the pending write, before the upload.
        "before_upload_s": round(times.upload_start - times.report_start, 3),
        # The request copied with a blob ref, then ReportResult (the coordinator reads, parses and
        # validates the whole blob before it answers).
        "after_upload_s": round(times.report_end - times.upload_end, 3),
        "coordinator_rss_before_mib": round(marks.get("coordinator_rss_before", 0) / MiB, 1),
        "coordinator_peak_rss_mib": round(marks.get("coordinator_peak", 0) / MiB, 1),
        "runner_process_rss_before_mib": round(marks.get("runner_rss_before", 0) / MiB, 1),
        "runner_process_peak_rss_mib": round(marks.get("runner_peak", 0) / MiB, 1),
        "job": asdict(outcome),
        "checks": {
            "acknowledged": probe.acks == 1 and times.ack == "OK",
            "uploaded_through_blob": times.uploaded_bytes == size,
            "sha256_matched": times.uploaded_sha256 == expected_sha and recorded == [expected_sha] == hashed,
            **_job_checks(outcome, 1),
        },
    }


async def raw_upload(cfg: Config, workdir: Path) -> dict[str, Any]:
    """A raw grpc.aio client-streaming upload of the update's bytes in 1 MiB chunks to a bare server."""
    data = _update(cfg.update_elements, seed=1).to_bytes()

    async def chunks() -> AsyncIterator[bytes]:
        view = memoryview(data)
        for start in range(0, len(data), MiB):
            yield bytes(view[start : start + MiB])  # one copy per chunk, as the transport makes

    seconds: list[float] = []
    received: list[int] = []
    async with (
        ServerProcess("bench.upload_sink", [], workdir, "upload-sink") as server,
        grpc.aio.insecure_channel(server.info["address"], options=_CHANNEL_OPTIONS) as channel,
    ):
        upload: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(UPLOAD_METHOD)
        for _ in range(cfg.raw_repeats):
            start = time.perf_counter()
            reply = await upload(chunks(), timeout=600)
            seconds.append(time.perf_counter() - start)
            received.append(int(reply))
    median = float(np.median(seconds))
    return {
        "update_bytes": len(data),
        "seconds": [round(s, 3) for s in seconds],
        "mb_per_s": round(len(data) / MB / median, 1),
        "checks": {"every_byte_received": received == [len(data)] * cfg.raw_repeats},
    }


# ---- the run -------------------------------------------------------------------------------------


async def run(cfg: Config, workdir: Path) -> dict[str, Any]:
    """Both parts, their baselines and the checks."""
    report: dict[str, Any] = {
        "config": asdict(cfg),
        "cpus": cpu_count(),
        "load_average_start": os.getloadavg(),
    }
    tiny = write_model_file(workdir / "tiny-model.bin", cfg.tiny_floats)
    floor = await bare_device_floor(cfg, workdir, tiny)
    runner = await runner_overhead(cfg, workdir, tiny)
    echo = await echo_round_trip(cfg, workdir, floor["report_payload_bytes"])
    rtt = echo["latency"]["p50_ms"]
    report["overhead"] = {
        "echo": echo,
        "bare_device": floor,
        "runner": runner,
        "ratios": {
            "runner_overhead_to_echo_rtt": round(runner["overhead"]["p50_ms"] / rtt, 2),
            "bare_device_task_to_echo_rtt": round(floor["per_task"]["p50_ms"] / rtt, 2),
            "runner_overhead_to_bare_device_task": round(
                runner["overhead"]["p50_ms"] / floor["per_task"]["p50_ms"], 2
            ),
            "runner_above_floor_ms": round(runner["overhead"]["p50_ms"] - floor["per_task"]["p50_ms"], 3),
        },
    }
    big = await asyncio.to_thread(write_model_file, workdir / "upload-model.bin", cfg.update_elements)
    try:
        uploads = [await runner_upload(cfg, workdir, i, big) for i in range(cfg.upload_repeats)]
    finally:
        big.path.unlink(missing_ok=True)
    raw = await raw_upload(cfg, workdir)
    runner_mb_s = float(np.median([u["report_mb_per_s"] for u in uploads]))
    report["upload"] = {
        "runner": uploads,
        "raw": raw,
        "runner_report_mb_per_s": runner_mb_s,
        "runner_upload_blob_mb_per_s": float(np.median([u["upload_blob_mb_per_s"] for u in uploads])),
        "ratio_to_raw": round(runner_mb_s / raw["mb_per_s"], 3),
        "coordinator_peak_rss_mib": max(u["coordinator_peak_rss_mib"] for u in uploads),
    }
    report["load_average_end"] = os.getloadavg()
    checks: dict[str, bool] = {}
    for name, part in (("echo", echo), ("bare_device", floor), ("runner", runner), ("raw_upload", raw)):
        checks.update({f"{name}.{k}": bool(v) for k, v in part["checks"].items()})
    for i, upload in enumerate(uploads):
        checks.update({f"upload{i}.{k}": bool(v) for k, v in upload["checks"].items()})
    report["checks"] = checks
    report["ok"] = all(checks.values())
    return report


def _line(name: str, s: dict[str, float]) -> str:
    return f"    {name:28s} p50 {s['p50_ms']:9.3f} ms  p99 {s['p99_ms']:9.3f} ms  (n={s['count']})"


def format_report(report: dict[str, Any]) -> str:
    """The figures as a few readable lines."""
    o, u = report["overhead"], report["upload"]
    echo, bare, runner, ratios = o["echo"], o["bare_device"], o["runner"], o["ratios"]
    lines = [
        f"cpus={report['cpus']} load average {report['load_average_start'][0]:.1f} at start, "
        f"{report['load_average_end'][0]:.1f} at end",
        f"bare gRPC round trip ({echo['payload_bytes']} B echo, one call in flight):",
        _line("echo", echo["latency"]),
        "bare device (GetTask + ReportResult from the stubs, prebuilt result) per task:",
        _line("GetTask → ack", bare["per_task"]),
        _line("GetTask (incl. round boundary)", bare["get_task"]),
        _line("ReportResult", bare["report"]),
        "Runner per task (no-op executor):",
        _line("GetTask → ack", runner["per_task"]),
        _line("overhead (minus executor)", runner["overhead"]),
        _line("GetTask (incl. round boundary)", runner["get_task"]),
        _line("before executor", runner["before_executor"]),
        _line("executor", runner["executor"]),
        _line("after executor", runner["after_executor"]),
        _line("report_result", runner["report"]),
        _line("  of which pending write", runner["pending_write"]),
        _line("  the rest (encode + RPC)", runner["report_minus_pending_write"]),
        _line("runner's own log duration", runner["logged_duration"]),
        f"  runner overhead = {ratios['runner_overhead_to_echo_rtt']:.1f} x echo RTT; bare device "
        f"= {ratios['bare_device_task_to_echo_rtt']:.1f} x echo RTT; runner = "
        f"{ratios['runner_overhead_to_bare_device_task']:.2f} x bare device "
        f"({ratios['runner_above_floor_ms']:+.3f} ms above it)",
    ]
    for i, up in enumerate(u["runner"]):
        lines.append(
            f"upload {i}: {up['update_bytes'] / MB:,.0f} MB report in {up['report_s']} s = "
            f"{up['report_mb_per_s']:,.1f} MB/s (blob upload {up['upload_blob_s']} s = "
            f"{up['upload_blob_mb_per_s']:,.1f} MB/s; before it {up['before_upload_s']} s incl. pending "
            f"write {up['pending_write_s']} s; after it {up['after_upload_s']} s)\n"
            f"    coordinator RSS {up['coordinator_rss_before_mib']:,.0f} → peak "
            f"{up['coordinator_peak_rss_mib']:,.0f} MiB; runner process RSS "
            f"{up['runner_process_rss_before_mib']:,.0f} → peak {up['runner_process_peak_rss_mib']:,.0f} MiB"
        )
    raw = u["raw"]
    lines.append(
        f"raw client-streaming upload: {raw['mb_per_s']:,.1f} MB/s (median of {raw['seconds']} s); "
        f"Runner report {u['runner_report_mb_per_s']:,.1f} MB/s = {u['ratio_to_raw']:.3f} x raw; "
        f"coordinator peak RSS {u['coordinator_peak_rss_mib']:,.0f} MiB"
    )
    failed = [name for name, passed in report["checks"].items() if not passed]
    lines.append("checks: all passed" if not failed else f"checks FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.runner_bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, a few seconds (the test suite runs it)"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--rounds", type=int, help="tasks of each overhead job")
    parser.add_argument("--update-mb", type=int, help="size of the uploaded update in MB (float32)")
    parser.add_argument("--upload-repeats", type=int, help="uploads by the Runner")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs and databases")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    """The quick or full sizes, then any explicit flag."""
    cfg = QUICK if args.quick else Config()
    overrides = {
        "rounds": args.rounds,
        "update_elements": args.update_mb * MB // 4 if args.update_mb else None,
        "upload_repeats": args.upload_repeats,
    }
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the figures (and writes JSON); 1 if a correctness check failed."""
    args = parse_args(argv)
    cfg = config_from(args)
    workdir = Path(tempfile.mkdtemp(prefix="fedlink-runner-bench-"))
    try:
        report = asyncio.run(run(cfg, workdir))
    finally:
        if args.keep_workdir:
            print(f"workdir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
