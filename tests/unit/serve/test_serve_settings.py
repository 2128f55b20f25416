"""`pdserve serve`'s settings: the flags split between router and workers, the topology."""
import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.ports import is_port_free
from pdserve.serve.launcher import with_core_share
from pdserve.serve.settings import ServeSettings, ServeTopology, resolve_serve_settings
from pdserve.common.settings import RouterSettings, WorkerSettings
from pdserve.common.stats import WorkerRole

NO_ENV: dict[str, str] = {}
P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def roles_of(settings: ServeSettings) -> list[WorkerRole]:
    return [w.role for w in settings.workers]


def test_serve_splits_flags_between_router_and_worker() -> None:
    settings = resolve_serve_settings(
        ["--port", "9000", "--worker-port", "6000", "--model", "/m/tiny.gguf", "--block-size", "32",
         "--startup-timeout", "20", "--workers", "1"],
        {"PDSERVE_SERVED_MODEL_NAME": "tiny"})
    (worker,) = settings.workers
    assert (settings.router.port, worker.port, worker.host) == (9000, 6000, "127.0.0.1")
    assert settings.router.workers == ("127.0.0.1:6000",)
    assert (settings.router.model, worker.model) == ("/m/tiny.gguf", "/m/tiny.gguf")
    assert (settings.router.served_model_name, worker.model_name) == (("tiny",), "tiny")
    assert (worker.block_size, settings.startup_timeout_s) == (32, 20.0)


def test_the_model_is_served_under_its_path_as_given_or_under_several_names_as_vllm_does() -> None:
    as_given = resolve_serve_settings(["--model", "/models/x", "--workers", "1"], NO_ENV)
    assert [w.model_name for w in as_given.workers] == ["/models/x"]
    assert as_given.router.served_model_name == ()  # the router takes its workers' name
    named = resolve_serve_settings(["--model", "/models/x", "--served-model-name", "a", "b"], NO_ENV)
    assert named.router.served_model_name == ("a", "b")
    assert {w.model_name for w in named.workers} == {"a"}


def test_prefill_and_decode_workers_take_consecutive_ports_prefill_first() -> None:
    settings = resolve_serve_settings(["--prefill", "2", "--decode", "1", "--worker-port", "7000",
                                       "--metrics-port", "9100"], NO_ENV)
    assert roles_of(settings) == [P, P, D]
    assert [w.port for w in settings.workers] == [7000, 7001, 7002]
    assert [w.metrics_port for w in settings.workers] == [9100, 9101, 9102]
    assert settings.router.workers == ("127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002")
    assert [w.peer_name for w in settings.workers] == [
        "prefill@127.0.0.1:7000", "prefill@127.0.0.1:7001", "decode@127.0.0.1:7002"]


def test_one_of_prefill_or_decode_defaults_the_other_to_one() -> None:
    assert roles_of(resolve_serve_settings(["--decode", "2"], NO_ENV)) == [P, D, D]
    assert roles_of(resolve_serve_settings(["--prefill", "0"], NO_ENV)) == [D]


def test_aggregated_serves_role_both_workers() -> None:
    assert roles_of(resolve_serve_settings(["--aggregated"], NO_ENV)) == [B]
    assert roles_of(resolve_serve_settings(["--workers", "3"], NO_ENV)) == [B, B, B]
    assert roles_of(resolve_serve_settings(["--aggregated"], {"PDSERVE_WORKERS": "2"})) == [B, B]


def test_default_topology_is_one_prefill_and_one_decode_worker_with_a_thread_each() -> None:
    settings = resolve_serve_settings([], NO_ENV)
    assert roles_of(settings) == [P, D]
    assert [w.num_threads for w in settings.workers] == [1, 1]


@pytest.mark.parametrize("argv", [[], ["--worker-port", "0"]])
def test_workers_take_free_ports_unless_told_otherwise(argv: list[str]) -> None:
    settings = resolve_serve_settings(["--workers", "3", *argv], NO_ENV)
    ports = [w.port for w in settings.workers]
    assert len(set(ports)) == 3 and all(port > 0 for port in ports)
    assert all(is_port_free("127.0.0.1", port) for port in ports)
    assert settings.router.workers == tuple(f"127.0.0.1:{port}" for port in ports)


def test_each_launch_is_a_deployment_of_its_own_unless_one_is_given() -> None:
    first, second = resolve_serve_settings([], NO_ENV), resolve_serve_settings([], NO_ENV)
    assert first.router.deployment_id != second.router.deployment_id
    for settings in (first, second):
        assert {w.deployment_id for w in settings.workers} == {settings.router.deployment_id}
    given = resolve_serve_settings(["--deployment-id", "shop-a"], NO_ENV)
    assert [given.router.deployment_id] + [w.deployment_id for w in given.workers] == ["shop-a"] * 3


def test_serve_settings_refuse_a_worker_of_another_deployment() -> None:
    worker = WorkerSettings(model="m", port=6000, deployment_id="b")
    with pytest.raises(ConfigError) as caught:
        ServeSettings(RouterSettings(model="m", workers=(worker.address,), deployment_id="a"), (worker,))
    assert caught.value.field == "deployment_id"


