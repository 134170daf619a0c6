"""Hostile-fleet benchmark: the coordinator's health and memory while devices flood it with the worst
reports they can send, and enrolment throughput.

Run from the repository root:

    .venv/bin/python -m bench.hostile_bench [--quick] [--json out.json]

- **Flood**: a coordinator process (uvloop, SQLite) whose job over a one-tensor float32 model has
  handed a task to each of 10 devices; every device then sends, as fast as the replies come back, a
  rotation of the worst reports for its open assignment: 100,000 one-element tensors (3.2 MB), a
  47-byte sparse bfloat16 tensor declaring 2**27 elements, a well-formed update whose meta holds JSON
  nested 10,000 deep, and a dense update of the model's full size whose last value is NaN (parsed,
  decoded and checked whole before it is refused). A prober process asks the health service every
  20 ms throughout. Baseline: the same prober against the same coordinator with no traffic, just
  before. Reported: health p50/p99/max for both, the coordinator's RSS before, its peak during, and
  after (2 s after the flood), the reports answered per second, and their statuses.
- **Enrolment**: 1,000 enrolments from 64 callers at once (a load process, 16 channels) on a fresh
  coordinator with the enrolment rate limit off, three times: the median enrolments/s, against a bare
  grpc.aio echo server's calls/s at the same concurrency (measured in the same run).

A device's refused reports count against it (``fedlink.server.api.admission.RefusedBytes``: 64 MiB at
once, then 4 MiB/s): once it is in deficit, its reports get RESOURCE_EXHAUSTED with a retry_after,
unread. The flooding devices ignore the retry_after and go on as fast as they are answered.

Checks (the run fails, exit 1, if one fails): every flood report got INVALID_ARGUMENT or, unread, that
RESOURCE_EXHAUSTED (never INTERNAL, UNKNOWN or a timeout), every kind was refused for its content at
least once, the devices' assignments were still open afterwards, every prober call answered SERVING,
every enrolment succeeded. Targets (issue 14): health p99 < 100 ms under the flood,
RSS after the flood within 10 % of before, and the peak bounded by what is in flight (before + 3 ×
the model per device + 64 MiB).
``--quick`` (a 1 MiB model, 5 s of flood, 200 enrolments once) is what the test suite runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from bench import proc_stats
from bench.child_processes import LoadProcess, ServerProcess, cpu_count
from bench.coordinator_admin import FedAvgJob, admin_metadata, submit_job, upload_model, write_model_file
from bench.hostile_inputs import (
    MANY_TENSORS,
    RUNNER,
    HealthProbe,
    deep_meta,
    dense_nan,
    huge_sparse,
    many_tensors,
    outcome_of,
    raw_call,
    report_bytes,
)
from bench.protocol_bench import Config as ProtocolConfig
from bench.protocol_bench import coordinator_settings, echo_baseline
from bench.report import targets_line
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

MiB = 1024**2
KINDS = ("many_tensors", "huge_sparse", "deep_meta", "dense_nan")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The sizes of one benchmark run."""

    #: Devices flooding the coordinator, each on its own open assignment.
    devices: int = 10
    #: How long they flood.
    flood_s: float = 60.0
    #: How long the prober runs before the flood, for the baseline.
    baseline_s: float = 10.0
    #: float32 elements of the job's model (the dense report is this large: 16 MiB).
    model_floats: int = 4 * MiB
    #: Enrolments per enrolment run, and how many callers make them at once.
    enrolments: int = 1000
    enrol_callers: int = 64
    #: Enrolment runs (the median is reported).
    enrol_repeats: int = 3
    #: Channels the enrolment load process (and the echo baseline) share.
    channels: int = 16
    #: How long the echo baseline is timed.
    echo_s: float = 5.0
    #: Which parts to run.
    parts: tuple[str, ...] = ("flood", "enrolment")


QUICK = Config(
    flood_s=5.0, baseline_s=3.0, model_floats=256 * 1024, enrolments=200, enrol_repeats=1, echo_s=1.0
)

#: Issue 14's targets.
HEALTH_P99_TARGET_MS = 100.0
RSS_RETURN_TARGET = 1.10


def _settings(data_dir: Path, **extra: Any) -> list[str]:
    fields = {f.name for f in dataclasses.fields(CoordinatorSettings)}
    if "enrolments_per_minute" in fields:
        extra.setdefault("enrolments_per_minute", 0)  # the rate limit off
    return coordinator_settings(data_dir, **extra)


