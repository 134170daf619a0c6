"""The Grafana dashboard's queries name metrics, labels and label values that a running coordinator
really exports. The coordinator is configured as compose configures it (its environment, TLS and
secret files from deploy/make_secrets.py); the image's HEALTHCHECK command, as the Dockerfile writes
it, passes against it (and fails once it stopped); it runs a one-round job with a stub device, and is
then scraped. With several replicas scraped, the gauges read from the shared database are counted once."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import urllib.request
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.orphans import tied
from fedlink.server.app import Coordinator
from fedlink.server.services.metrics import MetricsCollector
from fedlink.server.settings import load_settings
from fedlink.server.telemetry import Telemetry
from fedlink.server.tls import load_channel_credentials
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import service_environment

#: PromQL words that are not metric or label names.
_PROMQL_WORDS = {"sum", "max", "min", "count", "rate", "by", "histogram_quantile", "le"}
#: PromQL's aggregation operators.
_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "quantile", "topk"}


def _e2e_helpers(repo_root: Path) -> ModuleType:
    """tests/e2e/conftest.py's stub device and model upload (the suite's own device client)."""
    spec = importlib.util.spec_from_file_location("deploy_e2e_helpers", repo_root / "tests/e2e/conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _healthcheck(repo_root: Path, environment: dict[str, str]) -> tuple[int, str]:
    """Runs the coordinator image's HEALTHCHECK command (JSON form) with this venv's fedlink on PATH."""
    dockerfile = (repo_root / "Dockerfile").read_text().replace("\\\n", " ")
    (command,) = re.findall(r"^HEALTHCHECK .*? CMD (\[.*\])$", dockerfile, re.MULTILINE)
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    process = await asyncio.create_subprocess_exec(
        *tied(json.loads(command)),
        env={**os.environ, **environment, "PATH": path},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode()


def _queries(dashboard: Path) -> list[str]:
    panels = json.loads(dashboard.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (``fedlink_rpc_duration_seconds_bucket``, ...) -> the label sets of its samples; a
    family without samples (a gauge of running jobs, with none) appears with no label sets."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[dict[str, str]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        samples.setdefault(family.name, [])
        for sample in family.samples:
            samples[sample.name].append(dict(sample.labels))
    return samples


async def _run_one_round(
    helpers: ModuleType, channel: grpc.aio.Channel, join_secret: str, token: str
) -> None:
    admin = (("authorization", f"Bearer {token}"),)
    control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
    device = await helpers.StubDevice(channel).enroll(join_secret=join_secret)
    await device.get_job()  # only devices that asked for work are sampled
    sha = await helpers.upload_model(control, helpers.weights_dxo({"w": np.zeros(3, np.float32)}), admin)
    spec = cpb.JobSpec(name="dashboard", initial_model=dxo_pb2.BlobRef(sha256=sha))
    spec.fedavg.num_rounds = 2
    job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
    task = await device.get_task(job.job_id)
    assert task.status == rpb.RUNNER_STATUS_OK
    diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    diff.data["w"].CopyFrom(helpers.dense(np.ones(3, np.float32)))
    diff.meta["num_examples"].int_value = 3
    assert (await device.report(job.job_id, task, diff)).status == rpb.RUNNER_STATUS_OK


@pytest.mark.slow  # the HEALTHCHECK runs as its own process, twice
async def test_dashboard_queries_name_what_a_compose_configured_coordinator_exports(
    compose: dict[str, Any], deploy_dir: Path, secrets_dir: Path, repo_root: Path, tmp_path: Path
) -> None:
    environment = service_environment(compose, "coordinator", secrets_dir, deploy_dir)
    environment |= {
        "FEDLINK_DATA_DIR": str(tmp_path / "data"),  # the image's /var/lib/fedlink; SQLite, not PostgreSQL
        "FEDLINK_LISTEN_ADDRESS": "127.0.0.1:0",
        "FEDLINK_METRICS_ADDRESS": "127.0.0.1:0",
    }
    settings = load_settings(environ=environment)
    helpers = _e2e_helpers(repo_root)
    ca = Path(environment["FEDLINK_HEALTH_CA_CERT"])
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None and coordinator.metrics_url is not None
        assert coordinator.store is not None and not coordinator.endpoint.insecure
        port = coordinator.endpoint.port
        # As the image's HEALTHCHECK connects: 127.0.0.1, trusting the CA compose hands out.
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", load_channel_credentials(ca)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            check = {"FEDLINK_HEALTH_SERVER": f"127.0.0.1:{port}", "FEDLINK_HEALTH_CA_CERT": str(ca)}
            status, output = await _healthcheck(repo_root, check)
            assert status == 0, f"the image's HEALTHCHECK failed against a serving coordinator: {output}"
            join_secret = (secrets_dir / "join-secret").read_text().strip()
            await _run_one_round(helpers, channel, join_secret, coordinator.admin_token)
        assert coordinator.admin_token == (secrets_dir / "admin-token").read_text().strip()
        collector = MetricsCollector(coordinator.store, coordinator.telemetry, interval=timedelta(seconds=1))
        await collector.refresh()
        await asyncio.sleep(0.05)  # the server records a call after its reply went out
        samples = await asyncio.to_thread(_scrape, coordinator.metrics_url)
    status, output = await _healthcheck(repo_root, check)
    assert status == 1, f"the HEALTHCHECK passed against a stopped coordinator: {output}"

    queries = _queries(deploy_dir / "grafana/dashboards/fedlink.json")
    assert len(queries) >= 10
    problems = [f"{query}: {problem}" for query in queries for problem in _check(query, samples)]
    assert not problems, "\n".join(problems)


def _check(query: str, samples: dict[str, list[dict[str, str]]]) -> list[str]:
    """What in one PromQL query the scrape does not have: metric names, label names, matched values."""
    problems = []
    names = set(re.findall(r"\bfedlink_\w+", query))
    problems += [f"no metric {name}" for name in sorted(names - samples.keys())]
    label_sets = [labels for name in names & samples.keys() for labels in samples[name]]
    known = {label for labels in label_sets for label in labels}
    grouped = {
        label.strip() for group in re.findall(r"\bby \(([^)]*)\)", query) for label in group.split(",")
    }
    problems += [f"no label {label}" for label in sorted(grouped - known)]
    for label, value in re.findall(r'(\w+)="([^"]*)"', query):
        if not any(labels.get(label) == value for labels in label_sets):
            problems.append(f"no series with {label}={value!r}")
    words = set(re.findall(r"\b[a-z_]+\b", re.sub(r'"[^"]*"|\$__\w+|\[[^\]]*\]', "", query)))
    unknown = words - names - known - _PROMQL_WORDS
    problems += [f"unknown name {word}" for word in sorted(unknown)]
    return problems


def _store_gauges() -> set[str]:
    """The coordinator's gauges: each is read from the store (docs/operating.md), so every replica of one
    database exports the same value. Counters, histograms and the build info are each process's own."""
    return {metric.name for metric in Telemetry().registry.collect() if metric.type == "gauge"}


