"""SQLite keeps datetimes as the text SQLAlchemy's DATETIME writes; fedlink's faster processors keep it."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from fedlink.server.domain import ManualClock
from fedlink.server.store import open_store
from fedlink.server.store.schema import UtcDateTime

_SQLITE = sqlite.dialect()


def _to_text(value: datetime | None) -> object:
    process = UtcDateTime().dialect_impl(_SQLITE).bind_processor(_SQLITE)
    assert process is not None
    return process(value)


def _from_text(text: object) -> object:
    process = UtcDateTime().dialect_impl(_SQLITE).result_processor(_SQLITE, None)
    assert process is not None
    return process(text)


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 11, 30, 14, 5, 6, 789012, tzinfo=UTC),
        datetime(2026, 1, 1, tzinfo=UTC),  # no microseconds: still six digits
        datetime(2026, 1, 1, 5, 30, tzinfo=timezone(timedelta(hours=2))),  # stored as UTC
        datetime(1, 1, 1, tzinfo=UTC),
    ],
)
def test_sqlite_text_is_what_sqlalchemy_datetime_writes(value: datetime) -> None:
    plain = sa.DateTime().dialect_impl(_SQLITE).bind_processor(_SQLITE)
    assert plain is not None
    text = _to_text(value)
    assert text == plain(value.astimezone(UTC).replace(tzinfo=None))
    back = _from_text(text)
    assert back == value and isinstance(back, datetime) and back.tzinfo is UTC


def test_sqlite_refuses_naive_and_reads_short_text() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        _to_text(datetime(2026, 1, 1))
    # SQLite's own CURRENT_TIMESTAMP text has no fraction.
    assert _from_text("2026-01-02 03:04:05") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert _to_text(None) is None and _from_text(None) is None


async def test_a_store_file_keeps_sortable_utc_text(tmp_path: Path) -> None:
    clock = ManualClock(datetime(2026, 3, 4, 5, 6, 7, 8, tzinfo=UTC))
    path = tmp_path / "fedlink.db"
    async with open_store(f"sqlite+aiosqlite:///{path}", clock=clock, auto_migrate=True) as store:
        device = await store.enroll_device({}, {}, "h")
        assert (await store.get_device(device.device_id)).enrolled_at == clock.now()
    with sqlite3.connect(path) as conn:
        (text,) = conn.execute("SELECT enrolled_at FROM devices").fetchone()
    assert text == "2026-03-04 05:06:07.000008"


def test_repeated_and_alternating_values_convert_right_across_threads() -> None:
    base = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
    values = [base + timedelta(microseconds=i % 7) for i in range(2_000)]

    def convert(offset: int) -> bool:
        for value in values[offset:] + values[:offset]:
            text = _to_text(value)
            if text != value.replace(tzinfo=None).isoformat(" ", "microseconds") or _from_text(text) != value:
                return False
        return True

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(convert, [0, 1, 3, 5, 0, 2, 4, 6]))
