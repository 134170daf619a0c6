"""deploy/k8s/ without a cluster: every manifest against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), and what the schemas cannot say (the settings are real fedlink settings,
probes hit the gRPC port, secrets hold the keys the pods read, the grace periods fit, and the
coordinator runs as replicas: several pods, blobs in the database, a data directory each, one pod at a
time down for updates and drains, Services in front of all of them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.orphans import tied
from fedlink.runner.transport.addresses import parse_addresses
from fedlink.server.settings import CoordinatorSettings, load_settings

KUBERNETES_VERSION = "1.37.0"
#: The coordinator's workload: several replicas, each pod with its own data volume.
COORDINATOR = ("StatefulSet", "fedlink-coordinator")


def _manifests(deploy_dir: Path) -> list[Path]:
    return sorted((deploy_dir / "k8s").rglob("*.yaml"))


def _documents(deploy_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in _manifests(deploy_dir):
        for document in yaml.safe_load_all(path.read_text()):
            found[(document["kind"], document["metadata"]["name"])] = document
    return found


def _validate(venv_bin: Path, *paths: Path) -> subprocess.CompletedProcess[str]:
    command = [str(venv_bin / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, *map(str, paths)]
    return subprocess.run(tied(command), capture_output=True, text=True, timeout=120, check=False)


def test_every_manifest_matches_the_kubernetes_schemas(venv_bin: Path, deploy_dir: Path) -> None:
    paths = _manifests(deploy_dir)
    assert len(paths) >= 6
    result = _validate(venv_bin, *paths)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") + result.stderr.count(" passed for resource ") == 11


def test_strict_validation_refuses_an_unknown_field(venv_bin: Path, deploy_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "coordinator.yaml"
    text = (deploy_dir / "k8s" / "coordinator.yaml").read_text()
    broken.write_text(text.replace("terminationGracePeriodSeconds:", "terminationGracePeriod:", 1))
    result = _validate(venv_bin, broken)
    assert result.returncode != 0 and "terminationGracePeriod" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def documents(deploy_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return _documents(deploy_dir)


def _pod(documents: dict[tuple[str, str], dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = documents[(kind, name)]["spec"]["template"]["spec"]
    return spec


def _coordinator_settings(documents: dict[tuple[str, str], dict[str, Any]]) -> CoordinatorSettings:
    config = documents[("ConfigMap", "fedlink-coordinator")]["data"]
    environment = dict(config, FEDLINK_DB_URL="postgresql+asyncpg://fedlink:x@db/fedlink")
    environment = {k: v for k, v in environment.items() if not k.endswith("_FILE")}  # not on this machine
    return load_settings(environ=environment)


def test_coordinator_settings_load_and_its_probes_ask_grpc_health(
    documents: dict[tuple[str, str], dict[str, Any]],
) -> None:
    settings = _coordinator_settings(documents)
    assert settings.auto_migrate is False and not settings.insecure
    pod = _pod(documents, *COORDINATOR)
    (container,) = pod["containers"]
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert settings.listen_address.endswith(f":{grpc_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": grpc_port, "mode": "TLS"}, probe
    assert settings.shutdown_grace.total_seconds() < pod["terminationGracePeriodSeconds"]


def test_the_coordinator_runs_as_replicas_on_one_database(
    documents: dict[tuple[str, str], dict[str, Any]],
) -> None:
    settings = _coordinator_settings(documents)
    # No volume is shared between replicas: a model uploaded through one is read by another.
    assert settings.blobs_in_database is True, "blobs are not in the database"
    workloads = [key for key, doc in documents.items() if doc["metadata"]["name"] == COORDINATOR[1]]
    assert COORDINATOR in workloads and ("Deployment", COORDINATOR[1]) not in workloads
    spec = documents[COORDINATOR]["spec"]
    assert spec["replicas"] >= 2
    # One pod at a time, never all of them (Recreate would stop every replica before starting any).
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    assert "Recreate" not in yaml.safe_dump(spec)
    budget = documents[("PodDisruptionBudget", "fedlink-coordinator")]["spec"]
    assert budget.get("maxUnavailable") == 1 and "minAvailable" not in budget


def test_each_replica_has_a_data_directory_of_its_own(
    documents: dict[tuple[str, str], dict[str, Any]],
) -> None:
    settings = _coordinator_settings(documents)
    spec = documents[COORDINATOR]["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = mounts[str(settings.data_dir)]
    # From the claim template (a claim per pod) or an emptyDir: never a claim, or a volume, all pods share.
    templates = {claim["metadata"]["name"]: claim["spec"] for claim in spec.get("volumeClaimTemplates", [])}
    pod_volumes = {v["name"]: v for v in pod.get("volumes", [])}
    if volume in templates:
        assert volume not in pod_volumes and templates[volume]["accessModes"] == ["ReadWriteOnce"]
    else:
        assert "emptyDir" in pod_volumes[volume], f"the data directory is on {pod_volumes[volume]}"
    assert not [key for key in documents if key[0] == "PersistentVolumeClaim"], "a claim the replicas share"


def test_services_front_every_replica_and_the_runners_use_one(
    documents: dict[tuple[str, str], dict[str, Any]], deploy_dir: Path
) -> None:
    spec = documents[COORDINATOR]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    (container,) = spec["template"]["spec"]["containers"]
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    # The StatefulSet's serviceName: headless, so each pod has a DNS name of its own.
    headless = documents[("Service", spec["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"].items() <= labels.items()
    runner = _pod(documents, "Deployment", "fedlink-runner")
    (runner_container,) = runner["containers"]
    server = next(v["value"] for v in runner_container["env"] if v["name"] == "FEDLINK_SERVER")
    hosts = []
    for address in parse_addresses(server):
        # name.namespace.svc[.cluster.local]: a Service of the coordinator's pods, on their gRPC port.
        name, namespace, *_ = address.host.split(".")
        assert namespace == documents[COORDINATOR]["metadata"]["namespace"], address
        service = documents[("Service", name)]["spec"]
        assert service["selector"].items() <= labels.items(), f"{name} does not select the coordinator"
        (port,) = [p for p in service["ports"] if p["port"] == address.port]
        assert port["targetPort"] in ("grpc", grpc_port), port
        hosts.append(address.host)
    # The certificate the documented make_secrets.py command writes names each of them.
    comment = (deploy_dir / "k8s/example-secrets/secrets.yaml").read_text()
    names = set(re.findall(r"--hostname (\S+)", comment))
    assert {*hosts, "127.0.0.1"} <= names, f"make_secrets.py --hostname {sorted(names)} lacks {hosts}"


def test_pods_run_non_root_with_requests(documents: dict[tuple[str, str], dict[str, Any]]) -> None:
    pods = [
        _pod(documents, *COORDINATOR),
        _pod(documents, "Deployment", "fedlink-runner"),
        _pod(documents, "Job", "fedlink-db-upgrade"),
    ]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_secret_keys_the_pods_read_exist(documents: dict[tuple[str, str], dict[str, Any]]) -> None:
    secrets = {name: set(doc["stringData"]) for (kind, name), doc in documents.items() if kind == "Secret"}
    for (kind, name), document in documents.items():
        if kind not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = document["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{name}: {ref}"
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                source = volume["secret"]
                keys = {item["key"] for item in source.get("items", [])}
                assert keys <= secrets[source["secretName"]], f"{name}: {source}"


def test_the_pdb_and_service_select_the_coordinator(documents: dict[tuple[str, str], dict[str, Any]]) -> None:
    spec = documents[COORDINATOR]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    selector = documents[("PodDisruptionBudget", "fedlink-coordinator")]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert documents[("Service", "fedlink-coordinator")]["spec"]["selector"].items() <= labels.items()