def test_several_workers_get_one_thread_each_unless_set() -> None:
    assert [w.num_threads for w in resolve_serve_settings(["--workers", "2"], NO_ENV).workers] == [1, 1]
    assert [w.num_threads for w in resolve_serve_settings(["--workers", "1"], NO_ENV).workers] == [None]
    chosen = resolve_serve_settings(["--prefill", "1", "--decode", "1", "--num-threads", "2"], NO_ENV)
    assert [w.num_threads for w in chosen.workers] == [2, 2]


@pytest.mark.parametrize(("argv", "is_shared"), [
    ([], True), (["--workers", "2"], True), (["--aggregated"], False),
    (["--no-share-cores"], False), (["--prefill", "0"], False),
])
def test_several_workers_share_one_table_of_cores_in_the_launch_folder(argv: list[str], is_shared: bool,
                                                                       tmp_path) -> None:
    settings = with_core_share(resolve_serve_settings(argv, NO_ENV), tmp_path)
    expected = str(tmp_path / "cores") if is_shared else None
    assert [w.core_share_file for w in settings.workers] == [expected] * len(settings.workers)


def test_metrics_port_zero_lets_each_worker_pick() -> None:
    settings = resolve_serve_settings(["--workers", "2", "--metrics-port", "0"], NO_ENV)
    assert [w.metrics_port for w in settings.workers] == [0, 0]


@pytest.mark.parametrize(("argv", "env", "field", "reason"), [
    (["--aggregated", "--decode", "2"], NO_ENV, "--decode", "cannot be combined with --aggregated or --workers"),
    (["--workers", "2", "--prefill", "0"], NO_ENV, "--prefill", "cannot be combined with --aggregated or --workers"),
    (["--decode", "0"], NO_ENV, "--decode", "must be > 0"),
    (["--prefill", "-1"], NO_ENV, "--prefill", "must be >= 0"),
    (["--workers", "2"], {"PDSERVE_WORKER_PORT": "65535"}, "PDSERVE_WORKER_PORT",
     "2 workers need ports up to 65535"),
    (["--workers", "3", "--metrics-port", "65534"], NO_ENV, "--metrics-port", "3 workers need ports up to 65535"),
    (["--worker-port", "99999"], NO_ENV, "--worker-port", "must be in 0..65535"),
    (["--restart-backoff", "0"], NO_ENV, "--restart-backoff", "must be > 0"),
    (["--restart-backoff", "8", "--max-restart-backoff", "4"], NO_ENV, "--max-restart-backoff",
     "must be >= --restart-backoff (8)"),
    (["--serve-metrics-port", "70000"], NO_ENV, "--serve-metrics-port", "must be in 0..65535"),
])
def test_bad_topology_names_the_flag(argv: list[str], env: dict[str, str], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_serve_settings(argv, env)
    assert (caught.value.field, caught.value.reason) == (field, reason)


@pytest.mark.parametrize("argv", [["--role", "prefill"], ["--worker-id", "w"], ["--worker", "a:1"],
                                  ["--core-share-file", "/tmp/x"]])
def test_per_worker_and_router_only_flags_are_not_serve_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        resolve_serve_settings(argv, NO_ENV)


def test_serve_worker_on_all_interfaces_is_called_on_loopback() -> None:
    settings = resolve_serve_settings(["--worker-host", "0.0.0.0", "--worker-port", "6001", "--workers", "1"],
                                      NO_ENV)
    assert settings.router.workers == ("127.0.0.1:6001",)


def test_cache_dir_sets_router_and_workers() -> None:
    settings = resolve_serve_settings(["--cache-dir", "/c", "--prefill", "1"], NO_ENV)
    assert [w.cache_dir for w in settings.workers] + [settings.router.cache_dir] == ["/c", "/c", "/c"]


def test_serve_settings_refuse_a_router_calling_other_workers() -> None:
    worker = WorkerSettings(model="m", port=6000)
    with pytest.raises(ConfigError) as caught:
        ServeSettings(RouterSettings(model="m", workers=("10.0.0.9:6000",)), (worker,))
    assert caught.value.field == "worker"


@pytest.mark.parametrize("roles", [(P,), (B, D), (P, B)])
def test_serve_settings_refuse_a_topology_without_decode_or_mixing_both(roles: tuple[WorkerRole, ...]) -> None:
    workers = tuple(WorkerSettings(model="m", role=role, port=6000 + i) for i, role in enumerate(roles))
    router = RouterSettings(model="m", workers=tuple(w.address for w in workers))
    with pytest.raises(ConfigError) as caught:
        ServeSettings(router, workers)
    assert caught.value.field == "role"


def test_topology_roles() -> None:
    assert ServeTopology(num_prefill=2, num_decode=3).roles() == (P, P, D, D, D)
    assert ServeTopology(num_aggregated=2).roles() == (B, B)
    assert ServeTopology(aggregated=True).roles() == (B,)


def test_the_model_may_come_first_as_vllm_serve_takes_it(tmp_path) -> None:
    settings = resolve_serve_settings([str(tmp_path), "--aggregated"], {})
    assert settings.router.model == str(tmp_path) and {w.model for w in settings.workers} == {str(tmp_path)}
    same = resolve_serve_settings([str(tmp_path), "--model", str(tmp_path)], {})
    assert same.router.model == str(tmp_path)


def test_a_positional_model_and_another_model_flag_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="positional"):
        resolve_serve_settings([str(tmp_path / "a"), "--model", str(tmp_path / "b")], {})