def _double_counts(query: str, store_gauges: set[str]) -> list[str]:
    """The store gauges ``query`` would count once per replica scraped (summed, counted: aggregated by
    anything but max or min), or show as one series per replica (not aggregated at all)."""
    named = sorted(set(re.findall(r"\bfedlink_\w+", query)) & store_gauges)
    if not named:
        return []
    operators = set(re.findall(r"\b(\w+)\s*(?:by\s*\([^)]*\)\s*)?\(", query)) & _AGGREGATIONS
    if not operators or not operators <= {"max", "min"}:
        return [f"{query}: {', '.join(named)} read from the database: take max (not {sorted(operators)})"]
    return []


def test_the_dashboard_counts_each_database_gauge_once_however_many_replicas(deploy_dir: Path) -> None:
    store_gauges = _store_gauges()
    assert {"fedlink_devices", "fedlink_jobs", "fedlink_round"} <= store_gauges
    queries = _queries(deploy_dir / "grafana/dashboards/fedlink.json")
    problems = [problem for query in queries for problem in _double_counts(query, store_gauges)]
    assert not problems, "\n".join(problems)
    # The check itself: a sum over replicas, or no aggregation at all, is caught.
    assert _double_counts('sum(fedlink_devices{state="ONLINE"})', store_gauges)
    assert _double_counts("fedlink_jobs", store_gauges)
    assert not _double_counts("max by (state) (fedlink_devices)", store_gauges)
    assert not _double_counts("sum by (outcome) (rate(fedlink_results_total[5m]))", store_gauges)


def test_the_check_finds_a_misspelt_metric_and_label() -> None:
    samples = {"fedlink_jobs": [{"state": "RUNNING"}]}
    assert _check('sum by (state) (fedlink_jobs{state="RUNNING"})', samples) == []
    assert _check("sum by (phase) (fedlink_job)", samples) == [
        "no metric fedlink_job",
        "no label phase",
        "unknown name phase",
    ]
    assert _check('fedlink_jobs{state="RUN"}', samples) == ["no series with state='RUN'"]
