"""Coordinator benchmark: device-protocol throughput, model delivery and idle long polls vs bare gRPC.

Each figure is measured next to a bare grpc.aio baseline in the same run, with the same process layout
(server process on uvloop, one load process sharing a bounded number of channels), because shared
machines are noisy: the ratios are the figures to read. Run from the repository root:

    .venv/bin/python -m bench.protocol_bench [--quick] [--json out.json] [--parts throughput,download,idle]

``--quick`` (50 devices, a 4 MB model, 200 long polls) is what the test suite runs. The run fails
(exit 1) if one of its correctness checks failed: every acknowledged result counted, the job
finished, downloads complete and sha256-identical, no task handed out to an idle poller, no RPC error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from bench import proc_stats
from bench.child_processes import LoadProcess, Profiler, ServerProcess, cpu_count, raise_open_files_limit
from bench.coordinator_admin import (
    FedAvgJob,
    ModelFile,
    abort_job,
    admin_metadata,
    job_outcome,
    submit_job,
    upload_model,
    write_model_file,
)
from bench.device_load import Device
from bench.report import targets_line
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import runner_service_pb2 as rpb

DEFAULT_PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
PARTS = ("throughput", "download", "idle")
MiB = 1024**2


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The sizes of one benchmark run."""

    #: Devices in the throughput run; all of them take part in every round.
    devices: int = 1000
    #: FedAvg rounds of the throughput job (round 1 is warm-up; rounds 2.. are measured).
    rounds: int = 5
    #: grpc.aio channels the load process shares among its devices (and the echo callers).
    channels: int = 16
    #: Floats in the throughput job's model.
    model_floats: int = 100
    #: How long the echo baseline is timed.
    echo_seconds: float = 5.0
    #: float32 elements of the large model (256M: 1 GiB).
    big_model_elements: int = 256 * MiB
    #: Devices downloading the large model at once.
    downloaders: int = 10
    #: Devices in idle long polls.
    idle_devices: int = 10_000
    #: Load processes the idle devices are spread over.
    idle_processes: int = 2
    #: Window over which the coordinator's CPU is measured while devices wait.
    idle_window_s: float = 10.0
    #: The long-poll wait devices ask for (the coordinator's max_task_wait is 30 s).
    idle_wait_s: float = 30.0
    #: PostgreSQL server (maintenance database URL); None skips the PostgreSQL throughput run.
    postgres_url: str | None = DEFAULT_PG_URL
    #: Which parts to run.
    parts: tuple[str, ...] = PARTS
    #: Where py-spy writes coordinator profiles (throughput, download and idle runs); None: none.
    profile_dir: Path | None = None


QUICK = Config(
    devices=50,
    rounds=3,
    channels=4,
    echo_seconds=1.0,
    big_model_elements=MiB,
    idle_devices=200,
    idle_processes=1,
    idle_window_s=2.0,
)


def coordinator_settings(data_dir: Path, db_url: str = "", **extra: Any) -> list[str]:
    """Arguments of bench.coordinator_process: long leases, no offline sweeps during the run."""
    settings = {
        "data_dir": str(data_dir),
        "db_url": db_url,
        "auto_migrate": True,
        "lease": 3600,
        "max_task_wait": 30,
        "default_task_wait": 20,
        "device_offline_after": 3600,
        # Thousands of devices enrol at once: the enrolment rate limit is not what is measured.
        "enrolments_per_minute": 0,
        "log_level": "WARNING",
    } | extra
    return ["--settings", json.dumps(settings)]


@contextlib.asynccontextmanager
async def control_channel(address: str) -> Any:
    """A channel and ControlService stub to the coordinator."""
    async with grpc.aio.insecure_channel(address) as channel:
        yield cgrpc.ControlServiceStub(channel)


# ---- 1. throughput -------------------------------------------------------------------------------


async def echo_baseline(cfg: Config, workdir: Path) -> dict[str, Any]:
    """calls/s of a bare grpc.aio echo server at the devices' concurrency, ~100-byte payloads."""
    async with ServerProcess("bench.echo_server", [], workdir, "echo") as server:
        spec = {
            "mode": "echo",
            "address": server.info["address"],
            "channels": cfg.channels,
            "devices": cfg.devices,
            "duration_s": cfg.echo_seconds,
            "payload_bytes": 100,
        }
        async with proc_stats.CpuTrace(server.pid) as cpu, LoadProcess(spec, workdir, "echo-load") as load:
            before = proc_stats.cpu_seconds(server.pid)
            result = await load.event("result", timeout_s=cfg.echo_seconds + 120)
            result["server_cpu_s"] = round(proc_stats.cpu_seconds(server.pid) - before, 2)
    result["server_cpu_ms_per_call"] = _cpu_ms_per_call(cpu, result["window"], result["calls"])
    return result