# ---- the flood ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Hostile:
    """One flooding device: its credential and its reports (serialized once) for its open assignment."""

    metadata: tuple[tuple[str, str], ...]
    assignment_id: str
    reports: list[tuple[str, bytes]]


async def _take_task(stub: rgrpc.RunnerServiceAsyncStub, metadata: Any, job_name: str) -> rpb.GetTaskResponse:
    while True:
        job = await stub.GetJob(
            rpb.GetJobRequest(job_name=job_name, protocol_version="1.0"), metadata=metadata
        )
        if job.status == rpb.RUNNER_STATUS_OK:
            break
        await asyncio.sleep(0.1)
    while True:
        request = rpb.GetTaskRequest(job_id=job.job_id)
        request.wait_timeout.FromSeconds(5)
        task = await stub.GetTask(request, metadata=metadata)
        if task.status == rpb.RUNNER_STATUS_OK:
            return task


async def _flood(address: str, hostile: list[_Hostile], seconds: float, rounds: int = 0) -> dict[str, Any]:
    """Every device sends its reports in turn, one at a time, until ``seconds`` are up (or, with
    ``rounds``, that many times each)."""
    outcomes: Counter[str] = Counter()
    details: dict[str, str] = {}
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 256 * MiB)]
    ) as channel:
        send = raw_call(channel, f"{RUNNER}/ReportResult")
        stop_at = time.perf_counter() + seconds

        async def device(h: _Hostile) -> None:
            i = 0
            while i < rounds * len(h.reports) if rounds else time.perf_counter() < stop_at:
                kind, data = h.reports[i % len(h.reports)]
                i += 1
                started = time.perf_counter()
                outcome = await outcome_of(send(data, metadata=h.metadata, timeout=60))
                latencies[kind].append(time.perf_counter() - started)
                outcomes[f"{kind}/{outcome.code}"] += 1
                details.setdefault(f"{kind}/{outcome.code}", outcome.details[:200])

        started = time.perf_counter()
        await asyncio.gather(*(device(h) for h in hostile))
        wall = time.perf_counter() - started
    total = sum(outcomes.values())
    return {
        "reports": total,
        "reports_per_s": round(total / wall, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "details": details,
        "latency": {kind: _ms(values) for kind, values in latencies.items()},
    }


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0, "p50_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(values)
    return {
        "count": len(values),
        "p50_ms": round(1000 * ordered[len(ordered) // 2], 2),
        "max_ms": round(1000 * ordered[-1], 2),
    }


async def flood(cfg: Config, workdir: Path) -> dict[str, Any]:
    """The flood part (see the module's docstring)."""
    model = write_model_file(workdir / "model.bin", cfg.model_floats)
    async with ServerProcess(
        "bench.coordinator_process", _settings(workdir / "flood"), workdir, "flood"
    ) as server:
        address = server.info["address"]
        admin = admin_metadata(server.info["admin_token"])
        async with grpc.aio.insecure_channel(address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
            await upload_model(control, admin, model)
            job = FedAvgJob(
                name="hostile",
                rounds=1,
                devices_per_round=cfg.devices,
                min_results=cfg.devices,
                min_devices=cfg.devices,
                round_timeout_s=3600,
            )
            job_id = await submit_job(control, admin, model.sha256, job)
            payloads = {
                "many_tensors": many_tensors(MANY_TENSORS),
                "huge_sparse": huge_sparse(),
                "deep_meta": deep_meta((cfg.model_floats,)),
                "dense_nan": dense_nan(cfg.model_floats),
            }
            credentials = []
            for _ in range(cfg.devices):
                enrolled = await stub.Enroll(
                    rpb.EnrollRequest(
                        device_info={"role": "hostile"}, protocol_version="1.0", request_id=_uuid()
                    )
                )
                credentials.append((("authorization", f"Bearer {enrolled.device_credential}"),))
            tasks = await asyncio.gather(*(_take_task(stub, md, job.name) for md in credentials))
            hostile = [
                _Hostile(
                    metadata=md,
                    assignment_id=task.assignment_id,
                    reports=[
                        (kind, report_bytes(job_id, task.task_id, task.cookie, payloads[kind]))
                        for kind in KINDS
                    ],
                )
                for md, task in zip(credentials, tasks, strict=True)
            ]
            del payloads
            pid = server.pid
            # Each kind once first: what its first refusal allocates for good (code paths, caches) is no
            # part of what the flood leaves behind.
            await _flood(address, hostile[:1], 0.0, rounds=1)
            async with HealthProbe(address, workdir, name="baseline-prober") as baseline:
                await asyncio.sleep(cfg.baseline_s)
            rss_before = proc_stats.memory_use(pid).rss_bytes
            async with (
                proc_stats.RssWatch(pid) as watch,
                HealthProbe(address, workdir, name="flood-prober") as probe,
            ):
                result = await _flood(address, hostile, cfg.flood_s)
            await asyncio.sleep(2.0)
            rss_after = proc_stats.memory_use(pid).rss_bytes
            # The devices' assignments are still theirs: nothing was recorded for them.
            still_open = 0
            for h in hostile:
                request = rpb.GetTaskRequest(job_id=job_id)
                request.wait_timeout.FromMilliseconds(100)
                again = await _when_read_again(stub.GetTask, request, h.metadata)
                still_open += again.assignment_id == h.assignment_id
    model.path.unlink(missing_ok=True)
    refused = {f"{kind}/INVALID_ARGUMENT" for kind in KINDS}
    allowed = refused | {f"{kind}/RESOURCE_EXHAUSTED" for kind in KINDS}
    throttled = [d for key, d in result["details"].items() if key.endswith("/RESOURCE_EXHAUSTED")]
    result.update(
        devices=cfg.devices,
        model_bytes=model.size_bytes,
        health_baseline=baseline.result,
        health_flood=probe.result,
        rss_before_mib=round(rss_before / MiB, 1),
        rss_peak_mib=round(watch.max_rss_bytes / MiB, 1),
        rss_after_mib=round(rss_after / MiB, 1),
        assignments_still_open=still_open,
    )
    result["checks"] = {
        "every_report_refused_or_throttled": set(result["outcomes"]) <= allowed,
        "every_kind_refused_for_its_content": refused <= set(result["outcomes"]),
        "throttled_with_a_reason": all("refused lately" in d for d in throttled),
        "assignments_still_open": still_open == cfg.devices,
        "health_always_serving": not baseline.result["failures"] and not probe.result["failures"],
    }
    return result


async def _when_read_again(method: Any, request: Any, metadata: Any) -> Any:
    """The call's reply, waiting out the RESOURCE_EXHAUSTED a device gets after its refused reports."""
    for _ in range(120):
        try:
            return await method(request, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(0.5)
    raise RuntimeError("the device was never read again")


def _uuid() -> str:
    import uuid

    return str(uuid.uuid4())


# ---- enrolment ----------------------------------------------------------------------------------------


async def enrolment(cfg: Config, workdir: Path) -> dict[str, Any]:
    """The enrolment part (see the module's docstring)."""
    echo = await echo_baseline(
        ProtocolConfig(devices=cfg.enrol_callers, channels=cfg.channels, echo_seconds=cfg.echo_s), workdir
    )
    runs: list[dict[str, Any]] = []
    for repeat in range(cfg.enrol_repeats):
        name = f"enrol-{repeat}"
        async with ServerProcess(
            "bench.coordinator_process", _settings(workdir / name), workdir, name
        ) as server:
            spec = {
                "mode": "enroll",
                "address": server.info["address"],
                "channels": cfg.channels,
                "devices": cfg.enrolments,
                "payload_bytes": cfg.enrol_callers,  # the enroll mode's concurrency
            }
            async with LoadProcess(spec, workdir, f"{name}-load") as load:
                runs.append(await load.event("result", timeout_s=600))
    rates = [r["enrolments_per_s"] for r in runs]
    median = statistics.median(rates)
    return {
        "enrolments": cfg.enrolments,
        "callers": cfg.enrol_callers,
        "enrolments_per_s": rates,
        "median_enrolments_per_s": median,
        "echo_calls_per_s": echo["calls_per_s"],
        "ratio_to_echo": round(median / echo["calls_per_s"], 3) if echo["calls_per_s"] else None,
        "latency": runs[len(runs) // 2]["latency"],
        "checks": {
            "every_enrolment_succeeded": all(
                r["enrolments"] == cfg.enrolments and not r["errors"] for r in runs
            )
        },
    }


# ---- the report ---------------------------------------------------------------------------------------


def targets(report: dict[str, Any]) -> dict[str, bool | None]:
    """Which of issue 14's targets the figures meet (None: not measured)."""
    met: dict[str, bool | None] = dict.fromkeys(
        ("health_p99_under_100ms", "rss_returns_within_10pct", "rss_bounded")
    )
    f = report.get("flood")
    if f is not None:
        met["health_p99_under_100ms"] = f["health_flood"]["p99_ms"] < HEALTH_P99_TARGET_MS
        met["rss_returns_within_10pct"] = f["rss_after_mib"] <= RSS_RETURN_TARGET * f["rss_before_mib"]
        # Each device has one report in flight, held at most three times over (grpc's buffer, the
        # bytes handed to the coordinator, what is parsed of them).
        bound = f["rss_before_mib"] * MiB + f["devices"] * 3 * f["model_bytes"] + 64 * MiB
        met["rss_bounded"] = f["rss_peak_mib"] * MiB < bound
    return met


async def run(cfg: Config, workdir: Path) -> dict[str, Any]:
    """Runs the parts; the report with checks and targets."""
    report: dict[str, Any] = {"config": asdict(cfg), "cpus": cpu_count()}
    if "flood" in cfg.parts:
        report["flood"] = await flood(cfg, workdir)
    if "enrolment" in cfg.parts:
        report["enrolment"] = await enrolment(cfg, workdir)
    report["checks"] = {
        f"{part}.{name}": bool(passed)
        for part in ("flood", "enrolment")
        if part in report
        for name, passed in report[part]["checks"].items()
    }
    report["ok"] = all(report["checks"].values())
    report["targets"] = targets(report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The figures as a few readable lines."""
    lines = [f"cpus={report['cpus']}"]
    if "flood" in report:
        f = report["flood"]
        b, h = f["health_baseline"], f["health_flood"]
        lines.append(
            f"flood: {f['devices']} devices, {f['reports']:,} worst-case reports in "
            f"{report['config']['flood_s']:g} s ({f['reports_per_s']:,.1f}/s), "
            f"model {f['model_bytes'] / MiB:.1f} MiB"
        )
        lines.append(
            f"    health under flood: p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms "
            f"({h['count']} probes, {h['slow']} over 100 ms)"
        )
        lines.append(
            f"    health baseline (no load): p50 {b['p50_ms']} ms, p99 {b['p99_ms']} ms, "
            f"max {b['max_ms']} ms ({b['count']} probes)"
        )
        lines.append(
            f"    coordinator RSS: before {f['rss_before_mib']} MiB, peak {f['rss_peak_mib']} MiB, "
            f"2 s after {f['rss_after_mib']} MiB"
        )
        for kind, lat in f["latency"].items():
            lines.append(
                f"    {kind:14s} n={lat['count']:6d}  "
                f"reply p50 {lat['p50_ms']:8.2f} ms  max {lat['max_ms']:8.2f} ms"
            )
        lines.append(f"    statuses: {f['outcomes']}")
    if "enrolment" in report:
        e = report["enrolment"]
        lines.append(
            f"enrolment: median {e['median_enrolments_per_s']:,.0f} enrolments/s ({e['enrolments']} by "
            f"{e['callers']} callers; runs {e['enrolments_per_s']}) = {e['ratio_to_echo']} x echo "
            f"({e['echo_calls_per_s']:,.0f} calls/s); "
            f"p50 {e['latency']['p50_ms']} ms, p99 {e['latency']['p99_ms']} ms"
        )
    lines.append(targets_line(report["targets"]))
    failed = [name for name, passed in report["checks"].items() if not passed]
    lines.append("checks: all passed" if not failed else f"checks FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.hostile_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (what the test suite runs)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--parts", default="flood,enrolment", help="comma-separated subset of flood,enrolment"
    )
    parser.add_argument("--flood-s", type=float, help="seconds of flood")
    parser.add_argument("--model-mib", type=float, help="size of the model in MiB")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs and databases")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the figures (and writes JSON); 1 if a check failed."""
    args = parse_args(argv)
    cfg = QUICK if args.quick else Config()
    cfg = replace(cfg, parts=tuple(p for p in args.parts.split(",") if p))
    if args.flood_s is not None:
        cfg = replace(cfg, flood_s=args.flood_s)
    if args.model_mib is not None:
        cfg = replace(cfg, model_floats=int(args.model_mib * MiB) // 4)
    workdir = Path(tempfile.mkdtemp(prefix="fedlink-hostile-bench-"))
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
