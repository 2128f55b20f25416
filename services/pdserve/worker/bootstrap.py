"""Build a worker's engine from its settings: tokenizer, model runner, KV cache, scheduler.

The only place that sizes the KV cache: the smallest of `max_tokens`, `max_total_bytes` and
the memory budget of `memory_budget.py` (on a GPU, `--gpu-memory-utilization` of the device
with vLLM's meaning; on a CPU, most of the RAM available).
"""
import logging
import os
from dataclasses import dataclass

import torch

from pdserve.common.errors import ConfigError
from pdserve.common.settings import apply_worker_runtime_defaults, usable_cores
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.models.tokenizer import load_tokenizer
from pdserve.engine.model.kv_tensor import bytes_per_block, kv_storage_dtype
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.speculation import Speculator
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.spec.proposers import DrafterContext, build_proposer, drafter_bytes_per_block
from pdserve.engine.model.host_store import HostKvStore
from pdserve.engine.model.lora import LoraSettings
from pdserve.transfer.disk_store import DiskKvStore
from pdserve.transfer.kv_files import BlockFiles, fingerprint
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.loading.weights import load_model_config, resolve_device, resolve_dtype
from pdserve.kvcache import HASH_ALGORITHM, KvCacheConfig, KvCacheManager
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.cpu.core_share import CoreShare
from pdserve.worker.cpu.heap import keep_step_memory
from pdserve.worker.kv.tiers import KvTierStore, adopt_disk_blocks
from pdserve.worker.memory_budget import StepShape, cpu_kv_budget, gpu_kv_budget, non_kv_bytes

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
    core_share_file: str | None = None  # shared with the machine's other workers (core_share.py); None: fixed
    kernels: str = "auto"  # settings.KERNEL_CHOICES (see ModelRunner.load)
    cache_dir: str | None = None  # keeps GGUF conversions (weights, tokenizer); None: no cache
    disk_cache_dir: str | None = None  # the disk KV tier's folder (below the host tier); None: no disk tier
    disk_cache_size: int = 4 << 30
    gpu_memory_utilization: float = 0.9  # of a GPU's total memory, for the whole process (memory_budget.py)
    lora: LoraSettings | None = None  # None: no LoRA adapters
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding


def build_llm_engine(spec: EngineSpec) -> LLMEngine:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    config = load_model_config(spec.model)
    device = resolve_device(spec.device)
    model_dtype = resolve_dtype(spec.dtype, config, device)
    storage = kv_storage_dtype(spec.kv_cache_dtype, model_dtype)
    per_block = bytes_per_block(config, spec.kv.tokens_per_block, storage)
    drafter_per_block = drafter_bytes_per_block(spec.speculative, spec.kv.tokens_per_block, storage)
    num_blocks = spec.kv.num_blocks(per_block + drafter_per_block, kv_memory_budget(spec, config, model_dtype, device))
    max_len = spec.scheduler.max_model_len
    if num_blocks * spec.kv.tokens_per_block < max_len:
        raise ConfigError("max_model_len", max_len,
                          f"the KV cache holds only {num_blocks * spec.kv.tokens_per_block} tokens; "
                          "raise the KV cache size or lower max_model_len")
    runner = ModelRunner.load(spec.model, spec.dtype, device, num_blocks=num_blocks,
                              tokens_per_block=spec.kv.tokens_per_block, kv_cache_dtype=spec.kv_cache_dtype,
                              cache_dir=spec.cache_dir, kernels=spec.kernels, lora=spec.lora)
    tokenizer = load_tokenizer(spec.model, spec.cache_dir)
    store = _tier_store(spec, runner, per_block)
    num_disk_blocks = spec.disk_cache_size // per_block if store is not None and store.disk is not None else 0
    kv = KvCacheManager(spec.kv, num_blocks, num_host_blocks=store.host.slots.shape[0] if store else 0,
                        num_disk_blocks=num_disk_blocks, disk_verifier=store.verify if num_disk_blocks else None)
    if store is not None:
        adopt_disk_blocks(kv, store)
    return LLMEngine(runner, kv, tokenizer, spec.scheduler, tier_store=store, speculator=_speculator(spec, runner, kv))


def _speculator(spec: EngineSpec, runner: ModelRunner, kv: KvCacheManager) -> Speculator | None:
    """Speculative decoding's drafter and verifier; None without it, and on a prefill worker (a
    prompt's first token is its own step's; the decode worker speculates)."""
    if spec.speculative is None or spec.role is WorkerRole.PREFILL:
        return None
    log.info("speculative decoding: %s", spec.speculative.to_json())
    context = DrafterContext(runner, kv, spec.dtype, spec.kernels, spec.cache_dir, spec.scheduler.max_model_len)
    return Speculator(spec.speculative, build_proposer(spec.speculative, context), kv, spec.scheduler.max_model_len)


