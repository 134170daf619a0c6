"""The load process of bench/protocol_bench.py: device fleets, echo callers and model downloaders.

``python -m bench.device_load '<LoadSpec as JSON>'`` runs one mode and writes JSON lines to stdout:
``{"event": "ready", ...}`` where the parent must act (then it sends a line on stdin), and a last
``{"event": "result", ...}``. Devices speak RunnerService through the generated stubs only. All calls
share ``channels`` grpc.aio channels, each its own TCP connection (a local subchannel pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np
import uvloop

from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

T = TypeVar("T")
_CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # else channels to one target share one connection
    ("grpc.max_receive_message_length", 64 * 1024**2),
    ("grpc.max_send_message_length", 64 * 1024**2),
]
_OK = rpb.RUNNER_STATUS_OK


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """What one load process does (see the mode functions below)."""

    mode: str
    address: str
    channels: int
    devices: int = 0
    job_name: str = ""
    job_id: str = ""
    duration_s: float = 5.0
    warmup_s: float = 1.0
    payload_bytes: int = 100
    wait_s: float = 10.0
    expect_sha256: str = ""
    expect_size: int = 0
    hash_all: bool = False
    #: ``devices`` mode: the measured window starts at this acknowledgement (0: the ``devices``-th,
    #: the end of a round of every device; a FedBuff run's first fill is its selection).
    warm_acks: int = 0


@dataclass(slots=True)
class Timings:
    """Completion times and latencies of calls, by kind (e.g. ``GetTask/OK``)."""

    end: dict[str, list[float]] = field(default_factory=dict)
    latency: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)

    async def call(self, kind: str, call: Awaitable[T], status_of: Callable[[T], str] | None = None) -> T:
        """Awaits ``call``, recording its latency under ``kind`` (plus ``/status`` if given)."""
        start = time.perf_counter()
        try:
            reply = await call
        except grpc.aio.AioRpcError as exc:
            self.errors[f"{kind}/{exc.code().name}"] += 1
            raise
        now = time.perf_counter()
        key = kind if status_of is None else f"{kind}/{status_of(reply)}"
        self.end.setdefault(key, []).append(now)
        self.latency.setdefault(key, []).append(now - start)
        return reply


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    """Count, p50 and p99 in milliseconds."""
    if not latencies:
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0}
    values = np.asarray(latencies) * 1000.0
    return {
        "count": len(latencies),
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
    }


def emit(event: str, **fields: Any) -> None:
    """Writes one JSON line for the parent."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def wait_for_parent() -> str:
    """Blocks until the parent writes a line on stdin."""
    line: str = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip()


def open_channels(spec: LoadSpec) -> list[grpc.aio.Channel]:
    """``spec.channels`` channels to the server, each its own connection."""
    return [grpc.aio.insecure_channel(spec.address, options=_CHANNEL_OPTIONS) for _ in range(spec.channels)]


