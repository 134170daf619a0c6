"""Replicas on one PostgreSQL: coordinator CPU per device RPC for one and for two replicas, and model
delivery from blobs in PostgreSQL against the file store (issue 17).

Every coordinator is a ``bench.coordinator_process`` (the benches' stand-in for ``fedlink serve``, on
uvloop) with its own data directory, a fresh PostgreSQL database of the bench's own (made on
``--pg-url``'s server, dropped at the end), blob bytes in that database and one admin token shared by the
replicas. Run from the repository root:

    .venv/bin/python -m bench.replica_bench [--quick] [--json out.json] [--pg-url URL] [--repeats N]

- **CPU per device RPC.** ``protocol_bench``'s throughput workload (every device in every round of a
  FedAvg job; the window runs from the end of round 1 to the last acknowledgement) on one replica, then
  with the devices split over two replicas serving the same job: half enrol, poll and report on each, and
  the channels are split too, so the fleet keeps the same concurrency. Replica 0 drives the job (it is
  RUNNING before replica 1 starts); results reported to replica 1 reach its driver at its next read of
  the store. The CPU of every replica, each in the window of the devices it served, is summed and divided
  by the RPCs those devices completed in it. Beside them, the bare grpc.aio echo server's CPU per call
  with as many callers (``protocol_bench.echo_baseline``). Each repeat measures the three, the two
  coordinator layouts in alternating order; ratios are taken within a repeat, and medians printed.
- **Model delivery.** A model (one float32 tensor, 1 GiB) uploaded to a coordinator goes to 10 devices as
  a blob reference, which they download together: from chunk rows in PostgreSQL, and from the file store
  (the same PostgreSQL, blob bytes under the data directory).

``--quick`` (100 devices, a 16 MiB model to 3 devices) is what the test suite runs. The run fails (exit 1)
if a correctness check failed: every acknowledged result counted once, the job finished with every device
told DONE, no RPC error, downloads complete and sha256-identical (every download is hashed up to 64 MiB,
one of them above, unless ``--hash-every-download``). Speed is printed and judged on the ``targets`` line,
never a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from bench import proc_stats
from bench.child_processes import LoadProcess, Profiler, ServerProcess, cpu_count
from bench.coordinator_admin import (
    FedAvgJob,
    Metadata,
    ModelFile,
    abort_job,
    admin_metadata,
    job_outcome,
    submit_job,
    upload_model,
    write_model_file,
)
from bench.protocol_bench import Config, control_channel, coordinator_settings, echo_baseline
from bench.report import num, targets_line
from fedlink.server.store.testing import create_pg_database, drop_pg_database
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import states_pb2

DEFAULT_PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
MiB = 1024**2
#: Above this size one download per run is hashed, as in protocol_bench: hashing 10 GiB in the load
#: process would measure its sha256, not the coordinator.
HASH_ALL_UP_TO_BYTES = 64 * MiB

#: The sizes of the full run: protocol_bench's (1,000 devices, 5 rounds, 16 channels, 1 GiB to 10).
FULL = Config(postgres_url=DEFAULT_PG_URL, parts=())
QUICK = replace(
    FULL, devices=100, rounds=3, channels=4, echo_seconds=1.0, big_model_elements=4 * MiB, downloaders=3
)


@contextlib.asynccontextmanager
async def fresh_database(admin_url: str, prefix: str) -> AsyncIterator[str]:
    """An empty database on ``admin_url``'s server for one measurement (dropped after it); yields the
    URL the coordinators use (the asyncpg driver, whatever ``admin_url`` names)."""
    url = await asyncio.to_thread(create_pg_database, admin_url, prefix)
    try:
        yield make_url(url).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    finally:
        await asyncio.to_thread(drop_pg_database, admin_url, url)


def replica_settings(data_dir: Path, db_url: str, admin_token: str, **extra: Any) -> list[str]:
    """protocol_bench's coordinator settings on a shared database, blobs in it, and the shared token."""
    return coordinator_settings(data_dir, db_url, admin_token=admin_token, blobs_in_database=True, **extra)


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal shares, the larger ones first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def until_running(control: cgrpc.ControlServiceAsyncStub, admin: Metadata, job_id: str) -> None:
    """Waits until the job is RUNNING: a coordinator has taken the lease on its run."""
    async with asyncio.timeout(120):
        while True:
            request = cpb.DescribeJobRequest(job_id=job_id)
            if (await control.DescribeJob(request, metadata=admin)).job.state == states_pb2.JOB_STATE_RUNNING:
                return
            await asyncio.sleep(0.05)


