"""Settings resolution: flag > PDSERVE_ env var > config file > default, with typed errors."""
import json
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.model_source import default_model_path
from pdserve.common.settings import (
    RouterSettings,
    WorkerSettings,
    child_environ,
    resolve_router_settings,
    resolve_worker_settings,
    to_argv,
)
from pdserve.common.stats import WorkerRole

NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_with_no_sources() -> None:
    settings = resolve_worker_settings([], NO_ENV)
    assert settings == WorkerSettings(model=default_model_path())
    assert (settings.block_size, settings.port, settings.enable_prefix_caching) == (None, 50051, True)  # by device
    assert settings.model_name == "SmolLM2-135M-Instruct.Q4_1"


def test_served_model_names_default_to_the_model_as_given_and_take_vllms_spellings(tmp_path: Path) -> None:
    assert WorkerSettings(model="/models/x").model_name == "/models/x"
    assert WorkerSettings(model="org/x.gguf").model_name == "org/x.gguf"
    spaced = resolve_router_settings(["--served-model-name", "a", "b", "--served-model-name", "c"], NO_ENV)
    assert spaced.served_model_name == ("a", "b", "c")
    assert resolve_router_settings([], {"PDSERVE_SERVED_MODEL_NAME": "a, b"}).served_model_name == ("a", "b")
    config = write(tmp_path, "r.yaml", "served-model-name: [a, b]\n")
    assert resolve_router_settings(["--config", config], NO_ENV).served_model_name == ("a", "b")
    worker = resolve_worker_settings(["--model", "/models/x", "--served-model-name", "a", "b"], NO_ENV)
    assert worker.model_name == "a"
    with pytest.raises(ConfigError, match="non-empty"):
        resolve_router_settings([], {"PDSERVE_SERVED_MODEL_NAME": "a,,b"})


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = write(tmp_path, "w.yaml", "block-size: 32\nmax_num_seqs: 8\nmax-model-len: 512\n")
    env = {"PDSERVE_BLOCK_SIZE": "64", "PDSERVE_MAX_NUM_SEQS": "4"}
    settings = resolve_worker_settings(["--config", config, "--block-size", "128"], env)
    assert (settings.block_size, settings.max_num_seqs, settings.max_model_len) == (128, 4, 512)
    assert settings.max_num_batched_tokens == 2048


def test_config_file_named_by_env_var(tmp_path: Path) -> None:
    config = write(tmp_path, "w.json", json.dumps({"port": 7001, "enable_prefix_caching": False}))
    settings = resolve_worker_settings([], {"PDSERVE_CONFIG": config})
    assert (settings.port, settings.enable_prefix_caching) == (7001, False)


def test_toml_file_and_vllm_boolean_flags(tmp_path: Path) -> None:
    config = write(tmp_path, "w.toml", 'enable-prefix-caching = false\nkv-cache-memory = "512MiB"\n')
    assert resolve_worker_settings(["--config", config], NO_ENV).kv_cache_memory == 512 << 20
    flipped = resolve_worker_settings(["--config", config, "--enable-prefix-caching"], NO_ENV)
    assert flipped.enable_prefix_caching is True
    assert resolve_worker_settings(["--no-enable-prefix-caching"], NO_ENV).enable_prefix_caching is False


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("0", False), ("Off", False), ("YES", True)])
def test_env_booleans(raw: str, expected: bool) -> None:
    settings = resolve_worker_settings([], {"PDSERVE_ENABLE_PREFIX_CACHING": raw})
    assert settings.enable_prefix_caching is expected


def test_typed_values_and_aliases() -> None:
    settings = resolve_worker_settings(
        ["--role", "prefill", "--dtype", "half", "--kv-cache-memory", "2GiB", "--max-kv-tokens", "4096",
         "--gpu-memory-utilization", "0.5", "--drain-timeout", "2.5"], NO_ENV)
    assert settings.role is WorkerRole.PREFILL
    assert (settings.dtype, settings.kv_cache_memory, settings.max_kv_tokens) == ("float16", 2 << 30, 4096)
    assert (settings.gpu_memory_utilization, settings.drain_timeout_s) == (0.5, 2.5)


