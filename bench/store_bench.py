"""State store benchmark: claims/s and results/s on SQLite and PostgreSQL, sustained over minutes.

Each configuration (backend x workers x batch) gets a fresh database holding one job with a FedAvg
shaped workload: every device has one-slot tasks targeted at it, ``--rounds-ahead`` rounds deep.
Workers loop over their own devices: claim (one per call, or ``batch`` per ``claim_tasks`` call, as
the coordinator's batcher does), then report a SUCCEEDED result with a small payload blob ref for
every claim. A refiller in the same process creates the next round as devices get through one and
closes a finished round's tasks with one ``close_round_tasks`` call (as the FedAvg workflow does), so
the clock never stops and the open set stays bounded.

Placement: on SQLite all workers share one process and one store (the coordinator is one process,
and the store queues its SQLite writers in-process); on PostgreSQL every worker is its own process
with its own engine, so the server sees real concurrent transactions.

The baseline is plain SQLAlchemy Core: single-row INSERT transactions/s on one connection of the same
database server, with the store's engine settings. Invariants are checked at the end of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from fedlink.common.errors import FedlinkError
from fedlink.server.domain import JobState, ReportOutcome, ResultStatus
from fedlink.server.store.dialect import create_engine
from fedlink.server.store.protocol import ClaimRequest, NewJob, NewTask, ResultReport
from fedlink.server.store.sql import SqlStateStore, create_store

if __package__ in (None, ""):
    # Run as a script (``python bench/store_bench.py``): bench/ is on the path, not the checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.orphans import die_with_multiprocessing_parent

PG_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
LEASE = timedelta(minutes=30)
PAYLOAD = b"w" * 256


@dataclass(frozen=True, slots=True)
class Config:
    """One measured configuration."""

    backend: str
    workers: int
    batch: int
    duration_s: float
    window_s: float
    devices: int
    rounds_ahead: int


@dataclass(slots=True)
class Counters:
    """Shared counters one worker process adds to and the parent samples."""

    claims: Synchronized[int]
    results: Synchronized[int]
    empty: Synchronized[int]
    errors: Synchronized[int]
    closes: Synchronized[int]

    @classmethod
    def create(cls, ctx: Any) -> Counters:
        """Zeroed counters in shared memory."""
        return cls(*(ctx.Value("q", 0) for _ in range(5)))

    def snapshot(self) -> dict[str, int]:
        """The current totals."""
        return {name: int(getattr(self, name).value) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class Window:
    """Rates over one sampling window."""

    end_s: float
    claims_per_s: float
    results_per_s: float
    closes_per_s: float


@dataclass(slots=True)
class RunReport:
    """What one configuration measured."""

    backend: str
    workers: int
    batch: int
    processes: int
    devices: int
    duration_s: float
    windows: list[Window] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    invariants: dict[str, int | bool] = field(default_factory=dict)
    median_claims_per_s: float = 0.0
    median_results_per_s: float = 0.0
    claims_last_over_first: float = 0.0
    results_last_over_first: float = 0.0
    claims_vs_baseline: float = 0.0
    results_vs_baseline: float = 0.0


# ---------------------------------------------------------------- databases


@contextlib.asynccontextmanager
async def fresh_database(backend: str, *, keep: bool = False) -> AsyncIterator[str]:
    """A throwaway database URL: a temp SQLite file, or a PostgreSQL database dropped afterwards.

    With ``keep`` the database stays (a SQLite file in a kept temp folder) and its URL is printed,
    to look at the grown tables afterwards (EXPLAIN, pg_stat_user_tables).
    """
    if backend == "sqlite":
        if keep:
            url = f"sqlite+aiosqlite:///{tempfile.mkdtemp(prefix='fedlink-bench-')}/bench.db"
            yield url
            print(f"  kept {url}", flush=True)
            return
        with tempfile.TemporaryDirectory(prefix="fedlink-bench-") as tmp:
            yield f"sqlite+aiosqlite:///{tmp}/bench.db"
        return
    name = f"fedlink_bench_{uuid.uuid4().hex[:12]}"
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    admin = create_async_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield url
    finally:
        if keep:
            print(f"  kept {url}", flush=True)
        else:
            async with admin.connect() as conn:
                await conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()


async def postgres_reachable() -> bool:
    """True if the benchmark's PostgreSQL server answers."""
    engine = create_async_engine(PG_ADMIN_URL)
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))
        return True
    except (OSError, sa.exc.SQLAlchemyError):
        return False
    finally:
        await engine.dispose()


