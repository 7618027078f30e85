"""The Kubernetes manifests (k8s/), offline: every object is valid against the Kubernetes schemas (strictly: an
unknown field fails) for the oldest and the newest version checked, and the objects fit together (selectors,
ports, GPU counts, the gateway's verifier list, probes, certificates, disruption budgets). No cluster is needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the test extra

K8S = Path(__file__).resolve().parents[1] / "k8s"
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
PORTS = {"gateway": 50051, "drafter": 50052, "verifier": 50053}
COMPONENT = "app.kubernetes.io/component"


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def manifests() -> list[dict]:
    return [doc for name in kustomization()["resources"] for doc in yaml.safe_load_all((K8S / name).read_text())
            if doc]


def objects(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == kind}


def workloads() -> dict[str, dict]:
    """Deployments and StatefulSets by component."""
    found = {**objects("Deployment"), **objects("StatefulSet")}
    return {doc["spec"]["template"]["metadata"]["labels"][COMPONENT]: doc for doc in found.values()}


def container(workload: dict) -> dict:
    (main,) = workload["spec"]["template"]["spec"]["containers"]
    return main


def env(spec: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in spec.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    (image,) = kustomization()["images"]
    for workload in workloads().values():
        pod = workload["spec"]["template"]["spec"]
        assert {c["image"] for c in pod["containers"] + pod.get("initContainers", [])} == {image["name"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    docs = manifests()
    assert {doc["kind"] for doc in docs} >= {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_the_schema_check_catches_an_unknown_field() -> None:
    verifier = workloads()["verifier"]
    container(verifier)["readinessProbe"]["exce"] = container(verifier)["readinessProbe"].pop("exec")
    with pytest.raises(kubernetes_validate.ValidationError, match="exce"):
        kubernetes_validate.validate(verifier, VERSIONS[0], strict=True)


def test_each_service_selects_its_component_on_its_grpc_port() -> None:
    pods = {component: w["spec"]["template"]["metadata"]["labels"] for component, w in workloads().items()}
    for name, service in objects("Service").items():
        selector = service["spec"]["selector"]
        assert selector.items() <= pods[name].items(), name
        (port,) = service["spec"]["ports"]
        assert port["port"] == PORTS[name]
        assert {"name": "grpc", "containerPort": PORTS[name]} in container(workloads()[name])["ports"]
    assert objects("Service")["drafter"]["spec"]["clusterIP"] == "None"  # DNS answers with every replica
    assert objects("Service")["verifier"]["spec"]["clusterIP"] == "None"  # pod names: verifier-N.verifier


def health_check(probe: dict) -> list[str]:
    """The probe's `python -m proto.healthcheck` command: gRPC probes cannot speak TLS."""
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "proto.healthcheck"]
    return command[3:]


def test_probes_are_health_checks_on_the_service_port_over_tls() -> None:
    for component, workload in workloads().items():
        main = container(workload)
        expected = ["--tls-ca", "/certs/ca.crt"] if component == "gateway" else ["--internal"]
        assert health_check(main["readinessProbe"]) == [f"127.0.0.1:{PORTS[component]}", *expected], component
        assert main["args"][0] == component
    for component in ("drafter", "verifier"):  # a loading model gets its startup probe's time, then liveness
        main = container(workloads()[component])
        assert main["startupProbe"]["exec"] == main["livenessProbe"]["exec"] == main["readinessProbe"]["exec"]
        probe = main["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 900
    # the gateway's health follows its verifiers: liveness must not, or losing the verifiers restarts gateways
    assert "tcpSocket" in container(workloads()["gateway"])["livenessProbe"]


def test_every_pod_mounts_the_certificates_and_uses_tls() -> None:
    for component, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        (certs,) = [volume for volume in pod["volumes"] if volume["name"] == "certs"]
        assert certs["secret"]["secretName"] == "ddtree-certs", component
        for main in pod["containers"] + pod.get("initContainers", []):  # the preflight checks the files too
            assert {"name": "certs", "mountPath": "/certs", "readOnly": True} in main["volumeMounts"], component
            assert {"DDTREE_INTERNAL_CA", "DDTREE_INTERNAL_CERT", "DDTREE_INTERNAL_KEY"} <= env(main).keys()
    assert {"DDTREE_TLS_CERT", "DDTREE_TLS_KEY"} <= env(container(workloads()["gateway"])).keys()


def test_gpus_match_the_tensor_parallel_degree_and_the_preflight_checks_it() -> None:
    verifier, drafter = workloads()["verifier"], workloads()["drafter"]
    degree = flag(container(verifier)["args"], "--tensor-parallel")
    assert str(container(verifier)["resources"]["limits"]["nvidia.com/gpu"]) == degree
    assert container(drafter)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(workloads()["gateway"]).get("resources", {}).get("limits", {})
    for workload in (verifier, drafter):  # the preflight sees what the service will start with
        (preflight,) = workload["spec"]["template"]["spec"]["initContainers"]
        assert preflight["args"] == ["init"]
        assert env(preflight).items() <= env(container(workload)).items()
    assert env(container(verifier))["DDTREE_TENSOR_PARALLEL"] == degree


def test_the_gateway_lists_every_verifier_pod() -> None:
    verifier = workloads()["verifier"]
    assert verifier["kind"] == "StatefulSet" and verifier["spec"]["serviceName"] == "verifier"
    replicas = verifier["spec"]["replicas"]
    listed = env(container(workloads()["gateway"]))["DDTREE_VERIFIERS"].split(",")
    assert listed == [f"verifier-{i}.verifier:{PORTS['verifier']}" for i in range(replicas)]


def test_every_component_has_a_disruption_budget() -> None:
    budgets = objects("PodDisruptionBudget")
    assert set(budgets) == set(workloads())
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"][COMPONENT] == name
        assert ("minAvailable" in budget["spec"]) != ("maxUnavailable" in budget["spec"])