@pytest.mark.parametrize(
    ("argv", "env", "field", "value"),
    [
        (["--block-size", "12"], NO_ENV, "--block-size", 12),
        ([], {"PDSERVE_BLOCK_SIZE": "abc"}, "PDSERVE_BLOCK_SIZE", "abc"),
        (["--gpu-memory-utilization", "1.5"], NO_ENV, "--gpu-memory-utilization", 1.5),
        (["--dtype", "int8"], NO_ENV, "--dtype", "int8"),
        (["--port", "70000"], NO_ENV, "--port", 70000),
        (["--max-num-seqs", "0"], NO_ENV, "--max-num-seqs", 0),
        (["--kv-cache-memory", "lots"], NO_ENV, "--kv-cache-memory", "lots"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], NO_ENV, "--max-num-batched-tokens", 32),
    ],
)
def test_bad_values_name_their_source(argv: list[str], env: dict[str, str], field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_worker_settings(argv, env)
    assert (caught.value.field, caught.value.value) == (field, value)


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "w.yaml", "max-model-len: many\n")
    with pytest.raises(ConfigError) as caught:
        resolve_worker_settings(["--config", config], NO_ENV)
    assert caught.value.field == f"max-model-len (in {config})"


def test_unknown_file_key_suggests_the_closest(tmp_path: Path) -> None:
    config = write(tmp_path, "w.yaml", "max-model-length: 512\n")
    with pytest.raises(ConfigError, match="did you mean 'max-model-len'"):
        resolve_worker_settings(["--config", config], NO_ENV)


