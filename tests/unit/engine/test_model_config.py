"""ModelConfig from config.json dicts: every field, both rope spellings, and typed refusals."""
import pytest

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.model_config import Llama3RopeScaling, ModelConfig

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": [2, 7],
    "torch_dtype": "bfloat16",
}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def with_(**changes) -> dict:
    return {**LLAMA, **changes}


def test_llama_fields():
    assert ModelConfig.from_hf_config(LLAMA) == ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None,
        tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2, 7),
        torch_dtype="bfloat16")


def test_explicit_head_dim_and_missing_kv_heads():
    config = ModelConfig.from_hf_config(with_(head_dim=32, num_key_value_heads=None))
    assert (config.head_dim, config.num_kv_heads, config.num_queries_per_kv) == (32, 4, 1)


def test_qwen2_has_qkv_bias_and_ignores_an_unused_window():
    config = ModelConfig.from_hf_config(with_(architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                              use_sliding_window=False, eos_token_id=5))
    assert (config.qkv_bias, config.o_bias, config.sliding_window, config.eos_token_ids) == (True, False, None, (5,))


def test_qwen2_windows_the_layers_from_max_window_layers_on():
    config = ModelConfig.from_hf_config(with_(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                              sliding_window=64, max_window_layers=1))
    assert [config.window_of(i) for i in range(2)] == [None, 64]


@pytest.mark.parametrize("window, expected", [(None, None), (64, 64), (256, None), (4096, None)])
def test_mistral_window_kept_only_when_it_masks_something(window, expected):
    config = ModelConfig.from_hf_config(with_(architectures=["MistralForCausalLM"], sliding_window=window))
    assert config.sliding_window == expected


def test_llama_attention_bias_covers_qkv_and_o():
    config = ModelConfig.from_hf_config(with_(attention_bias=True, mlp_bias=True))
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, True, True)


@pytest.mark.parametrize("rope_keys", [
    {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING},
    {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}},
])
def test_llama3_scaling_in_either_spelling(rope_keys):
    hf = {k: v for k, v in LLAMA.items() if k != "rope_theta"} | rope_keys
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_default_rope_parameters_mean_no_scaling():
    hf = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    config = ModelConfig.from_hf_config(hf | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert (config.rope_theta, config.rope_scaling) == (1e4, None)


def test_unsupported_architecture_is_named():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as err:
        ModelConfig.from_hf_config(with_(architectures=["GPT2LMHeadModel"]))
    assert err.value.field == "architectures"


@pytest.mark.parametrize("changes, field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": "300"}, "vocab_size"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -1}, "sliding_window"),
])
def test_bad_values_raise_config_error_naming_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_config(with_(**changes))
    assert err.value.field == field


def test_gemma3_older_spelling_scales_only_the_global_layers():
    config = ModelConfig.from_hf_config(with_(
        architectures=["Gemma3ForCausalLM"], head_dim=16, sliding_window=64, sliding_window_pattern=2,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [config.window_of(i) for i in range(2)] == [64, None]
    assert config.rope_of(0).theta == 10000.0 and config.rope_of(0).scaling is None
    assert config.rope_of(1).theta == 1000000.0 and config.rope_of(1).scaling.factor == 8.0


@pytest.mark.parametrize("changes, field", [
    ({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 5,
      "moe_intermediate_size": 32}, "num_experts_per_tok"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 0, "num_experts_per_tok": 2},
     "num_local_experts"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_an_option_not_served_is_refused_naming_its_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_config(with_(**changes))