def _cpu_ms_per_call(cpu: proc_stats.CpuTrace, window: list[float], calls: int) -> float | None:
    """CPU milliseconds the server spent per call completed within the window."""
    return round(1000 * cpu.between(*window) / calls, 3) if calls else None


async def device_throughput(cfg: Config, workdir: Path, backend: str, db_url: str) -> dict[str, Any]:
    """1,000 devices training on a FedAvg job with every device in every round."""
    data_dir = workdir / f"coordinator-{backend}"
    model = write_model_file(workdir / "small-model.bin", cfg.model_floats)
    job = FedAvgJob(
        name=f"throughput-{backend}",
        rounds=cfg.rounds,
        devices_per_round=cfg.devices,
        min_results=cfg.devices,
        min_devices=cfg.devices,
        round_timeout_s=600,
    )
    args = coordinator_settings(data_dir, db_url)
    async with ServerProcess("bench.coordinator_process", args, workdir, f"coordinator-{backend}") as coord:
        admin = admin_metadata(coord.info["admin_token"])
        async with control_channel(coord.info["address"]) as control:
            await upload_model(control, admin, model)
            job_id = await submit_job(control, admin, model.sha256, job)
            spec = {
                "mode": "devices",
                "address": coord.info["address"],
                "channels": cfg.channels,
                "devices": cfg.devices,
                "job_name": job.name,
                "wait_s": 20.0,
            }
            cpu_before = proc_stats.cpu_seconds(coord.pid)
            async with (
                Profiler(cfg.profile_dir, coord.pid, f"coordinator-{backend}"),
                proc_stats.CpuTrace(coord.pid) as cpu,
                LoadProcess(spec, workdir, f"devices-{backend}") as load,
            ):
                result = await load.event("result", timeout_s=60 + cfg.rounds * 120)
            result["coordinator_cpu_ms_per_rpc"] = _cpu_ms_per_call(
                cpu, result["window"], result["completed_rpcs"]
            )
            result["coordinator_cpu_s"] = round(proc_stats.cpu_seconds(coord.pid) - cpu_before, 2)
            result["coordinator_peak_rss_mib"] = round(proc_stats.memory_use(coord.pid).peak_bytes / MiB, 1)
            outcome = await job_outcome(control, admin, job_id)
    result["job"] = asdict(outcome)
    expected = cfg.devices * cfg.rounds
    result["checks"] = {
        "job_finished": outcome.state == "JOB_STATE_FINISHED" and outcome.current_round == cfg.rounds,
        "every_round_closed_with_every_device": outcome.round_results == (cfg.devices,) * cfg.rounds,
        "every_acknowledged_result_counted": result["acks"] == sum(outcome.round_results) == expected,
        "every_device_saw_done": result["outcomes"] == {"DONE": cfg.devices},
        "no_rpc_errors": not result["errors"],
    }
    return result


# ---- 2. large model ------------------------------------------------------------------------------