async def baseline_inserts_per_s(backend: str, seconds: float) -> float:
    """Single-row INSERT transactions/s with plain SQLAlchemy Core on one connection."""
    table = sa.Table(
        "bench_baseline",
        sa.MetaData(),
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("payload", sa.String(64), nullable=False),
    )
    async with fresh_database(backend) as url:
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(table.metadata.create_all)
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                async with engine.begin() as conn:
                    await conn.execute(table.insert().values(id=count, payload=uuid.uuid4().hex))
                count += 1
            return count / elapsed
        finally:
            await engine.dispose()


# ---------------------------------------------------------------- the workload


def device_ids(config: Config) -> list[str]:
    """The benchmark's device ids, in worker order."""
    return [f"bench-device-{i:06d}" for i in range(config.devices)]


async def prepare(url: str, config: Config) -> tuple[str, str]:
    """Create the schema, the job and its run, and enroll the devices; return (job_id, run_id)."""
    store = await create_store(url, auto_migrate=True)
    try:
        job = await store.create_job(NewJob(name="bench", spec_json="{}", job_data="{}"))
        await store.set_job_state(job.job_id, JobState.RUNNING)
        run = await store.acquire_job_run(job.job_id, owner="bench", now=datetime.now(UTC), lease=LEASE)
        for device in device_ids(config):
            await store.enroll_device(
                {"name": device}, {}, uuid.uuid4().hex + uuid.uuid4().hex, device_id=device
            )
        return job.job_id, run.run_id
    finally:
        await store.close()


class ProcessWorkload:
    """The workers of one process, and the refiller that keeps their devices' rounds coming."""

    def __init__(self, store: SqlStateStore, job_id: str, run_id: str, groups: list[list[str]], batch: int):
        self.store, self.job_id, self.run_id, self.batch = store, job_id, run_id, batch
        self.groups = groups  # one device list per worker
        # A worker's passes: the fewest claims any of its devices has made. A pass in which some
        # devices found nothing (the refiller was behind) must not count for them, or their round
        # would be closed under them and their late results recorded as stale.
        self.passes = [0] * len(groups)
        self.claims_of: dict[str, int] = {d: 0 for group in groups for d in group}
        self.rounds: dict[int, list[str]] = {}
        self.next_round = 0
        self.payload_sha = ""
        # Each process numbers its own rounds: a task name of its own keeps its round closes to its tasks.
        self.task_name = f"train-{uuid.uuid4().hex[:8]}"

    async def create_round(self) -> None:
        """Create the next round: one task targeted at each device of this process."""
        deadline = datetime.now(UTC) + timedelta(days=1)
        devices = [d for group in self.groups for d in group]
        created: list[str] = []
        for start in range(0, len(devices), 500):
            tasks = await self.store.create_tasks(
                [
                    NewTask(
                        job_id=self.job_id,
                        run_id=self.run_id,
                        round=self.next_round,
                        name=self.task_name,
                        payload_sha256=self.payload_sha,
                        deadline=deadline,
                        targets=(device,),
                    )
                    for device in devices[start : start + 500]
                ]
            )
            created.extend(t.task_id for t in tasks)
        self.rounds[self.next_round] = created
        self.next_round += 1

    async def refill(self, ahead: int, stop: Event, counters: Counters) -> None:
        """Keep ``ahead`` rounds open past the slowest worker; close rounds every worker is done with."""
        while not stop.is_set():
            slowest = min(self.passes)
            while self.next_round < slowest + ahead:
                await self.create_round()
            for round_no in sorted(r for r in self.rounds if r < slowest):
                # One statement per round, as FedAvg closes a round.
                await self.store.close_round_tasks(run_id=self.run_id, round=round_no, name=self.task_name)
                _add(counters.closes, len(self.rounds.pop(round_no)))
            await asyncio.sleep(0.02)

    async def work(self, index: int, stop: Event, counters: Counters) -> None:
        """Claim and report for this worker's devices, ``batch`` devices per store call, until stopped."""
        devices = self.groups[index]
        while not stop.is_set():
            claimed = 0
            for start in range(0, len(devices), self.batch):
                chunk = devices[start : start + self.batch]
                claimed += await self._cycle(chunk, counters)
            if claimed:
                self.passes[index] = min(self.claims_of[d] for d in devices)
            else:
                # Ahead of the refiller: a pass that found nothing must not let it close rounds not done.
                await asyncio.sleep(0.005)

    async def _cycle(self, chunk: Sequence[str], counters: Counters) -> int:
        now = datetime.now(UTC)
        if len(chunk) == 1:
            claimed = [await self.store.claim_task(chunk[0], self.job_id, now, LEASE)]
        else:
            requests = [ClaimRequest(device_id=d, job_id=self.job_id) for d in chunk]
            claimed = await self.store.claim_tasks(requests, now, LEASE)
        held = [a for a in claimed if a is not None]
        for a in held:
            self.claims_of[a.device_id] += 1
        reports = [
            ResultReport(
                assignment_id=a.assignment_id,
                device_id=a.device_id,
                status=ResultStatus.SUCCEEDED,
                payload_sha256=self.payload_sha,
                report_digest=a.assignment_id,
                request_id=uuid.uuid4().hex,
            )
            for a in held
        ]
        outcomes: list[Any] = []
        if len(reports) == 1:
            try:
                outcomes = [await self.store.record_result(reports[0], datetime.now(UTC))]
            except FedlinkError as error:
                outcomes = [error]
        elif reports:
            outcomes = list(await self.store.record_results(reports, datetime.now(UTC)))
        accepted = sum(
            1 for o in outcomes if not isinstance(o, FedlinkError) and o.outcome is ReportOutcome.ACCEPTED
        )
        _add(counters.claims, len(held))
        _add(counters.empty, len(claimed) - len(held))
        _add(counters.results, accepted)
        _add(counters.errors, len(outcomes) - accepted)
        return len(held)


