"""Settings resolution: flag > PDSERVE_ env var > config file > default, with typed errors."""
import json
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.model_source import default_model_path
from pdserve.common.settings import (
    RouterSettings,
    WorkerSettings,
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
    assert (settings.block_size, settings.port, settings.enable_prefix_caching) == (16, 50051, True)
    assert settings.model_name == "SmolLM2-135M-Instruct.Q4_1"


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
    router = RouterSettings(model="/m/x.gguf", workers=("a:1", "b:2"), served_model_name="x")
    assert resolve_router_settings(to_argv(router), NO_ENV) == router


def test_cache_dir_defaults_under_home_and_an_empty_value_turns_it_off() -> None:
    assert resolve_worker_settings([], NO_ENV).cache_dir == str(Path.home() / ".cache" / "pdserve")
    assert resolve_router_settings(["--cache-dir", ""], NO_ENV).cache_dir is None
    worker = WorkerSettings(model="/m/x.gguf", cache_dir=None)
    assert resolve_worker_settings(to_argv(worker), {"PDSERVE_CACHE_DIR": "/elsewhere"}) == worker


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