async def model_delivery(cfg: Config, workdir: Path, model: ModelFile) -> dict[str, Any]:
    """Devices take a task whose model is a blob reference and download it together."""
    job = FedAvgJob(
        name="delivery",
        rounds=1,
        devices_per_round=cfg.downloaders,
        min_results=cfg.downloaders,
        min_devices=cfg.downloaders,
        round_timeout_s=3600,
    )
    args = coordinator_settings(workdir / "coordinator-delivery")
    hash_all = model.size_bytes <= 64 * MiB  # hashing 10 GiB would measure the client's sha256, not gRPC
    async with ServerProcess("bench.coordinator_process", args, workdir, "coordinator-delivery") as coord:
        admin = admin_metadata(coord.info["admin_token"])
        async with control_channel(coord.info["address"]) as control:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await upload_model(control, admin, model)
            upload_s = loop.time() - started
            job_id = await submit_job(control, admin, model.sha256, job)
            spec = {
                "mode": "download",
                "address": coord.info["address"],
                "channels": cfg.downloaders,
                "devices": cfg.downloaders,
                "job_name": job.name,
                "expect_sha256": model.sha256,
                "expect_size": model.size_bytes,
                "hash_all": hash_all,
            }
            async with LoadProcess(spec, workdir, "downloaders") as load:
                ready = await load.event("ready", timeout_s=600)
                before = proc_stats.memory_use(coord.pid)  # its peak so far: upload, submission, round start
                proc_stats.reset_peak(coord.pid)
                async with (
                    Profiler(cfg.profile_dir, coord.pid, "coordinator-delivery"),
                    proc_stats.RssWatch(coord.pid) as watch,
                ):
                    load.send("go")
                    result = await load.event("result", timeout_s=1800)
                after = proc_stats.memory_use(coord.pid)
            cleanup = await abort_job(control, admin, job_id)
    result |= {
        "cleanup": cleanup,
        "model_bytes": model.size_bytes,
        "upload_s": round(upload_s, 2),
        "coordinator_rss_before_download_mib": round(before.rss_bytes / MiB, 1),
        "coordinator_peak_before_download_mib": round(before.peak_bytes / MiB, 1),
        "coordinator_peak_during_download_mib": round(max(after.peak_bytes, watch.max_rss_bytes) / MiB, 1),
    }
    result["checks"] = {
        "tasks_carried_blob_refs": bool(ready["blob_refs_ok"]),
        "downloads_complete": bool(result["all_complete"]) and result["downloads"] == cfg.downloaders,
        "downloaded_sha256_matched": bool(result["sha256_match"]),
    }
    return result


async def raw_delivery(cfg: Config, workdir: Path, model: ModelFile) -> dict[str, Any]:
    """The same bytes streamed by a bare grpc.aio server in 1 MiB chunks to as many clients."""
    args = ["--stream-file", str(model.path)]
    async with ServerProcess("bench.echo_server", args, workdir, "raw-stream") as server:
        spec = {
            "mode": "raw-download",
            "address": server.info["address"],
            "channels": cfg.downloaders,
            "devices": cfg.downloaders,
            "expect_sha256": model.sha256,
            "expect_size": model.size_bytes,
            "hash_all": model.size_bytes <= 64 * MiB,
        }
        async with LoadProcess(spec, workdir, "raw-downloaders") as load:
            result = await load.event("result", timeout_s=1800)
            result["server_peak_rss_mib"] = round(proc_stats.memory_use(server.pid).peak_bytes / MiB, 1)
    result["checks"] = {
        "downloads_complete": bool(result["all_complete"]),
        "downloaded_sha256_matched": bool(result["sha256_match"]),
    }
    return result


# ---- 3. idle long polls --------------------------------------------------------------------------


async def _take_the_only_slot(address: str, job_name: str) -> None:
    """Enrols one device and takes the job's single task, so every other poller waits."""
    async with grpc.aio.insecure_channel(address) as channel:
        device = await Device(channel).enroll()
        job_id = await device.job_id(job_name)
        while (await device.get_task(job_id, b"", 5.0)).status != rpb.RUNNER_STATUS_OK:
            pass