# ---- 1. CPU per device RPC ---------------------------------------------------------------------------


async def replica_throughput(cfg: Config, workdir: Path, db_url: str, replicas: int) -> dict[str, Any]:
    """``cfg.devices`` devices on a FedAvg job, split over ``replicas`` coordinators on one database."""
    tag = f"replicas-{replicas}"
    model = write_model_file(workdir / "small-model.bin", cfg.model_floats)
    job = FedAvgJob(
        name=tag,
        rounds=cfg.rounds,
        devices_per_round=cfg.devices,
        min_results=cfg.devices,
        min_devices=cfg.devices,
        round_timeout_s=600,
    )
    token = secrets.token_urlsafe(24)
    admin = admin_metadata(token)

    def server(i: int) -> ServerProcess:
        args = replica_settings(workdir / f"{tag}-{i}", db_url, token, auto_migrate=i == 0)
        return ServerProcess("bench.coordinator_process", args, workdir, f"{tag}-{i}")

    async with contextlib.AsyncExitStack() as servers:
        driver = await servers.enter_async_context(server(0))
        control = await servers.enter_async_context(control_channel(driver.info["address"]))
        await upload_model(control, admin, model)
        job_id = await submit_job(control, admin, model.sha256, job)
        await until_running(control, admin, job_id)  # replica 0 drives: no other replica is up yet
        coordinators = [driver] + [await servers.enter_async_context(server(i)) for i in range(1, replicas)]
        shares = split(cfg.devices, replicas)
        channels = split(max(cfg.channels, replicas), replicas)
        async with contextlib.AsyncExitStack() as measuring:
            for i, coord in enumerate(coordinators):
                await measuring.enter_async_context(Profiler(cfg.profile_dir, coord.pid, f"{tag}-{i}"))
            traces = [
                await measuring.enter_async_context(proc_stats.CpuTrace(coord.pid)) for coord in coordinators
            ]
            loads = [
                await measuring.enter_async_context(
                    LoadProcess(
                        {
                            "mode": "devices",
                            "address": coord.info["address"],
                            "channels": channels[i],
                            "devices": shares[i],
                            "job_name": job.name,
                            "wait_s": 20.0,
                        },
                        workdir,
                        f"{tag}-devices-{i}",
                    )
                )
                for i, coord in enumerate(coordinators)
            ]
            served = await asyncio.gather(
                *(load.event("result", timeout_s=60 + cfg.rounds * 120) for load in loads)
            )
            cpu_s = [trace.between(*share["window"]) for trace, share in zip(traces, served, strict=True)]
        outcome = await job_outcome(control, admin, job_id)
    return (
        _throughput_figures(cfg, replicas, served, cpu_s)
        | {"job": asdict(outcome)}
        | {
            "checks": _throughput_checks(
                cfg, served, outcome.state, outcome.current_round, outcome.round_results
            )
        }
    )


def _throughput_figures(
    cfg: Config, replicas: int, served: Sequence[dict[str, Any]], cpu_s: Sequence[float]
) -> dict[str, Any]:
    """The fleet's figures from each share's (its devices' window, RPCs, and its replica's CPU in it)."""
    rpcs = sum(share["completed_rpcs"] for share in served)
    start, end = min(s["window"][0] for s in served), max(s["window"][1] for s in served)
    return {
        "replicas": replicas,
        "devices": [share["spec"]["devices"] for share in served],
        "completed_rpcs": rpcs,
        "window_s": round(end - start, 3),
        "rpcs_per_s": round(rpcs / (end - start), 1) if end > start else None,
        "coordinator_cpu_ms_per_rpc": round(1000 * sum(cpu_s) / rpcs, 3) if rpcs else None,
        # Each replica's CPU per RPC of the whole fleet: these add up to the figure above.
        "replica_cpu_ms_per_rpc": [round(1000 * c / rpcs, 3) if rpcs else None for c in cpu_s],
        "acks": sum(share["acks"] for share in served),
        "shares": list(served),
    }


