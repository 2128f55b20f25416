"""How `pdserve worker` turns its settings into the engine's build spec and its identity."""
import socket

import pytest
import torch

from pdserve.common import pki
from pdserve.common.errors import ConfigError
from pdserve.common.model_source import default_model_path
from pdserve.common.settings import pod_name, resolve_worker_settings
from pdserve.common.stats import WorkerRole
from pdserve.worker.__main__ import CPU_BLOCK_SIZE, CPU_DEFAULT_KV_BYTES, default_block_size, engine_spec, with_identity

NO_ENV: dict[str, str] = {}


def test_spec_carries_every_setting() -> None:
    settings = resolve_worker_settings(
        ["--role", "decode", "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-dtype", "fp8", "--block-size", "32", "--max-model-len", "512", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB",
         "--max-kv-tokens", "4096", "--gpu-memory-utilization", "0.5", "--num-threads", "1",
         "--cache-dir", "/c", "--core-share-file", "/s/cores"], NO_ENV)
    spec = engine_spec(settings)
    assert (spec.model, spec.served_model_name, spec.role) == (default_model_path(), "tiny", WorkerRole.DECODE)
    assert (spec.device, spec.dtype, spec.kv_cache_dtype, spec.num_threads) == ("cpu", "float32", "fp8", 1)
    assert (spec.kv.max_total_bytes, spec.kv.max_tokens, spec.gpu_memory_utilization) == (64 << 20, 4096, 0.5)
    assert (spec.kv.tokens_per_block, spec.kv.enable_block_reuse) == (32, False)
    assert (spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens) == (8, 256)
    assert spec.scheduler.max_model_len == 512
    assert (spec.cache_dir, spec.core_share_file) == ("/c", "/s/cores")


def test_unsized_cpu_cache_is_capped_and_context_comes_from_the_model() -> None:
    spec = engine_spec(resolve_worker_settings(["--device", "cpu"], NO_ENV))
    assert (spec.kv.max_total_bytes, spec.kv.max_tokens) == (CPU_DEFAULT_KV_BYTES, None)
    assert spec.scheduler.max_model_len == 8192  # SmolLM2-135M's context length
    assert spec.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert spec.kv.tokens_per_block == CPU_BLOCK_SIZE == 64  # a CPU's default block: longer runs to read


def test_the_default_block_size_follows_the_device() -> None:
    assert default_block_size(torch.device("cpu")) == 64
    assert default_block_size(torch.device("cuda", 0)) == 16


def test_explicit_token_limit_replaces_the_cpu_cap() -> None:
    spec = engine_spec(resolve_worker_settings(
        ["--device", "cpu", "--max-kv-tokens", "2048", "--max-model-len", "1024"], NO_ENV))
    assert (spec.kv.max_total_bytes, spec.kv.max_tokens) == (None, 2048)


def test_tier_settings_reach_the_spec() -> None:
    spec = engine_spec(resolve_worker_settings(
        ["--device", "cpu", "--host-cache-size", "1GiB", "--secondary-offload-min-priority", "50",
         "--disk-cache-dir", "/d", "--disk-cache-size", "2GiB"], NO_ENV))
    assert (spec.kv.host_cache_size, spec.kv.secondary_offload_min_priority) == (1 << 30, 50)
    assert (spec.disk_cache_dir, spec.disk_cache_size) == ("/d", 2 << 30)


def test_a_disk_tier_without_a_host_tier_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs a host tier above it"):
        resolve_worker_settings(["--disk-cache-dir", "/d"], NO_ENV)


def test_a_worker_id_is_its_certificates_identity(tmp_path) -> None:
    folder = str(pki.Authority.create("test").issue("decode-0", pki.Role.DECODE).write(tmp_path))
    settings, tls = with_identity(resolve_worker_settings(["--tls-dir", folder, "--role", "decode"], NO_ENV))
    assert (settings.worker_id, settings.peer_name, tls.identity) == ("decode-0", "decode-0", "decode-0")
    with pytest.raises(ConfigError, match="names 'decode-0'; a worker's id is its identity"):
        with_identity(resolve_worker_settings(["--tls-dir", folder, "--role", "decode", "--worker-id", "decode-1"],
                                              NO_ENV))


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_a_worker_refuses_a_certificate_of_another_role(tmp_path, role: str) -> None:
    folder = str(pki.Authority.create("test").issue("decode-0", pki.Role.DECODE).write(tmp_path))
    with pytest.raises(ConfigError, match=f"of role 'decode' .'decode-0'.; this process needs one of role '{role}'"):
        with_identity(resolve_worker_settings(["--tls-dir", folder, "--role", role], NO_ENV))


def test_in_a_pod_a_worker_id_is_an_instance_of_its_certificates_identity(tmp_path) -> None:
    """The replicas of one Deployment share a certificate: each takes its pod's name as instance."""
    folder = str(pki.Authority.create("test").issue("prefill-0", pki.Role.PREFILL).write(tmp_path))
    prefill = ["--role", "prefill", "--tls-dir"]
    pod = {"POD_NAME": "pdserve-prefill-7d9f-x2k4q"}
    settings, _ = with_identity(resolve_worker_settings([*prefill, folder], pod), pod_name(pod))
    assert settings.worker_id == settings.peer_name == "prefill-0/pdserve-prefill-7d9f-x2k4q"
    chosen, _ = with_identity(resolve_worker_settings([*prefill, folder, "--worker-id", "prefill-0/a"], pod), "b")
    assert chosen.worker_id == "prefill-0/a"
    with pytest.raises(ConfigError, match="<identity>/<instance>"):
        with_identity(resolve_worker_settings([*prefill, folder, "--worker-id", "prefill-00"], pod), "b")


def test_a_default_worker_id_on_a_wildcard_host_names_this_machine() -> None:
    settings = resolve_worker_settings(["--host", "0.0.0.0", "--port", "50051", "--role", "decode"], NO_ENV)
    assert settings.peer_name == f"decode@{socket.gethostname()}:50051"