@pytest.mark.parametrize(("name", "text"), [("w.ini", "x=1"), ("w.yaml", "- a\n- b\n"), ("w.json", "{oops")])
def test_unusable_config_files(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_worker_settings(["--config", write(tmp_path, name, text)], NO_ENV)
    assert caught.value.field == "config"


def test_unknown_flag_exits_with_usage() -> None:
    with pytest.raises(SystemExit) as caught:
        resolve_worker_settings(["--tensor-parallel-size", "2"], NO_ENV)
    assert caught.value.code == 2


def test_router_settings() -> None:
    settings = resolve_router_settings(
        ["--port", "8080", "--worker", "10.0.0.1:50051, 10.0.0.2:50051", "--rpc-timeout", "2"],
        {"PDSERVE_MODEL": "/models/tiny"})
    assert settings.workers == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert (settings.port, settings.rpc_timeout_s, settings.model) == (8080, 2.0, "/models/tiny")
    with pytest.raises(ConfigError) as caught:
        resolve_router_settings(["--worker", "nohost"], NO_ENV)
    assert caught.value.field == "--worker"


def test_a_list_flag_may_be_repeated_and_to_argv_repeats_it() -> None:
    settings = resolve_router_settings(["--worker", "a:1", "--worker", "b:2,c:3"], {"PDSERVE_WORKER": "x:9"})
    assert settings.workers == ("a:1", "b:2", "c:3")
    argv = to_argv(settings)
    first = argv.index("--worker")
    assert argv[first:first + 7] == ["--worker", "a:1", "--worker", "b:2", "--worker", "c:3", "--rpc-timeout"]


def test_a_flag_is_never_abbreviated() -> None:
    with pytest.raises(SystemExit) as caught:
        resolve_worker_settings(["--max-model", "512"], NO_ENV)
    assert caught.value.code == 2


def test_to_argv_round_trips_against_a_hostile_environment(tmp_path: Path) -> None:
    worker = WorkerSettings(model="/m/x.gguf", role=WorkerRole.DECODE, port=0, block_size=64,
                            enable_prefix_caching=False, kv_cache_memory=1 << 30, max_model_len=1024)
    env = {"PDSERVE_BLOCK_SIZE": "8", "PDSERVE_PORT": "1234", "PDSERVE_ENABLE_PREFIX_CACHING": "1"}
    assert resolve_worker_settings(to_argv(worker), env) == worker
    router = RouterSettings(model="/m/x.gguf", workers=("a:1", "b:2"), served_model_name=("x", "y"))
    assert resolve_router_settings(to_argv(router), NO_ENV) == router


def test_cache_dir_defaults_under_home_and_an_empty_value_turns_it_off() -> None:
    assert resolve_worker_settings([], NO_ENV).cache_dir == str(Path.home() / ".cache" / "pdserve")
    assert resolve_router_settings(["--cache-dir", ""], NO_ENV).cache_dir is None
    worker = WorkerSettings(model="/m/x.gguf", cache_dir=None)
    assert resolve_worker_settings(to_argv(worker), {"PDSERVE_CACHE_DIR": "/elsewhere"}) == worker


# What Kubernetes puts in every pod of a namespace with Services named pdserve, pdserve-metrics
# and pdserve-health (service links), beside the variables a deployment sets itself.
SERVICE_LINKS = {
    "PDSERVE_PORT": "tcp://10.0.0.1:8000", "PDSERVE_PORT_8000_TCP": "tcp://10.0.0.1:8000",
    "PDSERVE_PORT_8000_TCP_PORT": "8000", "PDSERVE_SERVICE_HOST": "10.0.0.1", "PDSERVE_SERVICE_PORT": "8000",
    "PDSERVE_METRICS_PORT": "tcp://10.0.0.2:9100", "PDSERVE_HEALTH_PORT": "udp://pdserve-health:50052",
}


def test_kubernetes_service_links_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    worker = resolve_worker_settings([], {**SERVICE_LINKS, "PDSERVE_MAX_NUM_SEQS": "8"})
    router = resolve_router_settings([], SERVICE_LINKS)
    assert (worker.port, worker.metrics_port, worker.health_port, worker.max_num_seqs) == (50051, None, None, 8)
    assert router.port == 8000
    assert "ignoring PDSERVE_PORT='tcp://10.0.0.1:8000': a Kubernetes service link" in caplog.text
    assert "ignoring PDSERVE_HEALTH_PORT='udp://pdserve-health:50052'" in caplog.text


def test_a_port_set_beside_service_links_still_counts_and_a_bad_one_is_still_refused() -> None:
    assert resolve_worker_settings(["--port", "50061"], SERVICE_LINKS).port == 50061
    assert resolve_router_settings([], {**SERVICE_LINKS, "PDSERVE_PORT": "8080"}).port == 8080
    with pytest.raises(ConfigError) as caught:
        resolve_router_settings([], {"PDSERVE_PORT": "http://10.0.0.1:8000"})  # not what Kubernetes writes
    assert caught.value.field == "PDSERVE_PORT"


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--health-port"])
def test_worker_ports_must_be_in_range(flag: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_worker_settings([flag, "65536"], NO_ENV)
    assert (caught.value.field, caught.value.value) == (flag, 65536)
    assert getattr(resolve_worker_settings([flag, "0"], NO_ENV), flag[2:].replace("-", "_")) == 0


def test_worker_dns_names_replace_the_default_worker_and_may_sit_beside_static_ones() -> None:
    assert resolve_router_settings([], NO_ENV).static_workers == ("127.0.0.1:50051",)
    found = resolve_router_settings(["--worker-dns", "prefill:50051,decode:50051", "--worker-dns-interval", "2"], NO_ENV)
    assert (found.worker_dns, found.static_workers, found.worker_dns_interval_s) == (
        ("prefill:50051", "decode:50051"), (), 2.0)
    both = resolve_router_settings(["--worker-dns", "decode:50051", "--worker", "10.0.0.9:50051"], NO_ENV)
    assert both.static_workers == ("10.0.0.9:50051",)
    with pytest.raises(ConfigError) as caught:
        resolve_router_settings(["--worker-dns", "decode"], NO_ENV)
    assert caught.value.field == "--worker-dns"


def test_a_worker_in_a_pod_is_named_after_the_pod_unless_its_certificate_or_flag_names_it() -> None:
    pod = {"POD_NAME": "pdserve-prefill-7d9f-x2k4q"}
    assert resolve_worker_settings(["--insecure-internal"], pod).peer_name == "pdserve-prefill-7d9f-x2k4q"
    assert resolve_worker_settings(["--worker-id", "p0"], pod).peer_name == "p0"
    assert resolve_worker_settings(["--tls-dir", "/etc/pdserve/tls"], pod).worker_id is None  # the certificate's
    assert resolve_worker_settings(["--role", "prefill", "--port", "7000"], NO_ENV).peer_name == "prefill@127.0.0.1:7000"


def test_a_child_process_never_inherits_the_pod_name(monkeypatch) -> None:
    monkeypatch.setenv("POD_NAME", "pdserve-0")
    assert "POD_NAME" not in child_environ()


def test_lora_flags_take_vllm_s_forms_and_reach_a_child_unchanged() -> None:
    settings = resolve_worker_settings(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                                        "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat"}',
                                        "--lora-modules", "x=/a/x=1"], environ={})
    assert settings.lora_module_pairs == (("sql", "/a/sql"), ("chat", "/a/chat"), ("x", "/a/x=1"))
    assert (settings.max_loras, settings.max_lora_rank) == (3, 64)
    assert resolve_worker_settings(to_argv(settings), environ={}) == settings


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "sql=/a"], "needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/a", "b=/b"], "more adapters than --max-loras"),
    (["--enable-lora", "--max-loras", "2", "--lora-modules", "a=/a", "a=/b"], "names must differ"),
    (["--enable-lora", "--lora-modules", "noequals"], "is not name=path"),
    (["--enable-lora", "--max-lora-rank", "0"], "must be > 0"),
])
def test_bad_lora_flags_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_worker_settings(argv, environ={})

