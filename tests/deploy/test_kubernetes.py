"""deploy/k8s/ without a cluster: every manifest against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), and what the schemas cannot say (the settings are real fedlink settings,
probes hit the gRPC port, secrets hold the keys the pods read, the grace periods fit)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.orphans import tied
from fedlink.server.settings import load_settings

KUBERNETES_VERSION = "1.37.0"


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


def test_coordinator_settings_load_and_its_probes_ask_grpc_health(
    documents: dict[tuple[str, str], dict[str, Any]],
) -> None:
    config = documents[("ConfigMap", "fedlink-coordinator")]["data"]
    environment = dict(config, FEDLINK_DB_URL="postgresql+asyncpg://fedlink:x@db/fedlink")
    environment = {k: v for k, v in environment.items() if not k.endswith("_FILE")}  # not on this machine
    settings = load_settings(environ=environment)
    assert settings.auto_migrate is False and not settings.insecure
    pod = _pod(documents, "Deployment", "fedlink-coordinator")
    (container,) = pod["containers"]
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert settings.listen_address.endswith(f":{grpc_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": grpc_port, "mode": "TLS"}, probe
    assert settings.shutdown_grace.total_seconds() < pod["terminationGracePeriodSeconds"]
    assert documents[("Deployment", "fedlink-coordinator")]["spec"]["replicas"] == 1


def test_pods_run_non_root_with_requests(documents: dict[tuple[str, str], dict[str, Any]]) -> None:
    pods = [
        _pod(documents, "Deployment", "fedlink-coordinator"),
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
        if kind not in ("Deployment", "Job"):
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
    labels = documents[("Deployment", "fedlink-coordinator")]["spec"]["template"]["metadata"]["labels"]
    selector = documents[("PodDisruptionBudget", "fedlink-coordinator")]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert documents[("Service", "fedlink-coordinator")]["spec"]["selector"].items() <= labels.items()