def _throughput_checks(
    cfg: Config,
    served: Sequence[dict[str, Any]],
    state: str,
    current_round: int,
    round_results: tuple[int, ...],
) -> dict[str, bool]:
    outcomes: Counter[str] = Counter()
    for share in served:
        outcomes.update(share["outcomes"])
    acks = sum(share["acks"] for share in served)
    return {
        "job_finished": state == "JOB_STATE_FINISHED" and current_round == cfg.rounds,
        "every_round_closed_with_every_device": round_results == (cfg.devices,) * cfg.rounds,
        "every_acknowledged_result_counted": acks == sum(round_results) == cfg.devices * cfg.rounds,
        "every_device_saw_done": dict(outcomes) == {"DONE": cfg.devices},
        "every_replica_measured_the_rounds": all(s["rounds_in_window"] == cfg.rounds - 1 for s in served),
        "no_rpc_errors": not any(share["errors"] for share in served),
    }


async def cpu_per_rpc(cfg: Config, workdir: Path, repeat: int) -> dict[str, Any]:
    """One repeat: the echo server, then one and two replicas (in turns first), each on a fresh database."""
    assert cfg.postgres_url is not None
    measured: dict[str, Any] = {"echo": await echo_baseline(cfg, workdir)}
    for replicas in (1, 2) if repeat % 2 == 0 else (2, 1):
        async with fresh_database(cfg.postgres_url, "fedlink_replica_bench") as db_url:
            measured[f"replicas_{replicas}"] = await replica_throughput(cfg, workdir, db_url, replicas)
    echo_ms = measured["echo"].get("server_cpu_ms_per_call")
    one_ms = measured["replicas_1"]["coordinator_cpu_ms_per_rpc"]
    two_ms = measured["replicas_2"]["coordinator_cpu_ms_per_rpc"]
    measured["one_to_echo"] = _ratio(one_ms, echo_ms)
    measured["two_to_one"] = _ratio(two_ms, one_ms)
    return measured


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---- 2. model delivery -------------------------------------------------------------------------------


async def blob_delivery(
    cfg: Config, workdir: Path, model: ModelFile, db_url: str, *, in_database: bool, hash_all: bool
) -> dict[str, Any]:
    """Devices take a task whose model is a blob reference, then download it together."""
    name = "postgres-blobs" if in_database else "file-store"
    job = FedAvgJob(
        name=name,
        rounds=1,
        devices_per_round=cfg.downloaders,
        min_results=cfg.downloaders,
        min_devices=cfg.downloaders,
        round_timeout_s=3600,
    )
    token = secrets.token_urlsafe(24)
    admin = admin_metadata(token)
    data_dir = workdir / name
    args = coordinator_settings(data_dir, db_url, admin_token=token, blobs_in_database=in_database)
    try:
        async with (
            ServerProcess("bench.coordinator_process", args, workdir, name) as coord,
            control_channel(coord.info["address"]) as control,
        ):
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
                "hash_all": hash_all or model.size_bytes <= HASH_ALL_UP_TO_BYTES,
            }
            async with LoadProcess(spec, workdir, f"{name}-downloaders") as load:
                ready = await load.event("ready", timeout_s=600)
                cpu_before = proc_stats.cpu_seconds(coord.pid)
                async with Profiler(cfg.profile_dir, coord.pid, name):
                    load.send("go")
                    result = await load.event("result", timeout_s=1800)
                result["coordinator_cpu_s"] = round(proc_stats.cpu_seconds(coord.pid) - cpu_before, 2)
            result["cleanup"] = await abort_job(control, admin, job_id)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)  # a file store's copy of the model
    result |= {
        "model_bytes": model.size_bytes,
        "upload_s": round(upload_s, 2),
        "blobs_in_database": in_database,
    }
    result["checks"] = {
        "tasks_carried_blob_refs": bool(ready["blob_refs_ok"]),
        "downloads_complete": bool(result["all_complete"]) and result["downloads"] == cfg.downloaders,
        "downloaded_sha256_matched": bool(result["sha256_match"]),
    }
    return result


