"""How many bytes a worker's KV cache may take, with `--gpu-memory-utilization` meaning what it means in vLLM.

On a GPU, the worker process as a whole (weights, activations, KV cache) may use
`utilization` × the device's total memory, and refuses to start when less than that is free
(another process holds the rest). vLLM measures the process's non-KV memory by loading the
model and profiling a forward pass of `max_num_batched_tokens`; pdserve sizes the KV cache
before it loads the weights, so it estimates the same figure: the weights at the model's dtype,
one step's activations, float32 logits of every running sequence, and a fixed allowance for the
CUDA context and kernel workspaces. On a CPU the flag does not apply (vLLM-CPU sizes its KV
cache by VLLM_CPU_KVCACHE_SPACE; pdserve by `--kv-cache-memory` / `--max-kv-tokens`); the cache
may then take at most CPU_RAM_FRACTION of the RAM available at start.
"""
from dataclasses import dataclass

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.model_config import ModelConfig

CPU_RAM_FRACTION = 0.9
CUDA_RUNTIME_ALLOWANCE = 512 << 20  # CUDA context, cuBLAS workspaces, allocator slack
_ACTIVATION_COPIES = 4  # live copies of the widest intermediate in one layer (inputs, outputs, residual)


@dataclass(frozen=True, slots=True)
class StepShape:
    """The largest step the scheduler runs: what the activations of one forward are sized by."""

    max_num_batched_tokens: int
    max_num_seqs: int


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the decoder (biases and norms included); a mixture's layers count every
    expert, since all are resident whichever a token runs."""
    attn_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (attn_width + 2 * kv_width) + attn_width * config.hidden_size
    attention += (attn_width + 2 * kv_width) * config.qkv_bias + config.hidden_size * config.o_bias
    attention += 2 * config.head_dim * config.qk_norm
    layers = sum(attention + _mlp_parameters(config, i) + 2 * config.hidden_size for i in range(config.num_layers))
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return layers + embeddings + config.hidden_size


def _mlp_parameters(config: ModelConfig, layer: int) -> int:
    if config.is_moe_layer(layer):
        moe = config.moe
        return moe.num_experts * (3 * config.hidden_size * moe.expert_intermediate_size + config.hidden_size)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return mlp + (2 * config.intermediate_size + config.hidden_size) * config.mlp_bias


def _widest_activation(config: ModelConfig) -> int:
    """Per token: the fused q|k|v or gate|up row, or a mixture's copies of the token, one per
    chosen expert (its input row, then its gate|up row)."""
    widest = max(2 * config.intermediate_size, (config.num_heads + 2 * config.num_kv_heads) * config.head_dim)
    if config.moe is not None:
        widest = max(widest, config.moe.top_k * max(2 * config.moe.expert_intermediate_size, config.hidden_size))
    return widest


def non_kv_bytes(config: ModelConfig, dtype_bytes: int, step: StepShape) -> int:
    """Estimated device memory of everything but the KV cache: weights, one step's activations
    (the widest per-token intermediate, a few live copies), the step's float32 logits, runtime."""
    weights = num_parameters(config) * dtype_bytes
    activations = step.max_num_batched_tokens * _widest_activation(config) * dtype_bytes * _ACTIVATION_COPIES
    logits = step.max_num_seqs * config.vocab_size * 4
    return weights + activations + logits + CUDA_RUNTIME_ALLOWANCE


def gpu_kv_budget(total_bytes: int, free_bytes: int, utilization: float, non_kv: int) -> int:
    """KV bytes when the process may use `utilization` of `total_bytes`; ConfigError when less
    than that is free at start, or when the model alone takes it all (as vLLM refuses)."""
    requested = int(total_bytes * utilization)
    if free_bytes < requested:
        raise ConfigError("gpu_memory_utilization", utilization,
                          f"{free_bytes / 2**30:.2f} GiB of the device's {total_bytes / 2**30:.2f} GiB are free, "
                          f"less than the {requested / 2**30:.2f} GiB asked for; lower it or free the device")
    budget = requested - non_kv
    if budget <= 0:
        raise ConfigError("gpu_memory_utilization", utilization,
                          f"the model needs about {non_kv / 2**30:.2f} GiB before any KV cache, more than the "
                          f"{requested / 2**30:.2f} GiB asked for; raise it")
    return budget


def cpu_kv_budget(available_ram: int) -> int:
    return int(available_ram * CPU_RAM_FRACTION)
