"""Telemetry: RPC and domain metrics on a registry of their own, scraped over real HTTP."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedlink.common.errors import InvalidArgument
from fedlink.common.version import __version__
from fedlink.server.domain.states import DeviceState, JobState
from fedlink.server.telemetry import RPC_DURATION_BUCKETS, MetricsServer, Telemetry

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def endpoint() -> Iterator[tuple[Telemetry, MetricsServer]]:
    telemetry = Telemetry()
    server = telemetry.start_http_server("127.0.0.1:0")
    yield telemetry, server
    server.stop()


def _scrape(server: MetricsServer) -> Samples:
    with urllib.request.urlopen(server.url, timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return _samples(response.read().decode())


def test_rpc_calls_are_counted_and_timed_over_http(endpoint: tuple[Telemetry, MetricsServer]) -> None:
    telemetry, server = endpoint
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
    telemetry.observe("RunnerService", "GetTask", grpc.StatusCode.OK, 0.0004)
    telemetry.observe("RunnerService", "GetTask", grpc.StatusCode.OK, 25.0)
    telemetry.observe("RunnerService", "GetTask", grpc.StatusCode.UNAUTHENTICATED, 0.002)
    telemetry.observe("ControlService", "SubmitJob", grpc.StatusCode.INVALID_ARGUMENT, 0.03)

    samples = _scrape(server)
    requests = "fedlink_rpc_requests_total"
    assert _value(samples, requests, service="RunnerService", method="GetTask", code="OK") == 2
    assert _value(samples, requests, service="RunnerService", method="GetTask", code="UNAUTHENTICATED") == 1
    assert (
        _value(samples, requests, service="ControlService", method="SubmitJob", code="INVALID_ARGUMENT") == 1
    )
    duration = "fedlink_rpc_duration_seconds"
    get_task = {"service": "RunnerService", "method": "GetTask"}
    assert _value(samples, f"{duration}_count", **get_task) == 3
    assert _value(samples, f"{duration}_sum", **get_task) == pytest.approx(25.0024)
    assert _value(samples, f"{duration}_bucket", le="0.0005", **get_task) == 1
    assert _value(samples, f"{duration}_bucket", le="0.0025", **get_task) == 2
    assert _value(samples, f"{duration}_bucket", le="20.0", **get_task) == 2
    assert _value(samples, f"{duration}_bucket", le="30.0", **get_task) == 3
    buckets = {
        float(dict(labels)["le"])
        for name, labels in samples
        if name == f"{duration}_bucket" and dict(labels)["method"] == "GetTask"
    }
    assert buckets == {*RPC_DURATION_BUCKETS, float("inf")}


def test_domain_gauges_and_result_counter(endpoint: tuple[Telemetry, MetricsServer]) -> None:
    telemetry, server = endpoint
    samples = _scrape(server)
    assert _value(samples, "fedlink_devices", state="ONLINE") == 0  # present before the first event
    assert _value(samples, "fedlink_results_total", outcome="accepted") == 0

    telemetry.set_devices({DeviceState.ONLINE: 7, "OFFLINE": 2})
    telemetry.set_jobs({JobState.RUNNING: 1, JobState.FINISHED: 4})
    telemetry.set_round("job-a", 3, results=1)
    telemetry.set_round_results("job-a", 5)
    telemetry.set_round("job-b", 1)
    for outcome in ("accepted", "accepted", "stale", "rejected"):
        telemetry.count_result(outcome)

    samples = _scrape(server)
    assert _value(samples, "fedlink_devices", state="ONLINE") == 7
    assert _value(samples, "fedlink_devices", state="OFFLINE") == 2
    assert _value(samples, "fedlink_devices", state="REVOKED") == 0
    assert _value(samples, "fedlink_jobs", state="RUNNING") == 1
    assert _value(samples, "fedlink_jobs", state="FINISHED") == 4
    assert _value(samples, "fedlink_jobs", state="PENDING") == 0
    assert _value(samples, "fedlink_round", job_id="job-a") == 3
    assert _value(samples, "fedlink_round_results", job_id="job-a") == 5
    assert _value(samples, "fedlink_round", job_id="job-b") == 1
    assert _value(samples, "fedlink_results_total", outcome="accepted") == 2
    assert _value(samples, "fedlink_results_total", outcome="stale") == 1
    assert _value(samples, "fedlink_results_total", outcome="failed") == 0
    assert _value(samples, "fedlink_build_info", version=__version__) == 1

    telemetry.set_devices({DeviceState.ONLINE: 1})  # a state left out drops to 0
    telemetry.forget_job("job-a")
    telemetry.forget_job("never-ran")
    samples = _scrape(server)
    assert _value(samples, "fedlink_devices", state="OFFLINE") == 0
    assert ("fedlink_round", frozenset({("job_id", "job-a")})) not in samples
    assert _value(samples, "fedlink_round", job_id="job-b") == 1


def test_two_coordinators_in_one_process_do_not_share_metrics() -> None:
    first, second = Telemetry(), Telemetry()
    first.observe("RunnerService", "GetJob", grpc.StatusCode.OK, 0.001)
    assert b'method="GetJob"' in first.exposition()
    assert b'method="GetJob"' not in second.exposition()


def test_programming_errors_are_loud() -> None:
    telemetry = Telemetry()
    with pytest.raises(ValueError, match="unknown result outcome"):
        telemetry.count_result("great")
    with pytest.raises(ValueError, match="unknown states"):
        telemetry.set_jobs({"SLEEPING": 1})
    with pytest.raises(InvalidArgument, match="metrics_address"):
        telemetry.start_http_server("9464")


def test_stopping_the_endpoint_frees_the_port() -> None:
    telemetry = Telemetry()
    server = telemetry.start_http_server("127.0.0.1:0")
    server.stop()
    assert not server.thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)