def _add(value: Synchronized[int], amount: int) -> None:
    if amount:
        with value.get_lock():
            value.value += amount


def worker_process(
    url: str,
    job_id: str,
    run_id: str,
    groups: list[list[str]],
    config: Config,
    counters: Counters,
    ready: Synchronized[int],
    start: Event,
    stop: Event,
) -> None:
    """Entry point of one worker process: set up, wait for the start signal, run until stopped."""
    # A parent killed by a timeout must not leave its workers claiming tasks: they die with it.
    die_with_multiprocessing_parent()
    asyncio.run(_worker_main(url, job_id, run_id, groups, config, counters, ready, start, stop))


async def _worker_main(
    url: str,
    job_id: str,
    run_id: str,
    groups: list[list[str]],
    config: Config,
    counters: Counters,
    ready: Synchronized[int],
    start: Event,
    stop: Event,
) -> None:
    store = await create_store(url, auto_migrate=False, pool_size=len(groups) + 1)
    try:
        load = ProcessWorkload(store, job_id, run_id, groups, config.batch)
        load.payload_sha = (await store.blobs.put_bytes(PAYLOAD)).sha256
        for _ in range(config.rounds_ahead):
            await load.create_round()
        _add(ready, 1)
        await asyncio.to_thread(start.wait)
        async with asyncio.TaskGroup() as group:
            group.create_task(load.refill(config.rounds_ahead, stop, counters))
            # Every task returns once ``stop`` is set, after finishing the store call it is in.
            for index in range(len(groups)):
                group.create_task(load.work(index, stop, counters))
    finally:
        await store.close()