async def deliveries(
    cfg: Config, workdir: Path, model: ModelFile, repeat: int, hash_all: bool
) -> dict[str, Any]:
    """One repeat: the model from the file store and from PostgreSQL (in turns first), fresh databases."""
    assert cfg.postgres_url is not None
    measured: dict[str, Any] = {}
    for in_database in (False, True) if repeat % 2 == 0 else (True, False):
        async with fresh_database(cfg.postgres_url, "fedlink_replica_bench") as db_url:
            key = "postgres_blobs" if in_database else "file_store"
            measured[key] = await blob_delivery(
                cfg, workdir, model, db_url, in_database=in_database, hash_all=hash_all
            )
    measured["postgres_to_file"] = _ratio(
        measured["postgres_blobs"]["mib_per_s"], measured["file_store"]["mib_per_s"]
    )
    return measured


# ---- the run -----------------------------------------------------------------------------------------

#: Issue 17's targets.
ONE_REPLICA_TO_ECHO_TARGET = 2.5
TWO_TO_ONE_REPLICA_TARGET = 1.25
POSTGRES_TO_FILE_DELIVERY_TARGET = 0.5


def median(values: Iterable[object]) -> float | None:
    """The median of the numbers among ``values`` (None where a run did not give one); None if none."""
    numbers = [v for v in values if isinstance(v, int | float)]
    return round(statistics.median(numbers), 3) if numbers else None


def summary(report: dict[str, Any]) -> dict[str, float | None]:
    """The medians over the repeats of every printed figure and ratio."""
    cpu, delivery = report.get("cpu_per_rpc", []), report.get("delivery", [])
    figures = {
        "echo_cpu_ms_per_call": median(r["echo"].get("server_cpu_ms_per_call") for r in cpu),
        "echo_calls_per_s": median(r["echo"]["calls_per_s"] for r in cpu),
        "one_to_echo": median(r["one_to_echo"] for r in cpu),
        "two_to_one": median(r["two_to_one"] for r in cpu),
        "postgres_to_file": median(r["postgres_to_file"] for r in delivery),
    }
    for replicas in (1, 2):
        runs = [r[f"replicas_{replicas}"] for r in cpu]
        figures[f"replicas_{replicas}_cpu_ms_per_rpc"] = median(r["coordinator_cpu_ms_per_rpc"] for r in runs)
        figures[f"replicas_{replicas}_rpcs_per_s"] = median(r["rpcs_per_s"] for r in runs)
    for key in ("file_store", "postgres_blobs"):
        figures[f"{key}_wall_s"] = median(r[key]["wall_s"] for r in delivery)
        figures[f"{key}_mib_per_s"] = median(r[key]["mib_per_s"] for r in delivery)
    return figures


def targets(medians: dict[str, float | None]) -> dict[str, bool | None]:
    """Which of issue 17's targets the medians meet (None: not measured)."""

    def judged(value: float | None, met: bool) -> bool | None:
        return None if value is None else met

    one, two, delivery = (
        medians.get("one_to_echo"),
        medians.get("two_to_one"),
        medians.get("postgres_to_file"),
    )
    return {
        "one_replica_cpu_within_2.5x_echo": judged(
            one, one is not None and one <= ONE_REPLICA_TO_ECHO_TARGET
        ),
        "two_replicas_cpu_within_1.25x_one": judged(
            two, two is not None and two <= TWO_TO_ONE_REPLICA_TARGET
        ),
        "postgres_blobs_delivery_half_of_file": judged(
            delivery, delivery is not None and delivery >= POSTGRES_TO_FILE_DELIVERY_TARGET
        ),
    }