def _tier_store(spec: EngineSpec, runner: ModelRunner, per_block: int) -> KvTierStore | None:
    """The host tier's slots and the disk tier's files, as the settings ask; None without a host tier."""
    num_host_blocks = spec.kv.host_cache_size // per_block
    if spec.kv.host_cache_size and not num_host_blocks:
        raise ConfigError("host_cache_size", spec.kv.host_cache_size, f"smaller than one KV block ({per_block} bytes)")
    if not num_host_blocks:
        return None
    host = HostKvStore(runner.kv_tensor, num_host_blocks)
    log.info("host KV tier: %d blocks (%.0f MiB)", num_host_blocks, host.num_bytes / 2**20)
    if not spec.disk_cache_dir:
        return KvTierStore(runner.kv_tensor, host)
    if spec.disk_cache_size < per_block:
        raise ConfigError("disk_cache_size", spec.disk_cache_size, f"smaller than one KV block ({per_block} bytes)")
    identity = {"layout": KvLayoutSpec.for_tensor(spec.served_model_name, runner.kv_tensor).to_dict(),
                "block_keys": HASH_ALGORITHM, "weights": weights_fingerprint(spec.model)}
    files = BlockFiles(spec.disk_cache_dir, fingerprint(identity), per_block)
    log.info("disk KV tier: up to %d blocks in %s", spec.disk_cache_size // per_block, files.folder)
    return KvTierStore(runner.kv_tensor, host, DiskKvStore(files, host.slots, f"{spec.served_model_name}-{os.getpid()}"))


def weights_fingerprint(model: str) -> list[tuple[str, int, int]]:
    """The model's files by name, size and modification time: blocks from other weights never match."""
    path = os.path.abspath(model)
    paths = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path)
        if name.endswith((".safetensors", ".gguf", ".bin", ".json")))
    return [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]


def cpu_summary(engine: LLMEngine, runtime: dict[str, str]) -> str:
    """One line on how the engine uses the CPU, for the worker's start-up log."""
    native = engine.runner.native
    kernels = f"native CPU kernels ({native.level})" if native is not None else "torch ops"
    env = ", ".join(f"{k}={v}" for k, v in runtime.items())
    return (f"{kernels}; {torch.get_num_threads()} torch threads (on the engine's thread) on {usable_cores()} "
            f"usable cores (--num-threads sets it); {env}")


def build_threaded_engine(spec: EngineSpec) -> ThreadedEngine:
    """The engine, built on the thread that will run its steps (see async_engine.py). The
    calling thread keeps one torch thread, so that no tensor work on it (a KV transfer's
    bookkeeping, an adapter's weights) opens a second OpenMP pool. Order matters: torch gives
    a thread that has not asked yet the count set last by any thread, so this thread settles
    its own count first and the engine's thread sets the engine's last."""
    threads = spec.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    cores = core_share(spec.core_share_file, threads)

    def build() -> tuple[LLMEngine, ModelInfo]:
        engine, info = _engine_and_info(spec, threads)
        if cores is not None and engine.runner.native is not None:  # its steps may grow onto idle cores
            engine.runner.native.follow_threads(cores.follow_mid_step())
        return engine, info

    return ThreadedEngine.built_on_loop_thread(build, cores=cores)


def core_share(path: str | None, threads: int) -> CoreShare | None:
    """The engine's slot in `path`'s table of cores, `threads` of them its own; None without a path."""
    if not path:
        return None
    try:
        share = CoreShare(path, threads, usable_cores(), torch.set_num_threads)
    except OSError as exc:
        raise ConfigError("core_share_file", path, f"cannot share cores through it: {exc}") from None
    log.info("CPU: %d torch threads of its own, and the cores idle peers leave (slot %d of %s)",
             threads, share.slot, path)
    return share


def _engine_and_info(spec: EngineSpec, threads: int) -> tuple[LLMEngine, ModelInfo]:
    torch.set_num_threads(threads)
    engine = build_llm_engine(spec)
    if engine.runner.device.type == "cpu":
        heap = keep_step_memory()  # after loading: the loader's garbage has been given back
        log.info("CPU: %s; %s", cpu_summary(engine, apply_worker_runtime_defaults()), heap)
    info = ModelInfo(
        model_name=spec.served_model_name, max_model_len=spec.scheduler.max_model_len,
        tokens_per_block=spec.kv.tokens_per_block, block_hash_algorithm=HASH_ALGORITHM, role=spec.role,
        vocab_size=engine.vocab_size, eos_token_ids=tuple(engine.tokenizer.eos_token_ids),
        lora_enabled=spec.lora is not None, max_loras=spec.lora.max_loras if spec.lora else 0,
    )
    return engine, info


def kv_memory_budget(spec: EngineSpec, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the KV cache may take on `device` (see memory_budget.py)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        step = StepShape(spec.scheduler.max_num_batched_tokens, spec.scheduler.max_num_seqs)
        non_kv = non_kv_bytes(config, torch.finfo(dtype).bits // 8, step)
        return gpu_kv_budget(total, free, spec.gpu_memory_utilization, non_kv)
    return cpu_kv_budget(available_ram())


def available_ram() -> int:
    """Bytes of RAM the OS reports available."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