async def check_invariants(url: str) -> dict[str, int | bool]:
    """Count what must never happen: a slot held twice, a foreign device on a targeted task, two results."""
    queries = {
        "slots_held_twice": "SELECT count(*) FROM (SELECT task_id, slot FROM assignments"
        " WHERE state IN ('LEASED','COMPLETED') GROUP BY task_id, slot HAVING count(*) > 1) x",
        "over_slot_tasks": "SELECT count(*) FROM (SELECT a.task_id FROM assignments a JOIN tasks t"
        " ON t.task_id = a.task_id WHERE a.state IN ('LEASED','COMPLETED')"
        " GROUP BY a.task_id, t.slots HAVING count(*) > t.slots) x",
        "foreign_device_claims": "SELECT count(*) FROM assignments a JOIN tasks t ON t.task_id = a.task_id"
        " WHERE t.targeted AND NOT EXISTS (SELECT 1 FROM task_targets g"
        " WHERE g.task_id = a.task_id AND g.device_id = a.device_id)",
        "assignments_with_two_results": "SELECT count(*) FROM (SELECT assignment_id FROM results"
        " GROUP BY assignment_id HAVING count(*) > 1) x",
        "completed_without_result": "SELECT count(*) FROM assignments a WHERE a.state = 'COMPLETED'"
        " AND NOT EXISTS (SELECT 1 FROM results r WHERE r.assignment_id = a.assignment_id)",
        "results_without_completion": "SELECT count(*) FROM results r JOIN assignments a"
        " ON a.assignment_id = r.assignment_id WHERE r.accepted AND a.state <> 'COMPLETED'",
        "accepted_results": "SELECT count(*) FROM results WHERE accepted",
        "assignments": "SELECT count(*) FROM assignments",
    }
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            found: dict[str, int | bool] = {
                name: int((await conn.execute(sa.text(sql))).scalar_one()) for name, sql in queries.items()
            }
    finally:
        await engine.dispose()
    bad = ("slots_held_twice", "over_slot_tasks", "foreign_device_claims")
    found["ok"] = all(
        found[name] == 0 for name in (*bad, "assignments_with_two_results", "completed_without_result")
    )
    found["ok"] = bool(found["ok"]) and found["results_without_completion"] == 0
    return found


# ---------------------------------------------------------------- one configuration