async def _admission_settled(pid: int, *, limit_s: float, busy_percent: float = 25.0) -> float:
    """Seconds until the coordinator used under ``busy_percent`` of a core for 1 s (``limit_s`` at most)."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if await proc_stats.cpu_percent(pid, 1.0) < busy_percent:
            break
    return time.perf_counter() - started


async def idle_polls(cfg: Config, workdir: Path) -> dict[str, Any]:
    """Devices waiting in GetTask on a job whose only slot is taken; the coordinator's CPU and RSS."""
    model = write_model_file(workdir / "small-model.bin", cfg.model_floats)
    job = FedAvgJob(
        name="idle", rounds=1, devices_per_round=1, min_results=1, min_devices=1, round_timeout_s=3600
    )
    args = coordinator_settings(workdir / "coordinator-idle")
    async with ServerProcess("bench.coordinator_process", args, workdir, "coordinator-idle") as coord:
        address = coord.info["address"]
        admin = admin_metadata(coord.info["admin_token"])
        async with control_channel(address) as control:
            await upload_model(control, admin, model)
            job_id = await submit_job(control, admin, model.sha256, job)
            await _take_the_only_slot(address, job.name)
            quiet_cpu = await proc_stats.cpu_percent(coord.pid, min(cfg.idle_window_s, 5.0))
            quiet_rss = proc_stats.memory_use(coord.pid).rss_bytes
            per_process = -(-cfg.idle_devices // cfg.idle_processes)
            specs = [
                {
                    "mode": "idle",
                    "address": address,
                    "channels": max(1, cfg.channels // cfg.idle_processes),
                    "devices": min(per_process, cfg.idle_devices - i * per_process),
                    "job_id": job_id,
                    "wait_s": cfg.idle_wait_s,
                }
                for i in range(cfg.idle_processes)
            ]
            async with contextlib.AsyncExitStack() as stack:
                loads = [
                    await stack.enter_async_context(LoadProcess(spec, workdir, f"idle-{i}"))
                    for i, spec in enumerate(specs)
                ]
                ready = [await load.event("ready", timeout_s=600) for load in loads]
                # "ready" means every poll was sent, not that the coordinator has taken it in: admitting
                # 10,000 polls (authentication, a claim check each) takes seconds of its CPU. The idle
                # window starts once that is over (or after the poll's own wait, whichever is first).
                admitted_after = await _admission_settled(coord.pid, limit_s=cfg.idle_wait_s * 0.6)
                rss_start = proc_stats.memory_use(coord.pid).rss_bytes
                async with Profiler(cfg.profile_dir, coord.pid, "coordinator-idle"):
                    cpu = await proc_stats.cpu_percent(coord.pid, cfg.idle_window_s)
                memory = proc_stats.memory_use(coord.pid)
                for load in loads:
                    load.send("stop")
                results = [await load.event("result", timeout_s=120) for load in loads]
            cleanup = await abort_job(control, admin, job_id)
    polls: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in results:
        for key, count in r["completed_polls"].items():
            polls[key] = polls.get(key, 0) + count
        for key, count in r["errors"].items():
            errors[key] = errors.get(key, 0) + count
    waiting = sum(r["in_flight_at_stop"] for r in results)
    return {
        "devices": cfg.idle_devices,
        "waiting_at_start": sum(r["in_flight"] for r in ready),
        "waiting_at_stop": waiting,
        "window_s": cfg.idle_window_s,
        "admission_s": round(admitted_after, 1),
        "coordinator_cpu_percent": round(cpu, 1),
        "coordinator_rss_mib": round(memory.rss_bytes / MiB, 1),
        "coordinator_rss_at_window_start_mib": round(rss_start / MiB, 1),
        "coordinator_peak_rss_mib": round(memory.peak_bytes / MiB, 1),
        "without_pollers": {"cpu_percent": round(quiet_cpu, 1), "rss_mib": round(quiet_rss / MiB, 1)},
        "completed_polls": polls,
        "errors": errors,
        "load_cpu_s": [r["process_cpu_s"] for r in results],
        "cleanup": cleanup,
        "checks": {
            "every_device_waiting": waiting == cfg.idle_devices,
            "nothing_handed_out": sum(r["handed_out"] for r in results) == 0,
            "no_rpc_errors": not errors,
        },
    }


# ---- the run -------------------------------------------------------------------------------------


async def _postgres_throughput(cfg: Config, workdir: Path) -> dict[str, Any]:
    from fedlink.server.store.testing import create_pg_database, drop_pg_database

    assert cfg.postgres_url is not None
    try:
        url = await asyncio.to_thread(create_pg_database, cfg.postgres_url, "fedlink_bench")
    except Exception as exc:  # any failure to reach the server skips this part, saying why
        return {"skipped": f"PostgreSQL at {cfg.postgres_url} unreachable: {exc!r}"}
    try:
        return await device_throughput(cfg, workdir, "postgres", url)
    finally:
        await asyncio.to_thread(drop_pg_database, cfg.postgres_url, url)


def _save_partial(report: dict[str, Any], path: Path | None) -> None:
    # A 20-minute run should not lose its finished parts to a failure in a later one.
    if path is not None:
        path.with_suffix(".partial.json").write_text(json.dumps(report, indent=2, sort_keys=True))


async def run(cfg: Config, workdir: Path, partial: Path | None = None) -> dict[str, Any]:
    """Runs the chosen parts and returns every figure, ratio and check."""
    report: dict[str, Any] = {
        "config": asdict(cfg) | {"profile_dir": str(cfg.profile_dir)},
        "cpus": cpu_count(),
    }
    report["open_files_limit"] = raise_open_files_limit(
        2 * cfg.idle_devices // max(1, cfg.idle_processes) + 4096
    )
    if "throughput" in cfg.parts:
        echo = await echo_baseline(cfg, workdir)
        runs = {"sqlite": await device_throughput(cfg, workdir, "sqlite", "")}
        if cfg.postgres_url is not None:
            runs["postgres"] = await _postgres_throughput(cfg, workdir)
        for result in runs.values():
            if "rpcs_per_s" in result:
                result["ratio_to_echo"] = round(result["rpcs_per_s"] / echo["calls_per_s"], 3)
                if result.get("coordinator_cpu_ms_per_rpc") and echo.get("server_cpu_ms_per_call"):
                    result["cpu_per_rpc_to_echo"] = round(
                        result["coordinator_cpu_ms_per_rpc"] / echo["server_cpu_ms_per_call"], 2
                    )
        report["throughput"] = {"echo": echo, **runs}
        _save_partial(report, partial)
    if "download" in cfg.parts:
        model = await asyncio.to_thread(write_model_file, workdir / "big-model.bin", cfg.big_model_elements)
        try:
            coordinator = await model_delivery(cfg, workdir, model)
            raw = await raw_delivery(cfg, workdir, model)
        finally:
            model.path.unlink(missing_ok=True)
            shutil.rmtree(workdir / "coordinator-delivery", ignore_errors=True)
        coordinator["ratio_to_raw"] = round(coordinator["mib_per_s"] / raw["mib_per_s"], 3)
        coordinator["peak_to_model_size"] = round(
            coordinator["coordinator_peak_during_download_mib"] * MiB / model.size_bytes, 2
        )
        report["download"] = {"coordinator": coordinator, "raw": raw}
        _save_partial(report, partial)
    if "idle" in cfg.parts:
        report["idle"] = await idle_polls(cfg, workdir)
    report["checks"] = _all_checks(report)
    report["ok"] = all(report["checks"].values())
    report["targets"] = targets(report)
    return report


#: Issue 3's targets.
THROUGHPUT_RATIO_TARGET = 0.5
DELIVERY_RATIO_TARGET = 0.5
PEAK_TO_MODEL_TARGET = 2.0
#: Below this model size the coordinator's own baseline memory (~100 MiB) dominates: not judged.
MEMORY_JUDGED_FROM_BYTES = 256 * MiB


def targets(report: dict[str, Any]) -> dict[str, bool | None]:
    """Which of issue 3's targets the figures meet (None: not measured, or too small to judge)."""
    met: dict[str, bool | None] = dict.fromkeys(
        ("throughput_half_of_echo", "delivery_half_of_raw", "peak_memory_under_2x_model")
    )
    measured = [r["ratio_to_echo"] for r in report.get("throughput", {}).values() if "ratio_to_echo" in r]
    if measured:
        met["throughput_half_of_echo"] = min(measured) >= THROUGHPUT_RATIO_TARGET
    if "download" in report:
        c = report["download"]["coordinator"]
        met["delivery_half_of_raw"] = c["ratio_to_raw"] >= DELIVERY_RATIO_TARGET
        if c["model_bytes"] >= MEMORY_JUDGED_FROM_BYTES:
            # The whole run's peak: the upload, the round's start and the downloads.
            peak = max(c["coordinator_peak_before_download_mib"], c["coordinator_peak_during_download_mib"])
            met["peak_memory_under_2x_model"] = peak * MiB < PEAK_TO_MODEL_TARGET * c["model_bytes"]
    return met


def _all_checks(report: dict[str, Any]) -> dict[str, bool]:
    checks: dict[str, bool] = {}

    def collect(prefix: str, part: dict[str, Any]) -> None:
        for name, passed in part.get("checks", {}).items():
            checks[f"{prefix}.{name}"] = bool(passed)

    for backend, result in report.get("throughput", {}).items():
        collect(f"throughput.{backend}", result)
    if "throughput" in report:
        echo = report["throughput"]["echo"]
        checks["throughput.echo.replies_matched"] = echo["mismatches"] == 0 and not echo["errors"]
    for side, result in report.get("download", {}).items():
        collect(f"download.{side}", result)
    if "idle" in report:
        collect("idle", report["idle"])
    return checks


def format_report(report: dict[str, Any]) -> str:
    """The figures as a few readable lines."""
    lines = [f"cpus={report['cpus']}"]
    if "throughput" in report:
        echo = report["throughput"]["echo"]
        lat = echo["latency"]
        lines.append(
            f"echo baseline: {echo['calls_per_s']:,.0f} calls/s at {report['config']['devices']} in flight "
            f"(p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms); server CPU "
            f"{echo['server_cpu_ms_per_call']} ms per call"
        )
        for backend in ("sqlite", "postgres"):
            r = report["throughput"].get(backend)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"{backend}: skipped ({r['skipped']})")
                continue
            lines.append(
                f"{backend}: {r['rpcs_per_s']:,.0f} device RPCs/s over rounds 2..{r['job']['current_round']} "
                f"= {r['ratio_to_echo']:.2f} x echo; round close gap p50 {r['round_gap_ms']['p50_ms']} ms; "
                f"coordinator CPU {r['coordinator_cpu_s']} s, load CPU {r['process_cpu_s']} s"
            )
            lines.append(
                f"    coordinator CPU {r['coordinator_cpu_ms_per_rpc']} ms per device RPC in rounds "
                f"2..{r['job']['current_round']} = {r.get('cpu_per_rpc_to_echo')} x the echo server's "
                "per call"
            )
            for kind, lat in r["latency"].items():
                lines.append(
                    f"    {kind:20s} n={lat['count']:7d}  "
                    f"p50 {lat['p50_ms']:9.2f} ms  p99 {lat['p99_ms']:9.2f} ms"
                )
    if "download" in report:
        c, raw = report["download"]["coordinator"], report["download"]["raw"]
        lines.append(
            f"model delivery: {c['model_bytes'] / MiB:,.0f} MiB to {c['downloads']} devices "
            f"in {c['wall_s']} s = "
            f"{c['mib_per_s']:,.0f} MiB/s vs raw stream {raw['mib_per_s']:,.0f} MiB/s ({raw['wall_s']} s) "
            f"= {c['ratio_to_raw']:.2f} x raw"
        )
        lines.append(
            f"    coordinator peak RSS during download {c['coordinator_peak_during_download_mib']:,.0f} MiB "
            f"= {c['peak_to_model_size']:.2f} x model; before it (upload, submission, round start) "
            f"{c['coordinator_peak_before_download_mib']:,.0f} MiB; upload took {c['upload_s']} s"
        )
    if "idle" in report:
        i = report["idle"]
        lines.append(
            f"idle long polls: {i['waiting_at_stop']:,} waiting (taken in after {i['admission_s']} s): "
            f"coordinator CPU {i['coordinator_cpu_percent']}% "
            f"of a core over {i['window_s']} s, RSS {i['coordinator_rss_mib']:,.0f} MiB "
            f"(no pollers: {i['without_pollers']['cpu_percent']}%, "
            f"{i['without_pollers']['rss_mib']:,.0f} MiB); "
            f"polls answered in the window: {i['completed_polls']}"
        )
    lines.append(targets_line(report["targets"]))
    failed = [name for name, passed in report["checks"].items() if not passed]
    lines.append("checks: all passed" if not failed else f"checks FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.protocol_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (what the test suite runs)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--devices", type=int, help="devices in the throughput run")
    parser.add_argument("--rounds", type=int, help="rounds of the throughput job")
    parser.add_argument("--channels", type=int, help="channels the load process shares")
    parser.add_argument("--idle-devices", type=int, help="devices in idle long polls")
    parser.add_argument("--model-mib", type=int, help="size of the large model in MiB")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("FEDLINK_BENCH_PG_URL", DEFAULT_PG_URL),
        help="PostgreSQL maintenance database URL; 'none' to skip (env FEDLINK_BENCH_PG_URL)",
    )
    parser.add_argument(
        "--profile", type=Path, help="py-spy the coordinator (throughput, download, idle) into DIR"
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs and databases")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    """The run's sizes: the quick or full defaults, then any explicit flag."""
    cfg = QUICK if args.quick else Config()
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))}")
    postgres_url = None if args.postgres == "none" else args.postgres
    cfg = replace(cfg, parts=parts, postgres_url=postgres_url, profile_dir=args.profile)
    overrides = {
        "devices": args.devices,
        "rounds": args.rounds,
        "channels": args.channels,
        "idle_devices": args.idle_devices,
        "big_model_elements": args.model_mib * MiB // 4 if args.model_mib else None,
    }
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the figures (and writes JSON); 1 if a correctness check failed."""
    args = parse_args(argv)
    cfg = config_from(args)
    workdir = Path(tempfile.mkdtemp(prefix="fedlink-protocol-bench-"))
    try:
        report = asyncio.run(run(cfg, workdir, args.json))
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
