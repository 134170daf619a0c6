"""Migrations go up and down on SQLite and PostgreSQL; a schema of the wrong age is refused on open."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import SchemaMismatch
from fedlink.server.cli.db import db_group
from fedlink.server.store import current_revision, downgrade, head_revision, open_store, upgrade
from fedlink.server.store.dialect import Database
from fedlink.server.store.schema import (
    assignments,
    blob_grants,
    blobs,
    jobs,
    metadata,
    results,
    round_counts,
    runs,
    task_offers,
    task_targets,
    tasks,
)
from fedlink.server.store.testing import create_pg_database, drop_pg_database

EXPECTED_TABLES = {t.name for t in metadata.sorted_tables}


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any table (a fresh one per test, on PostgreSQL too)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
        return
    admin: str = request.getfixturevalue("pg_admin_url")
    url = create_pg_database(admin, prefix="fedlink_migrate")
    try:
        yield url
    finally:
        drop_pg_database(admin, url)


async def tables(url: str) -> set[str]:
    database = Database(url)
    try:
        async with database.read() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        return set(names) - {"alembic_version"}
    finally:
        await database.dispose()


async def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    assert await current_revision(empty_url) is None
    await upgrade(empty_url)
    assert await current_revision(empty_url) == head_revision()
    assert await tables(empty_url) == EXPECTED_TABLES
    await downgrade(empty_url, "base")
    assert await current_revision(empty_url) is None
    assert await tables(empty_url) == set()
    await upgrade(empty_url, "head")
    assert await tables(empty_url) == EXPECTED_TABLES


async def test_database_newer_than_code_is_refused(empty_url: str) -> None:
    await upgrade(empty_url)
    database = Database(empty_url)

    async def stamp(conn: AsyncConnection) -> None:
        await conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))

    await database.write(stamp)
    await database.dispose()
    with pytest.raises(SchemaMismatch, match=r"newer than this fedlink \(knows up to \w+\): upgrade fedlink"):
        async with open_store(empty_url, auto_migrate=True):
            pass


async def test_older_database_needs_upgrade_unless_auto_migrate(empty_url: str) -> None:
    with pytest.raises(SchemaMismatch, match="fedlink db upgrade"):
        async with open_store(empty_url, auto_migrate=False):
            pass
    async with open_store(empty_url, auto_migrate=True) as store:
        assert len(await store.get_or_create_signing_key()) == 32
    assert await current_revision(empty_url) == head_revision()


def test_db_cli_upgrade_current_downgrade(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    runner = CliRunner()
    done = runner.invoke(db_group, ["upgrade", "--db", url])
    assert done.exit_code == 0, done.output
    assert head_revision() in done.output
    current = runner.invoke(db_group, ["current", "--db", url])
    assert f"current: {head_revision()}" in current.output
    down = runner.invoke(db_group, ["downgrade", "--db", url, "--revision", "base"])
    assert down.exit_code == 0 and "base" in down.output
    assert "current: none" in runner.invoke(db_group, ["current", "--db", url]).output


async def test_migrated_schema_matches_the_tables_the_code_declares(empty_url: str) -> None:
    await upgrade(empty_url)
    database = Database(empty_url)

    def differences(conn: sa.Connection) -> list[object]:
        return list(compare_metadata(MigrationContext.configure(conn), metadata))

    try:
        async with database.read() as conn:
            found = await conn.run_sync(differences)
    finally:
        await database.dispose()
    assert found == []


async def test_upgrade_to_0003_offers_the_targets_of_open_tasks_only(empty_url: str) -> None:
    await upgrade(empty_url, "0002_claim_lookups")
    now = datetime.now(UTC)
    database = Database(empty_url)

    async def fill(conn: AsyncConnection) -> None:
        await conn.execute(
            sa.insert(jobs).values(
                job_id="j",
                name="n",
                state="RUNNING",
                spec_json="{}",
                job_data="{}",
                device_selector="{}",
                message="",
                created_at=now,
                updated_at=now,
            )
        )
        await conn.execute(
            sa.insert(runs).values(
                run_id="r",
                job_id="j",
                state="RUNNING",
                round=0,
                metrics_json="{}",
                message="",
                created_at=now,
                updated_at=now,
            )
        )
        for task_id, state in (("open", "OPEN"), ("closed", "CLOSED")):
            await conn.execute(
                sa.insert(tasks).values(
                    task_id=task_id,
                    job_id="j",
                    run_id="r",
                    round=0,
                    name="train",
                    deadline=now,
                    slots=1,
                    targeted=True,
                    state=state,
                    created_at=now,
                )
            )
        await conn.execute(
            sa.insert(task_targets),
            [{"task_id": t, "device_id": d} for t in ("open", "closed") for d in ("d0", "d1")],
        )

    async def offers(conn: AsyncConnection) -> set[tuple[str, str, str]]:
        found = await conn.execute(
            sa.select(task_offers.c.task_id, task_offers.c.device_id, task_offers.c.job_id)
        )
        return {(t, d, j) for t, d, j in found}

    try:
        await database.write(fill)
        await upgrade(empty_url)
        async with database.read() as conn:
            assert await offers(conn) == {("open", "d0", "j"), ("open", "d1", "j")}
        await downgrade(empty_url, "0002_claim_lookups")
        assert "task_offers" not in await tables(empty_url)
    finally:
        await database.dispose()


async def test_0004_blob_grants_go_with_their_blob_and_down_leaves_the_blobs(empty_url: str) -> None:
    await upgrade(empty_url, "0003_task_offers")
    now = datetime.now(UTC)
    kept, dropped = "a" * 64, "b" * 64
    database = Database(empty_url)

    async def fill(conn: AsyncConnection) -> None:
        await conn.execute(
            sa.insert(blobs), [{"sha256": sha, "size_bytes": 1, "created_at": now} for sha in (kept, dropped)]
        )

    async def grant(conn: AsyncConnection) -> None:
        await conn.execute(
            sa.insert(blob_grants),
            [{"sha256": s, "device_id": d, "created_at": now} for s in (kept, dropped) for d in ("d0", "d1")],
        )

    async def drop(conn: AsyncConnection) -> None:
        await conn.execute(sa.delete(blobs).where(blobs.c.sha256 == dropped))

    async def grants(conn: AsyncConnection) -> set[tuple[str, str]]:
        found = await conn.execute(sa.select(blob_grants.c.sha256, blob_grants.c.device_id))
        return {(s, d) for s, d in found}

    try:
        await database.write(fill)
        await upgrade(empty_url, "0004_blob_grants")
        assert await current_revision(empty_url) == "0004_blob_grants"
        await database.write(grant)
        await database.write(drop)  # the migrated foreign key cascades, on SQLite too
        async with database.read() as conn:
            assert await grants(conn) == {(kept, "d0"), (kept, "d1")}
        await downgrade(empty_url, "0003_task_offers")
        assert "blob_grants" not in await tables(empty_url)
        async with database.read() as conn:
            assert list((await conn.execute(sa.select(blobs.c.sha256))).scalars()) == [kept]
        await upgrade(empty_url, "0004_blob_grants")
        async with database.read() as conn:
            assert await grants(conn) == set()  # blobs stored before 0004 are uploaded again to be held
    finally:
        await database.dispose()


async def test_0005_counts_the_results_already_accepted_and_goes_with_its_run(empty_url: str) -> None:
    await upgrade(empty_url, "0004_blob_grants")
    now = datetime.now(UTC)
    database = Database(empty_url)
    base = {"state": "RUNNING", "message": "", "created_at": now, "updated_at": now}
    # Round 1: two accepted train results and a failed one, one accepted evaluation; round 2: none yet.
    made = [("t1", 1, "train", True), ("t2", 1, "train", True), ("t3", 1, "train", False)]
    made += [("e1", 1, "evaluate", True), ("t4", 2, "train", False)]

    async def fill(conn: AsyncConnection) -> None:
        job = {"job_id": "j", "name": "n", "spec_json": "{}", "job_data": "{}", "device_selector": "{}"}
        await conn.execute(sa.insert(jobs).values(**job, **base))
        await conn.execute(sa.insert(runs).values(run_id="r", job_id="j", round=1, metrics_json="{}", **base))
        for task_id, round_no, name, accepted in made:
            task = {"job_id": "j", "run_id": "r", "round": round_no, "name": name, "deadline": now}
            await conn.execute(
                sa.insert(tasks).values(
                    task_id=task_id, slots=1, targeted=False, state="OPEN", created_at=now, **task
                )
            )
            await conn.execute(
                sa.insert(assignments).values(
                    assignment_id=f"a-{task_id}",
                    task_id=task_id,
                    job_id="j",
                    device_id="d",
                    slot=0,
                    state="COMPLETED" if accepted else "FAILED",
                    lease_expires_at=now,
                    created_at=now,
                )
            )
            await conn.execute(
                sa.insert(results).values(
                    result_id=f"r-{task_id}",
                    assignment_id=f"a-{task_id}",
                    task_id=task_id,
                    device_id="d",
                    status="SUCCEEDED" if accepted else "FAILED",
                    report_digest="x",
                    error_message="",
                    accepted=accepted,
                    stale=False,
                    request_id=f"q-{task_id}",
                    created_at=now,
                )
            )

    async def counts(conn: AsyncConnection) -> set[tuple[str, int, str, int, int]]:
        found = await conn.execute(sa.select(round_counts))
        return {
            (run_id, round_no, name, accepted, retries) for run_id, round_no, name, accepted, retries in found
        }

    try:
        await database.write(fill)
        await upgrade(empty_url, "0005_round_counts")
        async with database.read() as conn:
            assert await counts(conn) == {("r", 1, "train", 2, 0), ("r", 1, "evaluate", 1, 0)}
        await database.write(lambda conn: conn.execute(sa.delete(runs)))  # the migrated key cascades
        async with database.read() as conn:
            assert await counts(conn) == set()
        await downgrade(empty_url, "0004_blob_grants")
        assert "round_counts" not in await tables(empty_url)
    finally:
        await database.dispose()
