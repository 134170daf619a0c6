"""deploy/compose.yaml without a container engine: the Compose Specification's schema, then what
`docker compose config` or `up` would find wrong (undeclared secrets, volumes and services, missing
files, build targets the Dockerfile lacks), its settings read by fedlink's own settings loaders, and the
shape of its two coordinator replicas (one database, blobs in it, a data volume each, every client and
Prometheus listing both, one certificate naming both)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509

from bench.orphans import tied
from deploy.make_secrets import make_secrets
from fedlink.runner.settings import load_runner_settings
from fedlink.runner.transport.addresses import parse_addresses
from fedlink.server.cli.jobfile import load_job_file
from fedlink.server.settings import load_settings

from .conftest import COORDINATORS, service_environment
from .test_dockerfile import stages

RUNNERS = ("runner-0", "runner-1", "runner-2")


def _validate(venv_bin: Path, path: Path) -> subprocess.CompletedProcess[str]:
    # check-jsonschema's vendored copy of the Compose Specification's schema: no network needed.
    command = [str(venv_bin / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(tied(command), capture_output=True, text=True, timeout=60, check=False)


def test_compose_file_matches_the_compose_specification(venv_bin: Path, deploy_dir: Path) -> None:
    result = _validate(venv_bin, deploy_dir / "compose.yaml")
    assert result.returncode == 0, f"compose.yaml:\n{result.stdout}{result.stderr}"


def test_the_schema_check_refuses_a_misspelt_key(venv_bin: Path, deploy_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    text = (deploy_dir / "compose.yaml").read_text()
    broken.write_text(text.replace("    stop_grace_period: 30s", "    stop_grace_periode: 30s", 1))
    result = _validate(venv_bin, broken)
    assert result.returncode == 1 and "stop_grace_periode" in result.stdout + result.stderr


def test_every_secret_volume_and_dependency_is_declared(compose: dict[str, Any], deploy_dir: Path) -> None:
    services = compose["services"]
    for name, service in services.items():
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"], f"{name} uses undeclared secret {secret}"
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                assert (deploy_dir / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_make_secrets_writes_every_secret_file(compose: dict[str, Any], secrets_dir: Path) -> None:
    for name, spec in compose["secrets"].items():
        path = secrets_dir / Path(spec["file"]).name
        assert spec["file"].startswith("./secrets/") and path.is_file(), f"secret {name}: no {path}"
    private = [p for p in secrets_dir.iterdir() if p.suffix != ".pem"]
    assert private and all(p.stat().st_mode & 0o077 == 0 for p in private)


def test_make_secrets_keeps_existing_files(tmp_path: Path) -> None:
    first = make_secrets(tmp_path)
    tokens = {p.name: p.read_bytes() for p in first}
    assert make_secrets(tmp_path) == []
    assert {p.name: p.read_bytes() for p in first} == tokens


def test_built_images_are_targets_of_the_dockerfile(compose: dict[str, Any], repo_root: Path) -> None:
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (repo_root / "Dockerfile").read_text(), re.MULTILINE))
    images: dict[str, str] = {}
    for name, service in compose["services"].items():
        if "build" in service:
            build = service["build"]
            assert (repo_root / "deploy" / build["context"] / build["dockerfile"]).resolve() == (
                repo_root / "Dockerfile"
            )
            assert build["target"] in stages, f"{name} builds target {build['target']}: not in {stages}"
            images[service["image"]] = build["target"]
    for name, service in compose["services"].items():
        image = service["image"]
        if image.startswith("fedlink-"):
            assert image in images, f"{name} uses {image}, which no service builds"


def test_runners_split_the_digits_as_the_job_expects(
    compose: dict[str, Any], deploy_dir: Path, secrets_dir: Path, tmp_path: Path
) -> None:
    job = load_job_file(deploy_dir / "digits-job.toml")
    assert job.workflow.config["devices_per_round"] == job.workflow.config["min_results"] == len(RUNNERS)
    partitions: list[int | None] = []
    for name in RUNNERS:
        environment = service_environment(compose, name, secrets_dir, deploy_dir)
        settings = load_runner_settings(environ=environment)
        assert settings.server == ",".join(_replica_addresses(compose)) and settings.ca_cert is not None
        assert settings.ca_cert.read_bytes() == (secrets_dir / "ca.pem").read_bytes()
        assert settings.join_secret == (secrets_dir / "join-secret").read_text().strip()
        assert settings.num_partitions == job.simulation.devices == len(RUNNERS)
        assert (settings.partition, settings.partition_alpha, settings.partition_seed) == (
            job.simulation.partition,
            job.simulation.partition_alpha,
            job.simulation.partition_seed,
        )
        assert settings.data == Path("/data/digits.npz")
        assert settings.shutdown_grace.total_seconds() < _seconds(
            compose["services"][name]["stop_grace_period"]
        )
        partitions.append(settings.partition_id)
    assert sorted(p if p is not None else -1 for p in partitions) == list(range(len(RUNNERS)))


def _replica_addresses(compose: dict[str, Any]) -> list[str]:
    """``service:port`` of each coordinator replica in the compose network (its gRPC listen port)."""
    services = compose["services"]
    return [
        f"{name}:{services[name]['environment']['FEDLINK_LISTEN_ADDRESS'].rsplit(':', 1)[1]}"
        for name in COORDINATORS
    ]


def test_coordinator_settings_load_and_stop_within_the_grace_period(
    compose: dict[str, Any], deploy_dir: Path, secrets_dir: Path
) -> None:
    for name in COORDINATORS:
        environment = service_environment(compose, name, secrets_dir, deploy_dir)
        # What the entrypoint builds from the password secret:
        environment["FEDLINK_DB_URL"] = "postgresql+asyncpg://fedlink:x@postgres:5432/fedlink"
        settings = load_settings(environ=environment)
        assert settings.tls_cert == secrets_dir / "server.pem" and not settings.insecure, name
        assert settings.metrics_address == "0.0.0.0:9464" and settings.auto_migrate is False, name
        # Several replicas share no disk: a model uploaded through one must be readable by the other.
        assert settings.blobs_in_database is True, f"{name}: blobs are not in the database"
        service = compose["services"][name]
        assert settings.shutdown_grace.total_seconds() < _seconds(service["stop_grace_period"])
        entrypoint = service["entrypoint"]
        assert entrypoint == compose["services"]["migrate"]["entrypoint"]
        assert "/run/secrets/postgres-password" in entrypoint[2] and entrypoint[2].rstrip().endswith('"$$@"')
        # The migrate one-shot is the one place that migrates: every replica starts after it.
        assert service["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}


def test_replicas_share_everything_but_their_data_volume_and_host_port(
    compose: dict[str, Any], repo_root: Path
) -> None:
    services = compose["services"]
    assert len(COORDINATORS) >= 2 and all(name in services for name in COORDINATORS)
    assert not [name for name in services if name.startswith("coordinator") and name not in COORDINATORS]
    # The data directory is the image's (FEDLINK_DATA_DIR in the Dockerfile) unless a replica sets one.
    (image_data_dir,) = re.findall(r"FEDLINK_DATA_DIR=(\S+)", stages(repo_root / "Dockerfile")["coordinator"])
    shared = ("image", "entrypoint", "command", "environment", "secrets", "stop_grace_period", "depends_on")
    first = services[COORDINATORS[0]]
    data_volumes: list[str] = []
    host_ports: list[str] = []
    for name in COORDINATORS:
        service = services[name]
        for key in shared:
            assert service.get(key) == first.get(key), f"{name}: {key} differs from {COORDINATORS[0]}'s"
        data_dir = service["environment"].get("FEDLINK_DATA_DIR", image_data_dir)
        mounts = {target: source for source, target, *_ in (m.split(":") for m in service["volumes"])}
        assert data_dir in mounts, f"{name}: no volume at its data directory {data_dir}"
        assert not mounts[data_dir].startswith("."), f"{name}: its data directory is a bind mount"
        data_volumes.append(mounts[data_dir])
        host_ports += [port.rsplit(":", 1)[0] for port in service.get("ports", [])]
    # One coordinator per data directory: a second one on the same volume would refuse to start.
    assert len(set(data_volumes)) == len(COORDINATORS), f"replicas share a data volume: {data_volumes}"
    assert len(set(host_ports)) == len(host_ports), f"replicas publish the same host port: {host_ports}"
    for secret in ("join-secret", "admin-token", "tls-cert", "tls-key"):
        assert secret in first["secrets"]


def test_every_client_lists_both_replicas(compose: dict[str, Any]) -> None:
    services = compose["services"]
    replicas = _replica_addresses(compose)
    clients = {name: services[name]["environment"]["FEDLINK_SERVER"] for name in RUNNERS}
    command = services["submit-digits"]["command"]
    clients["submit-digits"] = command[command.index("--server") + 1]
    for name, server in clients.items():
        assert [a.text for a in parse_addresses(server)] == replicas, f"{name}: --server {server}"
        # Started once every replica answers health: the first calls find whichever comes first.
        for replica in COORDINATORS:
            assert services[name]["depends_on"][replica] == {"condition": "service_healthy"}, name


def _certificate_names(pem: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name) for name in names.get_values_for_type(x509.DNSName)} | {
        str(address) for address in names.get_values_for_type(x509.IPAddress)
    }


def test_the_certificate_both_replicas_present_names_every_address_clients_use(
    compose: dict[str, Any], secrets_dir: Path
) -> None:
    names = _certificate_names(secrets_dir / "server.pem")
    for address in parse_addresses(",".join(_replica_addresses(compose))):
        assert address.host in names, f"server.pem does not name {address.host}: {sorted(names)}"
    assert "127.0.0.1" in names  # each container's HEALTHCHECK, and the ports published on the host
    files = {name: spec["file"] for name, spec in compose["secrets"].items()}
    assert (files["tls-cert"], files["tls-key"]) == ("./secrets/server.pem", "./secrets/server.key")


def test_make_secrets_issues_a_certificate_missing_a_replica_anew_from_the_same_ca(tmp_path: Path) -> None:
    # A deploy/secrets/ made before coordinator-2 existed: its certificate names only the first replica.
    make_secrets(tmp_path, ("coordinator", "localhost", "127.0.0.1"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert "coordinator-2" not in _certificate_names(tmp_path / "server.pem")
    written = make_secrets(tmp_path)
    assert sorted(p.name for p in written) == ["server.key", "server.pem"]
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after.keys() == before.keys(), "make_secrets left a file behind"
    unchanged = sorted(name for name in after if not name.startswith("server."))
    assert {n: after[n] for n in unchanged} == {n: before[n] for n in unchanged}, "the CA or a token changed"
    assert {*COORDINATORS, "localhost", "127.0.0.1"} <= _certificate_names(tmp_path / "server.pem")
    ca = x509.load_pem_x509_certificate(after["ca.pem"])
    x509.load_pem_x509_certificate(after["server.pem"]).verify_directly_issued_by(ca)
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0
    assert make_secrets(tmp_path) == []


def test_prometheus_scrapes_every_replicas_metrics_port(compose: dict[str, Any], deploy_dir: Path) -> None:
    config = yaml.safe_load((deploy_dir / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    services = compose["services"]
    expected = [
        f"{name}:{services[name]['environment']['FEDLINK_METRICS_ADDRESS'].rsplit(':', 1)[1]}"
        for name in COORDINATORS
    ]
    assert targets == expected
    assert set(COORDINATORS) <= set(services["prometheus"]["depends_on"])


def test_grafana_provisions_the_dashboard_on_its_datasource(
    compose: dict[str, Any], deploy_dir: Path
) -> None:
    grafana = deploy_dir / "grafana"
    (datasource,) = yaml.safe_load((grafana / "provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    (provider,) = yaml.safe_load((grafana / "provisioning/dashboards/fedlink.yaml").read_text())["providers"]
    mounts = dict(m.split(":")[:2] for m in compose["services"]["grafana"]["volumes"] if m.startswith("."))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    dashboard = json.loads((grafana / "dashboards/fedlink.json").read_text())
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {datasource["uid"]}


def test_digits_data_is_the_quickstarts_federated_split(repo_root: Path, tmp_path: Path) -> None:
    import importlib.util

    import numpy as np

    from deploy.digits import write_digits

    spec = importlib.util.spec_from_file_location("quickstart_run", repo_root / "examples/quickstart/run.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("quickstart_run", quickstart)
    spec.loader.exec_module(quickstart)
    x_fed, y_fed, _, _ = quickstart.federated_digits(0)
    write_digits(tmp_path / "digits.npz")
    with np.load(tmp_path / "digits.npz") as data:
        np.testing.assert_array_equal(data["x_train"], x_fed)
        np.testing.assert_array_equal(data["y_train"], y_fed)


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)s", text)
    assert match, f"expected a duration in seconds, not {text!r}"
    return float(match.group(1))


def test_submitted_job_finds_its_model_in_the_container(compose: dict[str, Any], deploy_dir: Path) -> None:
    # The job file names its model relative to itself: the mounts keep that layout in /jobs.
    service = compose["services"]["submit-digits"]
    mounts = {target: source for source, target, *_ in (m.split(":") for m in service["volumes"])}
    job_in_container = service["command"][2]
    job = load_job_file(deploy_dir / mounts[job_in_container])
    written = tomllib.loads((deploy_dir / mounts[job_in_container]).read_text())["model"]
    model_in_container = os.path.normpath(os.path.join(os.path.dirname(job_in_container), written))
    assert (deploy_dir / mounts[model_in_container]).resolve() == job.model_path.resolve()