def all_checks(report: dict[str, Any]) -> dict[str, bool]:
    """Every correctness check of every measurement, by name."""
    checks: dict[str, bool] = {}
    for i, measured in enumerate(report.get("cpu_per_rpc", []), 1):
        echo = measured["echo"]
        checks[f"repeat{i}.echo.replies_matched"] = echo["mismatches"] == 0 and not echo["errors"]
        for replicas in (1, 2):
            for name, passed in measured[f"replicas_{replicas}"]["checks"].items():
                checks[f"repeat{i}.replicas_{replicas}.{name}"] = bool(passed)
    for i, measured in enumerate(report.get("delivery", []), 1):
        for key in ("file_store", "postgres_blobs"):
            for name, passed in measured[key]["checks"].items():
                checks[f"repeat{i}.delivery.{key}.{name}"] = bool(passed)
    return checks


def _save_partial(report: dict[str, Any], path: Path | None) -> None:
    # A 10-minute run should not lose its finished parts to a failure in a later one.
    if path is not None:
        path.with_suffix(".partial.json").write_text(json.dumps(report, indent=2, sort_keys=True))


async def run(
    cfg: Config, workdir: Path, *, repeats: int, hash_all: bool = False, partial: Path | None = None
) -> dict[str, Any]:
    """Both parts, ``repeats`` times each; every figure, median, check and target verdict."""
    assert cfg.postgres_url is not None
    pg_url = make_url(cfg.postgres_url).render_as_string(hide_password=True)
    report: dict[str, Any] = {
        "config": {
            "devices": cfg.devices,
            "rounds": cfg.rounds,
            "channels": cfg.channels,
            "model_floats": cfg.model_floats,
            "echo_seconds": cfg.echo_seconds,
            "model_bytes_big": cfg.big_model_elements * 4,
            "downloaders": cfg.downloaders,
            "repeats": repeats,
            "pg_url": pg_url,
        },
        "cpus": cpu_count(),
        "cpu_per_rpc": [],
        "delivery": [],
    }
    for repeat in range(repeats):
        report["cpu_per_rpc"].append(await cpu_per_rpc(cfg, workdir, repeat))
        _save_partial(report, partial)
    model = await asyncio.to_thread(write_model_file, workdir / "big-model.bin", cfg.big_model_elements)
    try:
        for repeat in range(repeats):
            report["delivery"].append(await deliveries(cfg, workdir, model, repeat, hash_all))
            _save_partial(report, partial)
    finally:
        model.path.unlink(missing_ok=True)
    report["medians"] = summary(report)
    report["checks"] = all_checks(report)
    report["ok"] = all(report["checks"].values())
    report["targets"] = targets(report["medians"])
    return report


