"""The collection's and the upload quota's settings: read from every source like the others, checked, and
handed to the collection loop as they are."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.core import collection_policy
from fedlink.server.services.collection import CollectionPolicy
from fedlink.server.settings import CoordinatorSettings, load_settings


def test_defaults_are_the_documented_ones(tmp_path: Path) -> None:
    s = CoordinatorSettings(data_dir=tmp_path)
    assert collection_policy(s) == CollectionPolicy(
        interval=timedelta(minutes=10),
        unused_blob_ttl=timedelta(hours=1),
        stale_upload_ttl=timedelta(hours=24),
        finished_job_events_ttl=timedelta(days=30),
        max_finished_job_events=10_000,
    )
    assert s.device_upload_quota_bytes == 4 * 1024**3


def test_environment_and_flags_are_read_with_their_units(tmp_path: Path) -> None:
    s = load_settings(
        environ={"FEDLINK_DATA_DIR": str(tmp_path), "FEDLINK_DEVICE_UPLOAD_QUOTA_BYTES": "64MiB"},
        overrides={
            "finished_job_events_ttl": "2d",
            "collection_interval": "30s",
            "max_finished_job_events": "5",
        },
    )
    assert s.device_upload_quota_bytes == 64 * 1024**2
    assert collection_policy(s).finished_job_events_ttl == timedelta(days=2)
    assert collection_policy(s).interval == timedelta(seconds=30)
    assert collection_policy(s).max_finished_job_events == 5


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"collection_interval": timedelta(0)}, "collection_interval must be positive"),
        ({"stale_upload_ttl": timedelta(0)}, "stale_upload_ttl must be positive"),
        ({"finished_job_events_ttl": timedelta(0)}, "finished_job_events_ttl must be positive"),
        (
            {"unused_blob_ttl": timedelta(minutes=4)},
            r"unused_blob_ttl \(0:04:00\) must be at least the lease",
        ),
        ({"unused_blob_ttl": timedelta(seconds=30), "lease": timedelta(seconds=10)}, "and a minute"),
        ({"device_upload_quota_bytes": 0}, "device_upload_quota_bytes must be positive"),
        ({"max_finished_job_events": 0}, "max_finished_job_events must be at least 1"),
    ],
)
def test_values_that_would_lose_data_or_spin_are_refused(
    tmp_path: Path, values: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        CoordinatorSettings(data_dir=tmp_path, **values)  # type: ignore[arg-type]
