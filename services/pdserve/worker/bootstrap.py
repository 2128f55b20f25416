"""Build a worker's engine from its settings: tokenizer, model runner, KV cache, scheduler.

The only place that sizes the KV cache: the smallest of `max_tokens`, `max_total_bytes` and
`free_memory_fraction` of the memory available on the device (RAM on CPU).
"""
import logging
import os
from dataclasses import dataclass

import torch

from pdserve.common.errors import ConfigError
from pdserve.common.settings import usable_cores
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.models.tokenizer import load_tokenizer
from pdserve.engine.model.kv_tensor import bytes_per_block, kv_storage_dtype
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.model.host_store import HostKvStore
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.loading.weights import load_model_config, resolve_device, resolve_dtype
from pdserve.kvcache import HASH_ALGORITHM, KvCacheConfig, KvCacheManager
from pdserve.worker.async_engine import ThreadedEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What a worker's engine is built from (resolved from settings by the caller)."""

    model: str
    served_model_name: str
    role: WorkerRole = WorkerRole.BOTH
    dtype: str = "auto"
    device: str | None = None
    kv_cache_dtype: str = "auto"
    kv: KvCacheConfig = KvCacheConfig(max_total_bytes=512 << 20)
    scheduler: SchedulerConfig = SchedulerConfig()
    num_threads: int | None = None
    kernels: str = "auto"  # auto | native | torch (see ModelRunner.load)
    cache_dir: str | None = None  # keeps GGUF conversions (weights, tokenizer); None: no cache


def build_llm_engine(spec: EngineSpec) -> LLMEngine:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    config = load_model_config(spec.model)
    device = resolve_device(spec.device)
    model_dtype = resolve_dtype(spec.dtype, config)
    per_block = bytes_per_block(config, spec.kv.tokens_per_block, kv_storage_dtype(spec.kv_cache_dtype, model_dtype))
    num_blocks = spec.kv.num_blocks(per_block, available_memory(device))
    max_len = spec.scheduler.max_model_len
    if num_blocks * spec.kv.tokens_per_block < max_len:
        raise ConfigError("max_model_len", max_len,
                          f"the KV cache holds only {num_blocks * spec.kv.tokens_per_block} tokens; "
                          "raise the KV cache size or lower max_model_len")
    runner = ModelRunner.load(spec.model, spec.dtype, device, num_blocks=num_blocks,
                              tokens_per_block=spec.kv.tokens_per_block, kv_cache_dtype=spec.kv_cache_dtype,
                              cache_dir=spec.cache_dir, kernels=spec.kernels)
    tokenizer = load_tokenizer(spec.model, spec.cache_dir)
    num_host_blocks = spec.kv.host_cache_size // per_block
    if spec.kv.host_cache_size and not num_host_blocks:
        raise ConfigError("host_cache_size", spec.kv.host_cache_size, f"smaller than one KV block ({per_block} bytes)")
    host_store = HostKvStore(runner.kv_tensor, num_host_blocks) if num_host_blocks else None
    if host_store is not None:
        log.info("host KV tier: %d blocks (%.0f MiB) beside %d device blocks", num_host_blocks,
                 host_store.num_bytes / 2**20, num_blocks)
    kv = KvCacheManager(spec.kv, num_blocks, num_host_blocks=num_host_blocks)
    return LLMEngine(runner, kv, tokenizer, spec.scheduler, host_store=host_store)


def cpu_summary(engine: LLMEngine, runtime: dict[str, str]) -> str:
    """One line on how the engine uses the CPU, for the worker's start-up log."""
    kernels = "native CPU kernels" if engine.runner.native is not None else "torch ops"
    env = ", ".join(f"{k}={v}" for k, v in runtime.items())
    return (f"{kernels}; {torch.get_num_threads()} torch threads on {usable_cores()} usable cores "
            f"(--num-threads sets it); {env}")


def build_threaded_engine(spec: EngineSpec) -> ThreadedEngine:
    engine = build_llm_engine(spec)
    info = ModelInfo(
        model_name=spec.served_model_name, max_model_len=spec.scheduler.max_model_len,
        tokens_per_block=spec.kv.tokens_per_block, block_hash_algorithm=HASH_ALGORITHM, role=spec.role,
        vocab_size=engine.vocab_size, eos_token_ids=tuple(engine.tokenizer.eos_token_ids),
    )
    return ThreadedEngine(engine, info)


def available_memory(device: torch.device) -> int:
    """Bytes free on the device: CUDA's free memory, or the RAM the OS reports available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