async def run_config(config: Config, baseline: float, *, keep: bool = False) -> RunReport:
    """Measure one configuration in a fresh database and check the invariants afterwards."""
    processes = 1 if config.backend == "sqlite" else config.workers
    report = RunReport(
        backend=config.backend,
        workers=config.workers,
        batch=config.batch,
        processes=processes,
        devices=config.devices,
        duration_s=config.duration_s,
    )
    async with fresh_database(config.backend, keep=keep) as url:
        job_id, run_id = await prepare(url, config)
        devices = device_ids(config)
        per_worker = [devices[i :: config.workers] for i in range(config.workers)]
        ctx = mp.get_context("spawn")
        start, stop, ready = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        all_counters: list[Counters] = []
        procs = []
        for p in range(processes):
            groups = per_worker[p::processes]
            counters = Counters.create(ctx)
            all_counters.append(counters)
            args = (url, job_id, run_id, groups, config, counters, ready, start, stop)
            procs.append(ctx.Process(target=worker_process, args=args, daemon=True))
        for proc in procs:
            proc.start()
        try:
            while int(ready.value) < processes:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a worker process failed during setup")
                await asyncio.sleep(0.05)
            await _sample(config, report, all_counters, start)
        finally:
            stop.set()
            for proc in procs:
                await asyncio.to_thread(proc.join, 60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a worker process exited with {[p.exitcode for p in procs]}")
        report.totals = _totals(all_counters)
        report.invariants = await check_invariants(url)
    _summarise(report, baseline)
    return report


async def _sample(config: Config, report: RunReport, counters: list[Counters], start: Event) -> None:
    label = f"{config.backend:8} w={config.workers} b={config.batch:<3}"
    start.set()
    began = time.perf_counter()
    last = _totals(counters)
    n = 0
    while (n + 1) * config.window_s <= config.duration_s + 1e-9:
        n += 1
        await asyncio.sleep(max(0.0, began + n * config.window_s - time.perf_counter()))
        now = _totals(counters)
        span = config.window_s
        window = Window(
            end_s=round(n * span, 3),
            claims_per_s=(now["claims"] - last["claims"]) / span,
            results_per_s=(now["results"] - last["results"]) / span,
            closes_per_s=(now["closes"] - last["closes"]) / span,
        )
        report.windows.append(window)
        print(
            f"  {label} t={window.end_s:6.1f}s claims/s {window.claims_per_s:8.0f}"
            f"  results/s {window.results_per_s:8.0f}  closes/s {window.closes_per_s:8.0f}"
            f"  empty {now['empty']}  errors {now['errors']}",
            flush=True,
        )
        last = now


def _totals(counters: list[Counters]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters:
        for name, value in c.snapshot().items():
            total[name] = total.get(name, 0) + value
    return total


def _summarise(report: RunReport, baseline: float) -> None:
    claims = [w.claims_per_s for w in report.windows]
    results = [w.results_per_s for w in report.windows]
    report.median_claims_per_s = statistics.median(claims)
    report.median_results_per_s = statistics.median(results)
    report.claims_last_over_first = claims[-1] / claims[0] if claims[0] else 0.0
    report.results_last_over_first = results[-1] / results[0] if results[0] else 0.0
    report.claims_vs_baseline = report.median_claims_per_s / baseline
    report.results_vs_baseline = report.median_results_per_s / baseline


# ---------------------------------------------------------------- the command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite,postgres")
    parser.add_argument("--workers", default="1,8", help="comma-separated worker counts")
    parser.add_argument("--batch", default="1,64", help="comma-separated claims/reports per store call")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per configuration")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per printed rate window")
    parser.add_argument(
        "--devices", type=int, default=1024, help="devices (one targeted task each per round)"
    )
    parser.add_argument(
        "--rounds-ahead", type=int, default=2, help="open rounds kept ahead of the slowest worker"
    )
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    parser.add_argument(
        "--quick", action="store_true", help="a few seconds per configuration (the test suite)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--keep", action="store_true", help="keep each configuration's database and print its URL"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.window, args.baseline_seconds = 1.5, 0.5, 0.3
        args.devices, args.batch = 128, "1,16"
    return args


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


async def main(argv: Sequence[str] | None = None) -> int:
    """Run every configuration, print the table, write the JSON; exit 1 if an invariant broke."""
    args = parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if "postgres" in backends and not await postgres_reachable():
        if not args.quick:
            print(f"PostgreSQL at {PG_ADMIN_URL} is unreachable", file=sys.stderr)
            return 2
        print("PostgreSQL unreachable: quick mode measures SQLite only", flush=True)
        backends.remove("postgres")
    baselines: dict[str, float] = {}
    reports: list[RunReport] = []
    for backend in backends:
        baselines[backend] = await baseline_inserts_per_s(backend, args.baseline_seconds)
        print(f"{backend}: baseline {baselines[backend]:,.0f} single-row INSERT transactions/s", flush=True)
        for workers in _ints(args.workers):
            for batch in _ints(args.batch):
                devices = max(args.devices, workers * batch)
                config = Config(
                    backend, workers, batch, args.duration, args.window, devices, args.rounds_ahead
                )
                reports.append(await run_config(config, baselines[backend], keep=args.keep))
    print_table(reports, baselines)
    if args.json is not None:
        document = {
            "command": ["python", "bench/store_bench.py", *(sys.argv[1:] if argv is None else argv)],
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "baselines_insert_tx_per_s": baselines,
            "runs": [asdict(r) for r in reports],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(r.invariants.get("ok") for r in reports) else 1


def print_table(reports: Sequence[RunReport], baselines: dict[str, float]) -> None:
    """The summary: medians of the windows, their drift, and the ratio to the INSERT baseline."""
    header = (
        f"{'backend':8} {'workers':>7} {'batch':>5} {'claims/s':>9} {'results/s':>9} "
        f"{'last/first':>10} {'x baseline':>10} {'invariants':>10}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in reports:
        drift = f"{r.claims_last_over_first:.2f}/{r.results_last_over_first:.2f}"
        ratio = f"{r.claims_vs_baseline:.2f}/{r.results_vs_baseline:.2f}"
        status = "ok" if r.invariants.get("ok") else "BROKEN"
        print(
            f"{r.backend:8} {r.workers:>7} {r.batch:>5} {r.median_claims_per_s:>9,.0f} "
            f"{r.median_results_per_s:>9,.0f} {drift:>10} {ratio:>10} {status:>10}"
        )
    for backend, rate in baselines.items():
        print(
            f"baseline {backend}: {rate:,.0f} single-row INSERT transactions/s"
            " (SQLAlchemy Core, 1 connection)"
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
