"""`--gpu-memory-utilization` as vLLM means it: the share of the GPU's total memory the whole
worker may use; the KV cache gets what the weights and one step's activations leave."""
import pytest
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.weights import load_model_config
from pdserve.worker.memory_budget import (
    CPU_RAM_FRACTION,
    CUDA_RUNTIME_ALLOWANCE,
    StepShape,
    cpu_kv_budget,
    gpu_kv_budget,
    non_kv_bytes,
    num_parameters,
)

GIB = 1 << 30


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_transformers(tmp_path, tied: bool) -> None:
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert num_parameters(load_model_config(str(tmp_path))) == expected


MOE_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2)
MOE_MODELS = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=8, **MOE_SHAPE)),
    # experts of their own width, a dense layer among the sparse ones, per-head q/k norms
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=8, moe_intermediate_size=48,
                                                            mlp_only_layers=[1], **MOE_SHAPE)),
}


@pytest.mark.parametrize("kind", MOE_MODELS)
def test_every_expert_counts_in_a_mixture(tmp_path, kind: str) -> None:
    """All experts' weights are resident, not only the top-k a token runs."""
    model = MOE_MODELS[kind]()
    model.save_pretrained(tmp_path)
    assert num_parameters(load_model_config(str(tmp_path))) == sum(p.numel() for p in model.parameters())


def test_a_mixture_steps_activations_hold_each_token_top_k_times(tmp_path) -> None:
    MOE_MODELS["mixtral"]().save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path))
    step = StepShape(4096, 8)
    weights_and_rest = num_parameters(config) * 2 + 8 * 320 * 4 + CUDA_RUNTIME_ALLOWANCE
    # the experts' rows: each token twice (top-2), at the widest of 2 x 96 (gate|up) and 64 (hidden)
    assert non_kv_bytes(config, 2, step) - weights_and_rest == 4096 * 2 * (2 * 96) * 2 * 4


def test_the_estimate_grows_with_the_step_and_the_dtype(tmp_path) -> None:
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path))
    small, large = StepShape(256, 8), StepShape(4096, 256)
    assert non_kv_bytes(config, 2, small) < non_kv_bytes(config, 2, large) < non_kv_bytes(config, 4, large)
    assert non_kv_bytes(config, 2, small) > num_parameters(config) * 2


def test_the_kv_cache_gets_what_the_process_share_leaves() -> None:
    assert gpu_kv_budget(total_bytes=80 * GIB, free_bytes=79 * GIB, utilization=0.9, non_kv=20 * GIB) == \
        int(80 * GIB * 0.9) - 20 * GIB


def test_less_free_than_asked_for_is_refused_as_vllm_does() -> None:
    with pytest.raises(ConfigError, match="less than the"):
        gpu_kv_budget(total_bytes=80 * GIB, free_bytes=40 * GIB, utilization=0.9, non_kv=GIB)


def test_a_model_larger_than_its_share_is_refused() -> None:
    with pytest.raises(ConfigError, match="raise it"):
        gpu_kv_budget(total_bytes=16 * GIB, free_bytes=16 * GIB, utilization=0.5, non_kv=9 * GIB)


def test_on_cpu_the_flag_does_not_apply() -> None:
    assert cpu_kv_budget(10 * GIB) == int(10 * GIB * CPU_RAM_FRACTION)