async def bounded_gather(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Runs the jobs with at most ``limit`` in flight, returning their results in order."""
    gate = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return await asyncio.gather(*(run(job) for job in jobs))


# ---- devices --------------------------------------------------------------------------------------------


class Device:
    """One enrolled device on a shared channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
        self.device_id = ""
        self.metadata: tuple[tuple[str, str], ...] = ()

    async def enroll(self) -> Device:
        """Enrols (open enrolment) and keeps the credential."""
        reply = await self.stub.Enroll(
            rpb.EnrollRequest(
                device_info={"platform": "bench"}, protocol_version="1.0", request_id=str(uuid.uuid4())
            )
        )
        self.device_id = reply.device_id
        self.metadata = (("authorization", f"Bearer {reply.device_credential}"),)
        return self

    async def job_id(self, name: str) -> str:
        """Asks for the named job until it is offered."""
        while True:
            reply = await self.stub.GetJob(
                rpb.GetJobRequest(job_name=name, protocol_version="1.0"), metadata=self.metadata
            )
            if reply.status == _OK:
                return reply.job_id
            await asyncio.sleep(0.2)

    def get_task(
        self, job_id: str, cookie: bytes, wait_s: float
    ) -> grpc.aio.UnaryUnaryCall[Any, rpb.GetTaskResponse]:
        """A GetTask long poll."""
        request = rpb.GetTaskRequest(job_id=job_id, cookie=cookie)
        request.wait_timeout.FromMilliseconds(int(wait_s * 1000))
        return self.stub.GetTask(request, metadata=self.metadata)


async def enroll_devices(channels: Sequence[grpc.aio.Channel], count: int) -> list[Device]:
    """Enrols ``count`` devices spread over the channels, 200 enrolments at a time."""
    jobs = [Device(channels[i % len(channels)]).enroll for i in range(count)]
    return await bounded_gather(jobs, 200)


def _status(reply: rpb.GetTaskResponse | rpb.ReportResultResponse) -> str:
    return rpb.RunnerStatus.Name(reply.status).removeprefix("RUNNER_STATUS_")


def _diff(index: int, elements: int) -> dxo_pb2.Dxo:
    diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    tensor = diff.data["w"]
    tensor.dtype = "float32"
    tensor.shape.append(elements)
    tensor.dense.data = np.full(elements, (index % 97) / 1000.0, dtype="<f4").tobytes()
    diff.meta["num_examples"].int_value = 1 + index % 10
    return diff


async def _train_loop(device: Device, index: int, spec: LoadSpec, timings: Timings, acks: list[float]) -> str:
    """GetTask → ReportResult → GetTask ... until DONE (a STALE report is counted in the timings, as a
    runner would go on after it); returns how it ended."""
    job_id = await device.job_id(spec.job_name)
    cookie = b""
    diff: dxo_pb2.Dxo | None = None
    while True:
        task = await timings.call("GetTask", device.get_task(job_id, cookie, spec.wait_s), _status)
        if task.status == rpb.RUNNER_STATUS_DONE:
            return "DONE"
        if task.status != _OK:
            cookie = task.cookie or cookie
            continue
        if diff is None:  # the model's size is known once the first task shows it
            diff = _diff(index, int(task.task_data.dxo.data["w"].shape[0]))
        request = rpb.ReportResultRequest(
            job_id=job_id,
            task_id=task.task_id,
            cookie=task.cookie,
            status=states_pb2.RESULT_STATUS_SUCCEEDED,
            request_id=str(uuid.uuid4()),
        )
        request.result.dxo.CopyFrom(diff)
        reply = await timings.call(
            "ReportResult", device.stub.ReportResult(request, metadata=device.metadata), _status
        )
        if reply.status == rpb.RUNNER_STATUS_DONE:
            return "DONE"
        if reply.status == rpb.RUNNER_STATUS_STALE:  # FedBuff: its version fell out of the history
            cookie = reply.cookie or cookie
            continue
        if reply.status != _OK:
            return f"report {_status(reply)}"
        acks.append(time.perf_counter())
        cookie = reply.cookie


def _steady_window(acks: list[float], devices: int, warm: int = 0) -> tuple[float, float, int]:
    """The measured window: from the end of round 1 (the devices-th ack, or the ``warm``-th) to the last
    ack; and the rounds of every device in it."""
    ordered = sorted(acks)
    first = warm or devices
    if len(ordered) <= first:
        return ordered[0] if ordered else 0.0, ordered[-1] if ordered else 0.0, 0
    return ordered[first - 1], ordered[-1], (len(ordered) - first) // devices


def _round_gaps(timings: Timings, acks: list[float], devices: int) -> list[float]:
    """Per round boundary: last ack of round k to the first task of round k+1 handed out.

    Every device is in every round and a round closes only when all answered, so the k-th block
    of ``devices`` acks (and of tasks) in time order is round k.
    """
    ends = sorted(acks)
    starts = sorted(timings.end.get("GetTask/OK", []))
    gaps = []
    for k in range(1, len(ends) // devices):
        if k * devices < len(starts):
            gaps.append(starts[k * devices] - ends[k * devices - 1])
    return gaps


async def run_devices(spec: LoadSpec) -> dict[str, Any]:
    """A fleet of training devices on a FedAvg job with every device in every round."""
    channels = open_channels(spec)
    devices = await enroll_devices(channels, spec.devices)
    timings, acks = Timings(), list[float]()
    outcomes = await asyncio.gather(
        *(_train_loop(d, i, spec, timings, acks) for i, d in enumerate(devices)), return_exceptions=True
    )
    start, end, rounds = _steady_window(acks, spec.devices, spec.warm_acks)
    in_window = {k: [t for t in v if start < t <= end] for k, v in timings.end.items()}
    completed = sum(len(v) for v in in_window.values())
    window = end - start
    gaps = _round_gaps(timings, acks, spec.devices)
    for channel in channels:
        await channel.close()
    return {
        "acks": len(acks),
        "outcomes": dict(Counter(o if isinstance(o, str) else repr(o) for o in outcomes)),
        "window_s": round(window, 3),
        "window": [start, end],
        "rounds_in_window": rounds,
        "acks_in_window": sum(1 for t in acks if start < t <= end),
        "completed_rpcs": completed,
        "rpcs_per_s": round(completed / window, 1) if window > 0 else 0.0,
        "rpcs_in_window": {k: len(v) for k, v in in_window.items()},
        "latency": {k: latency_summary(v) for k, v in sorted(timings.latency.items())},
        "round_gap_ms": latency_summary(gaps) | {"max_ms": round(max(gaps, default=0.0) * 1000, 1)},
        "errors": dict(timings.errors),
    }


async def run_idle(spec: LoadSpec) -> dict[str, Any]:
    """Devices that sit in GetTask long polls on a job with nothing to hand out, until told to stop."""
    channels = open_channels(spec)
    devices = await enroll_devices(channels, spec.devices)
    timings = Timings()
    in_flight = 0
    handed_out = 0
    all_waiting = asyncio.Event()

    async def poll(device: Device) -> None:
        nonlocal in_flight, handed_out
        while True:
            in_flight += 1
            if in_flight >= spec.devices:
                all_waiting.set()
            try:
                reply = await timings.call("GetTask", device.get_task(spec.job_id, b"", spec.wait_s), _status)
            except grpc.aio.AioRpcError:
                in_flight -= 1  # not waiting while it backs off
                await asyncio.sleep(1.0)  # counted in timings.errors; the parent fails the run on any
                continue
            in_flight -= 1
            if reply.status == _OK:
                handed_out += 1  # not expected: the job has no free slot
                all_waiting.set()  # the parent sees it in the result; do not wait forever
                return

    pollers = [asyncio.create_task(poll(d)) for d in devices]
    await all_waiting.wait()
    emit("ready", in_flight=in_flight)
    started = time.perf_counter()
    await wait_for_parent()
    waited = time.perf_counter() - started
    waiting_at_stop = in_flight
    for poller in pollers:
        poller.cancel()
    failures = [
        r
        for r in await asyncio.gather(*pollers, return_exceptions=True)
        if not isinstance(r, asyncio.CancelledError)
    ]
    for channel in channels:
        await channel.close()
    return {
        "in_flight_at_stop": waiting_at_stop,
        "handed_out": handed_out,
        "waited_s": round(waited, 2),
        "completed_polls": {k: len(v) for k, v in timings.end.items()},
        "failures": [repr(f) for f in failures if f is not None][:5],
        "errors": dict(timings.errors),
    }


# ---- bytes ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Received:
    size: int = 0
    sha256: str = ""
    contiguous: bool = True


async def _consume(stream: Any, hashing: bool, offsets: bool) -> _Received:
    received = _Received()
    digest = hashlib.sha256() if hashing else None
    async for message in stream:
        data = message.data if offsets else message
        if offsets and message.offset != received.size:
            received.contiguous = False
        if digest is not None:
            digest.update(data)
        received.size += len(data)
    received.sha256 = digest.hexdigest() if digest is not None else ""
    return received


def _download_report(spec: LoadSpec, received: list[_Received], wall: float) -> dict[str, Any]:
    hashed = [r for r in received if r.sha256]
    total = sum(r.size for r in received)
    return {
        "downloads": len(received),
        "bytes": total,
        "wall_s": round(wall, 3),
        "mib_per_s": round(total / 1024**2 / wall, 1) if wall > 0 else 0.0,
        "all_complete": all(r.size == spec.expect_size and r.contiguous for r in received),
        "hashed": len(hashed),
        "sha256_match": bool(hashed) and all(r.sha256 == spec.expect_sha256 for r in hashed),
    }


async def run_download(spec: LoadSpec) -> dict[str, Any]:
    """Devices each take the job's task (a blob reference) and then download the model together."""
    channels = open_channels(spec)
    devices = [await Device(channels[i % len(channels)]).enroll() for i in range(spec.devices)]
    tasks = []
    # Every device asks for the job before any waits for a task: only devices that asked are sampled,
    # and the round waits for all of them (min_devices).
    job_ids = [await device.job_id(spec.job_name) for device in devices]
    for device, job_id in zip(devices, job_ids, strict=True):
        task = await device.get_task(job_id, b"", spec.wait_s)
        while task.status != _OK:
            task = await device.get_task(job_id, b"", spec.wait_s)
        tasks.append(task)
    refs_ok = all(
        t.task_data.WhichOneof("location") == "blob" and t.task_data.blob.sha256 == spec.expect_sha256
        for t in tasks
    )
    emit("ready", blob_refs_ok=refs_ok)
    await wait_for_parent()
    start = time.perf_counter()
    received = await asyncio.gather(
        *(
            _consume(
                d.stub.DownloadBlob(
                    rpb.DownloadBlobRequest(sha256=spec.expect_sha256, max_chunk_bytes=1024 * 1024),
                    metadata=d.metadata,
                ),
                hashing=spec.hash_all or i == 0,
                offsets=True,
            )
            for i, d in enumerate(devices)
        )
    )
    report = _download_report(spec, received, time.perf_counter() - start) | {"blob_refs_ok": refs_ok}
    for channel in channels:
        await channel.close()
    return report


async def run_raw_download(spec: LoadSpec) -> dict[str, Any]:
    """The baseline: the same bytes streamed raw by the echo server to the same number of clients."""
    channels = open_channels(spec)
    calls: list[grpc.aio.UnaryStreamMultiCallable[bytes, bytes]] = [
        channels[i % len(channels)].unary_stream("/bench.Echo/Stream") for i in range(spec.devices)
    ]
    start = time.perf_counter()
    received = await asyncio.gather(
        *(_consume(call(b""), hashing=spec.hash_all or i == 0, offsets=False) for i, call in enumerate(calls))
    )
    report = _download_report(spec, received, time.perf_counter() - start)
    for channel in channels:
        await channel.close()
    return report


async def run_echo(spec: LoadSpec) -> dict[str, Any]:
    """``devices`` concurrent callers of the echo server's unary method for ``duration_s``."""
    channels = open_channels(spec)
    calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = [
        channel.unary_unary("/bench.Echo/Unary") for channel in channels
    ]
    payload = bytes(range(256))[: spec.payload_bytes]
    timings = Timings()
    measure_from = time.perf_counter() + spec.warmup_s
    stop_at = measure_from + spec.duration_s
    mismatches = 0

    async def caller(index: int) -> None:
        nonlocal mismatches
        call = calls[index % len(calls)]
        while time.perf_counter() < stop_at:
            reply = await timings.call("Echo", call(payload))
            mismatches += reply != payload

    await asyncio.gather(*(caller(i) for i in range(spec.devices)))
    ends = [t for t in timings.end.get("Echo", []) if measure_from < t <= stop_at]
    latencies = [
        lat
        for t, lat in zip(timings.end["Echo"], timings.latency["Echo"], strict=True)
        if measure_from < t <= stop_at
    ]
    for channel in channels:
        await channel.close()
    return {
        "calls": len(ends),
        "calls_per_s": round(len(ends) / spec.duration_s, 1),
        "window": [measure_from, stop_at],
        "latency": latency_summary(latencies),
        "mismatches": mismatches,
        "errors": dict(timings.errors),
    }


async def run_enroll(spec: LoadSpec) -> dict[str, Any]:
    """``devices`` enrolments (open enrolment), ``payload_bytes`` callers at once; timed from the first
    to the last reply (each enrolment a new device)."""
    channels = open_channels(spec)
    timings = Timings()

    async def enroll(index: int) -> None:
        stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channels[index % len(channels)])
        request = rpb.EnrollRequest(
            device_info={"platform": "bench"}, protocol_version="1.0", request_id=str(uuid.uuid4())
        )
        with contextlib.suppress(grpc.aio.AioRpcError):  # counted in timings.errors
            await timings.call("Enroll", stub.Enroll(request))

    start = time.perf_counter()
    await bounded_gather([functools.partial(enroll, i) for i in range(spec.devices)], spec.payload_bytes)
    wall = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    done = len(timings.latency.get("Enroll", []))
    return {
        "enrolments": done,
        "wall_s": round(wall, 3),
        "enrolments_per_s": round(done / wall, 1),
        "latency": latency_summary(timings.latency.get("Enroll", [])),
        "errors": dict(timings.errors),
    }


_MODES: dict[str, Callable[[LoadSpec], Coroutine[Any, Any, dict[str, Any]]]] = {
    "devices": run_devices,
    "enroll": run_enroll,
    "idle": run_idle,
    "download": run_download,
    "raw-download": run_raw_download,
    "echo": run_echo,
}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: one JSON argument, the LoadSpec."""
    args = sys.argv[1:] if argv is None else argv
    spec = LoadSpec(**json.loads(args[0]))
    result: dict[str, Any] = uvloop.run(_MODES[spec.mode](spec))
    emit(
        "result",
        mode=spec.mode,
        spec=dataclasses.asdict(spec),
        process_cpu_s=round(time.process_time(), 2),
        **result,
    )


if __name__ == "__main__":
    main()
