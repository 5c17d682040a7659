"""deploy/k8s: every manifest is valid against the Kubernetes schemas (kubernetes-validate, whose schemas
ship inside the package: checked with the network cut off) and the pieces fit each other and tokenmill."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest release still commonly run; newer ones accept these manifests too
DEPLOYMENTS = ("deployment.yaml", "gpu/deployment.yaml")


def documents(relative: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / relative).read_text()) if doc]


def manifest(relative: str) -> dict:
    [doc] = documents(relative)
    return doc


def all_files() -> list[str]:
    return sorted(str(path.relative_to(K8S)) for path in K8S.rglob("*.yaml"))


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access during a schema check")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("relative", [name for name in all_files() if not name.endswith("kustomization.yaml")])
@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37.0"])
def test_each_manifest_is_valid_against_the_kubernetes_schemas(relative, version, no_network):
    for doc in documents(relative):
        kubernetes_validate.validate(doc, version, strict=True)  # raises on an unknown or mistyped field


@pytest.mark.parametrize("relative", ["kustomization.yaml", "gpu/kustomization.yaml"])
def test_kustomizations_name_files_that_exist(relative):
    kustomization = manifest(relative)
    assert kustomization["kind"] == "Kustomization"
    for resource in kustomization["resources"]:
        assert (K8S / relative).parent.joinpath(resource).resolve().is_file(), resource


def container(relative: str) -> dict:
    [tokenmill] = manifest(relative)["spec"]["template"]["spec"]["containers"]
    return tokenmill


@pytest.mark.parametrize("relative", DEPLOYMENTS)
def test_replicas_are_ready_on_health_and_request_resources(relative):
    tokenmill = container(relative)
    assert tokenmill["readinessProbe"]["httpGet"]["path"] == "/health"
    port_names = {port["name"]: port["containerPort"] for port in tokenmill["ports"]}
    assert tokenmill["readinessProbe"]["httpGet"]["port"] in port_names
    settings = manifest("configmap.yaml")["data"]
    assert port_names[tokenmill["readinessProbe"]["httpGet"]["port"]] == int(settings["TOKENMILL_PORT"])
    assert {"cpu", "memory"} <= set(tokenmill["resources"]["requests"])


@pytest.mark.parametrize("relative", DEPLOYMENTS)
def test_database_redis_and_admin_key_come_from_the_secret(relative):
    tokenmill = container(relative)
    secret = manifest("secret.example.yaml")
    from_secret = {
        env["name"]: env["valueFrom"]["secretKeyRef"]
        for env in tokenmill["env"]
        if "secretKeyRef" in env.get("valueFrom", {})
    }
    assert set(from_secret) == {"TOKENMILL_DATABASE_URL", "TOKENMILL_REDIS_URL", "TOKENMILL_ADMIN_KEY"}
    for reference in from_secret.values():
        assert reference["name"] == secret["metadata"]["name"] and reference["key"] in secret["stringData"]
    [config] = tokenmill["envFrom"]
    assert config["configMapRef"]["name"] == manifest("configmap.yaml")["metadata"]["name"]


@pytest.mark.parametrize("relative", DEPLOYMENTS)
def test_every_variable_is_one_tokenmill_reads(relative):
    from app.settings import OPTIONS

    known = {option.env for option in OPTIONS} | {"TOKENMILL_INSTANCE_ID"}  # the gateway's, for usage rows
    names = {env["name"] for env in container(relative)["env"]} | set(manifest("configmap.yaml")["data"])
    assert names <= known, names - known


def test_the_service_and_the_autoscaler_point_at_the_deployment():
    deployment, service, hpa = manifest("deployment.yaml"), manifest("service.yaml"), manifest("hpa.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {port["name"] for port in container("deployment.yaml")["ports"]}
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_gpu_variant_asks_for_a_gpu_and_is_otherwise_the_same_layout():
    gpu, cpu = container("gpu/deployment.yaml"), container("deployment.yaml")
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert manifest("gpu/deployment.yaml")["metadata"]["name"] == manifest("deployment.yaml")["metadata"]["name"]
    assert gpu["readinessProbe"] == cpu["readinessProbe"] and gpu["envFrom"] == cpu["envFrom"]