def format_report(report: dict[str, Any]) -> str:
    """The figures as a few readable lines (medians over the repeats, then each repeat)."""
    c, m = report["config"], report["medians"]
    lines = [
        f"cpus={report['cpus']}; {c['devices']:,} devices x {c['rounds']} rounds on PostgreSQL, "
        f"{c['repeats']} repeat(s): medians",
        f"echo server:   {num(m['echo_cpu_ms_per_call'], '.3f')} ms CPU per call, "
        f"{num(m['echo_calls_per_s'], ',.0f')} calls/s at {c['devices']:,} in flight",
        f"one replica:   {num(m['replicas_1_cpu_ms_per_rpc'], '.3f')} ms CPU per device RPC "
        f"= {num(m['one_to_echo'], '.2f')} x echo; {num(m['replicas_1_rpcs_per_s'], ',.0f')} RPC/s",
        f"two replicas:  {num(m['replicas_2_cpu_ms_per_rpc'], '.3f')} ms CPU per device RPC, summed "
        f"= {num(m['two_to_one'], '.2f')} x one replica; {num(m['replicas_2_rpcs_per_s'], ',.0f')} RPC/s",
    ]
    for i, r in enumerate(report["cpu_per_rpc"], 1):
        one, two = r["replicas_1"], r["replicas_2"]
        parts = " + ".join(num(v, ".3f") for v in two["replica_cpu_ms_per_rpc"])
        lines.append(
            f"    repeat {i}: echo {num(r['echo'].get('server_cpu_ms_per_call'), '.3f')} ms, "
            f"one {num(one['coordinator_cpu_ms_per_rpc'], '.3f')} ms ({num(r['one_to_echo'], '.2f')} x), "
            f"two {num(two['coordinator_cpu_ms_per_rpc'], '.3f')} ms = {parts} (driver + other; "
            f"{num(r['two_to_one'], '.2f')} x one); RPC/s {num(one['rpcs_per_s'], ',.0f')} / "
            f"{num(two['rpcs_per_s'], ',.0f')}; round gap p50 {one['shares'][0]['round_gap_ms']['p50_ms']} / "
            f"{two['shares'][0]['round_gap_ms']['p50_ms']} ms"
        )
    lines.append(
        f"model delivery, {c['model_bytes_big'] / MiB:,.0f} MiB to {c['downloaders']} devices: file store "
        f"{num(m['file_store_wall_s'], '.2f')} s = {num(m['file_store_mib_per_s'], ',.0f')} MiB/s; "
        f"PostgreSQL blobs {num(m['postgres_blobs_wall_s'], '.2f')} s = "
        f"{num(m['postgres_blobs_mib_per_s'], ',.0f')} MiB/s; = {num(m['postgres_to_file'], '.2f')} x file"
    )
    for i, r in enumerate(report["delivery"], 1):
        f, p = r["file_store"], r["postgres_blobs"]
        lines.append(
            f"    repeat {i}: file {f['wall_s']} s (upload {f['upload_s']} s, coordinator CPU "
            f"{f['coordinator_cpu_s']} s), PostgreSQL {p['wall_s']} s (upload {p['upload_s']} s, "
            f"CPU {p['coordinator_cpu_s']} s), {num(r['postgres_to_file'], '.2f')} x; "
            f"hashed {f['hashed']} / {p['hashed']} of {p['downloads']}"
        )
    lines.append(targets_line(report["targets"]))
    failed = [name for name, passed in report["checks"].items() if not passed]
    lines.append("checks: all passed" if not failed else f"checks FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench.replica_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (what the tests run)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("FEDLINK_BENCH_PG_URL", DEFAULT_PG_URL),
        help="a database on the PostgreSQL server where the bench makes (and drops) its own "
        "(env FEDLINK_BENCH_PG_URL)",
    )
    parser.add_argument("--repeats", type=int, help="repeats of each measurement (default 3; --quick: 1)")
    parser.add_argument("--devices", type=int, help="devices in the throughput runs")
    parser.add_argument("--rounds", type=int, help="rounds of the throughput job")
    parser.add_argument("--model-mib", type=int, help="size of the delivered model in MiB")
    parser.add_argument("--downloaders", type=int, help="devices downloading the model")
    parser.add_argument(
        "--hash-every-download", action="store_true", help="hash every download, not one, above 64 MiB"
    )
    parser.add_argument("--profile", type=Path, help="py-spy every coordinator into DIR")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    """The run's sizes: the quick or full defaults, then any explicit flag."""
    cfg = replace(QUICK if args.quick else FULL, postgres_url=args.pg_url, profile_dir=args.profile)
    overrides = {
        "devices": args.devices,
        "rounds": args.rounds,
        "downloaders": args.downloaders,
        "big_model_elements": args.model_mib * MiB // 4 if args.model_mib else None,
    }
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def _reachable(admin_url: str) -> str | None:
    """None if a database can be made (and dropped) on ``admin_url``'s server, else why not."""
    import asyncpg

    try:
        drop_pg_database(admin_url, create_pg_database(admin_url, "fedlink_replica_bench"))
    except (OSError, asyncpg.PostgresError) as exc:
        return f"PostgreSQL at {make_url(admin_url).render_as_string(hide_password=True)}: {exc!r}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the figures (and writes JSON); 1 if a correctness check failed."""
    args = parse_args(argv)
    cfg = config_from(args)
    repeats = args.repeats or (1 if args.quick else 3)
    assert cfg.postgres_url is not None
    unreachable = _reachable(cfg.postgres_url)
    if unreachable is not None:
        raise SystemExit(f"this benchmark needs PostgreSQL: {unreachable}")
    workdir = Path(tempfile.mkdtemp(prefix="fedlink-replica-bench-"))
    try:
        report = asyncio.run(
            run(cfg, workdir, repeats=repeats, hash_all=args.hash_every_download, partial=args.json)
        )
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
