"""deploy/k8s as a cluster would receive it: each overlay rendered by kustomize (`kubectl
kustomize`, with certificates made by `pdserve certs` for its Secret), then checked against
Kubernetes' own schemas (kubernetes-validate, strict: no unknown field), the restricted Pod
Security Standard, probes, resource requests that fit a 2-CPU cluster, rollouts that never put
two workers behind one address, and a NetworkPolicy admitting workers' traffic only from the
router and their peers. Every pdserve command line still resolves through the settings parser."""
import base64
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pdserve.common import pki
from pdserve.common.settings import RouterSettings, WorkerSettings, resolve_router_settings, resolve_worker_settings
from pdserve.serve.certs import main as certs_main

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
IDENTITIES = (("--router", "router"), ("--prefill", "prefill-0=pdserve-prefill"),  # as base/kustomization.yaml says
              ("--decode", "decode-0=pdserve-decode"))
# The oldest Kubernetes with grpc probes GA, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
IMAGE_UID = 10001  # the Dockerfile's numeric USER
CLUSTER_CPUS = 2.0
# The restricted standard's allowed volume types (Pod Security Standards, "Volume Types").
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """(overlay name, its rendered documents)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("tls"))
    args = ["--out", str(tree / "base" / "tls")] + [a for identity in IDENTITIES for a in identity]
    assert certs_main(args) == 0
    rendered = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / request.param)],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return request.param, [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def deployments(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}


def settings_of(container: dict) -> WorkerSettings | RouterSettings:
    kind, *flags = [str(a) for a in container["args"]]
    env = plain_env(container)
    return {"worker": resolve_worker_settings, "router": resolve_router_settings}[kind](flags, env)


def plain_env(container: dict) -> dict[str, str]:
    """A container's environment given as values (POD_NAME, from the downward API, as a pod's name)."""
    return {e["name"]: str(e["value"]) if "value" in e else "pdserve-pod-0" for e in container.get("env", [])}


def cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def is_selected(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and In / NotIn / Exists expressions) on `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": value is not None, "DoesNotExist": value is None}[e["operator"]]
        if not ok:
            return False
    return True


def test_every_rendered_resource_passes_the_kubernetes_schema(overlay) -> None:
    _, docs = overlay
    assert sorted(d["kind"] for d in docs) == ["Deployment"] * 3 + ["NetworkPolicy", "Secret"] + ["Service"] * 3
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_a_schema_violation_is_caught() -> None:
    """The check above can fail: a misspelt probe field is refused."""
    pod = next(yaml.safe_load_all((K8S / "base" / "prefill.yaml").read_text()))
    pod["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[-1], strict=True)


def test_every_pod_meets_the_restricted_pod_security_standard(overlay) -> None:
    _, docs = overlay
    for name, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert (context["runAsNonRoot"], context["runAsUser"], context["runAsGroup"]) == (True, IMAGE_UID, IMAGE_UID)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC", "hostUsers")), name
        assert {key for v in pod["volumes"] for key in v if key != "name"} <= RESTRICTED_VOLUMES, name
        for container in pod["containers"] + pod.get("initContainers", []):
            c = container["securityContext"]
            assert c["allowPrivilegeEscalation"] is False and not c.get("privileged"), name
            assert c["capabilities"] == {"drop": ["ALL"]}, name
            assert c.get("runAsNonRoot", True) and c.get("runAsUser", IMAGE_UID) != 0, name
            assert "seccompProfile" not in c and "procMount" not in c, name
            assert all("hostPort" not in p for p in container.get("ports", [])), name


def test_root_file_systems_are_read_only_with_empty_dirs_where_pdserve_writes(overlay) -> None:
    _, docs = overlay
    for name, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert {mounted.get("/tmp"), mounted.get("/home/pdserve/.cache")} <= empty, name  # HOME/.cache: conversions
        settings = settings_of(container)
        assert settings.cache_dir is not None  # the default, ~/.cache/pdserve: inside the volume in the image


def test_pods_take_no_service_links_and_use_a_loaded_image(overlay) -> None:
    name, docs = overlay
    kustomization = yaml.safe_load((K8S / "overlays" / name / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert image["name"] == "pdserve"
    for deployment in deployments(docs).values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False
        (container,) = pod["containers"]
        assert container["image"] == f"{image['newName']}:{image['newTag']}"
        assert container["imagePullPolicy"] == "IfNotPresent"


def test_workers_are_probed_over_grpc_on_their_health_port_and_the_router_over_http(overlay) -> None:
    _, docs = overlay
    for name, deployment in deployments(docs).items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        settings = settings_of(container)
        probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
        if isinstance(settings, WorkerSettings):
            assert settings.health_port not in (None, 0, settings.port, settings.metrics_port)
            assert {kind: p["grpc"] for kind, p in probes.items()} == {
                "startup": {"port": settings.health_port, "service": "liveness"},
                "readiness": {"port": settings.health_port},  # "": ready, NOT_SERVING while draining
                "liveness": {"port": settings.health_port, "service": "liveness"}}, name
        else:
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["http"] == settings.port
            assert {kind: p["httpGet"] for kind, p in probes.items()} == {
                "startup": {"path": "/health/live", "port": "http"},
                "readiness": {"path": "/health/ready", "port": "http"},
                "liveness": {"path": "/health/live", "port": "http"}}, name
            startup = probes["startup"]
            assert startup["periodSeconds"] * startup["failureThreshold"] > settings.worker_wait_timeout_s


def test_requests_fit_a_two_cpu_cluster_and_memory_has_limits(overlay) -> None:
    _, docs = overlay
    total = 0.0
    for name, deployment in deployments(docs).items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        total += cpus(resources["requests"]["cpu"]) * deployment["spec"]["replicas"]
        assert "cpu" not in resources.get("limits", {}), name  # throttling stalls whole engine steps
        assert resources["limits"]["memory"] and resources["requests"]["memory"], name
    assert total <= CLUSTER_CPUS / 2  # the other half: kind's or minikube's own system pods


def test_the_overlays_choose_the_device(overlay) -> None:
    name, docs = overlay
    workers = {n: d for n, d in deployments(docs).items() if n != "pdserve-router"}
    assert sorted(workers) == ["pdserve-decode", "pdserve-prefill"]
    for deployment in workers.values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        settings = settings_of(container)
        assert isinstance(settings, WorkerSettings)
        limits = container["resources"]["limits"]
        if name == "cpu":
            assert (settings.device, settings.num_threads, "nvidia.com/gpu" in limits) == ("cpu", 1, False)
        else:
            assert (settings.device, limits["nvidia.com/gpu"]) == ("cuda", 1)
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert "cuda_copy" in plain_env(container)["UCX_TLS"]


def test_each_pod_mounts_a_certificate_of_its_own_role(overlay) -> None:
    """A worker starts only with a certificate of its --role, the router with one of role router."""
    _, docs = overlay
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    roles = {}
    for name, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        cert_key = {item["path"]: item["key"] for item in volume["secret"]["items"]}["tls.crt"]
        settings = settings_of(pod["containers"][0])
        wanted = pki.Role(settings.role) if isinstance(settings, WorkerSettings) else pki.Role.ROUTER
        roles[name] = pki.role_of(base64.b64decode(secret["data"][cert_key]))
        assert roles[name] == wanted
    assert sorted(roles.values()) == ["decode", "prefill", "router"]


def test_a_worker_address_never_names_two_pods(overlay) -> None:
    """Recreate: the old pod is gone before the new one starts; headless: the name is the pod."""
    _, docs = overlay
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for name in ("pdserve-prefill", "pdserve-decode"):
        deployment = deployments(docs)[name]
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
        assert services[name]["spec"]["clusterIP"] == "None"


def test_the_network_policy_admits_worker_traffic_only_from_the_router_and_peer_workers(overlay) -> None:
    _, docs = overlay
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments(docs).items()}
    selected = {n for n, labels in pods.items() if is_selected(policy["spec"]["podSelector"], labels)}
    assert selected == {"pdserve-prefill", "pdserve-decode"} and policy["spec"]["policyTypes"] == ["Ingress"]
    worker = settings_of(deployments(docs)["pdserve-decode"]["spec"]["template"]["spec"]["containers"][0])
    env = plain_env(deployments(docs)["pdserve-decode"]["spec"]["template"]["spec"]["containers"][0])
    low, high = (int(p) for p in env["UCX_TCP_PORT_RANGE"].split("-"))
    admitted: dict[str, set[tuple[int, int]]] = {}  # who -> (first, last) port ranges
    for rule in policy["spec"]["ingress"]:
        ranges = {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
        for peer in rule["from"]:
            if "namespaceSelector" in peer:  # Prometheus, in any namespace, by its label only
                assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
                admitted.setdefault("prometheus", set()).update(ranges)
                continue
            for who in (n for n, labels in pods.items() if is_selected(peer["podSelector"], labels)):
                admitted.setdefault(who, set()).update(ranges)
    assert admitted == {
        "pdserve-router": {(worker.port, worker.port)},
        "pdserve-prefill": {(worker.port, worker.port), (low, high)},
        "pdserve-decode": {(worker.port, worker.port), (low, high)},
        "prometheus": {(worker.metrics_port, worker.metrics_port)},
    }
