"""GGUF metadata the tiny checkpoints do not use: llama.cpp's own rules where a file is silent,
the options that map onto HF config fields, and ConfigError naming the key of each option
that pdserve does not serve."""
import math

import pytest

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.gguf_loader import load_gguf, load_gguf_config
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.loading.rope_config import LinearRopeScaling, Rope

from gguf_builders import make_family_source, write_hf_gguf


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """kind -> (config.json, tensors) of the builders' checkpoint."""
    root, made = tmp_path_factory.mktemp("sources"), {}

    def make(kind: str):
        if kind not in made:
            made[kind] = make_family_source(root / kind, kind, seed=0)
        return made[kind]
    return make


def config_of(source, tmp_path, kind: str, **meta) -> dict:
    """The HF config read from `kind`'s GGUF with `meta` (keys with '.' spelled '__') changed."""
    config, tensors = source(kind)
    path = tmp_path / "m.gguf"
    write_hf_gguf(path, config, tensors, meta={key.replace("__", "."): v for key, v in meta.items()})
    return load_gguf_config(str(path))


def test_gemma3_without_pattern_or_scale_takes_llama_cpps_rules(source, tmp_path):
    """As llama.cpp's converter writes Gemma 3: every sixth layer global, scores scaled by head_dim."""
    config = config_of(source, tmp_path, "gemma3", gemma3__attention__sliding_window_pattern=None,
                       gemma3__attention__scale=None)
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert config["query_pre_attn_scalar"] == 32
    assert ModelConfig.from_hf_config(config).layer_windows == ()  # one window on every layer
    assert ModelConfig.from_hf_config(config).sliding_window == 8


def test_gemma3_27b_scales_scores_by_hidden_over_heads(source, tmp_path):
    silent = dict(gemma3__attention__sliding_window_pattern=None, gemma3__attention__scale=None,
                  gemma3__attention__head_count=2, gemma3__attention__head_count_kv=2)
    assert config_of(source, tmp_path, "gemma3", gemma3__block_count=62, **silent)["query_pre_attn_scalar"] == 64
    assert config_of(source, tmp_path, "gemma3", gemma3__block_count=26, **silent)["query_pre_attn_scalar"] == 32


def test_gemma3_pattern_as_a_number(source, tmp_path):
    config = config_of(source, tmp_path, "gemma3", gemma3__attention__sliding_window_pattern=2)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]


def test_gemma3_without_a_window_has_only_global_layers(source, tmp_path):
    config = config_of(source, tmp_path, "gemma3", gemma3__attention__sliding_window=None)
    assert config["layer_types"] == ["full_attention", "full_attention"]
    assert ModelConfig.from_hf_config(config).window_of(0) is None


def test_gemma3_linear_rope_scales_the_global_layers_only(source, tmp_path):
    config = config_of(source, tmp_path, "gemma3", gemma3__rope__scaling__type="linear",
                       gemma3__rope__scaling__factor=8.0, gemma3__rope__freq_base_swa=None)
    model = ModelConfig.from_hf_config(config)
    assert model.rope_of(1) == Rope(1000000.0, LinearRopeScaling(8.0))
    assert model.rope_of(0) == Rope(10000.0)  # llama.cpp's local base where the file has none


def test_phi3_window_and_attention_factor(source, tmp_path):
    config = config_of(source, tmp_path, "phi3", phi3__attention__sliding_window=16,
                       phi3__rope__scaling__attn_factor=1.25)
    assert config["sliding_window"] == 16
    assert config["rope_parameters"]["attention_factor"] == 1.25
    assert ModelConfig.from_hf_config(config).rope_scaling.attention_factor == 1.25
    derived = config_of(source, tmp_path, "phi3")
    assert "attention_factor" not in derived["rope_parameters"]  # equal to what transformers derives
    assert ModelConfig.from_hf_config(derived).rope_scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(64)))


def test_phi3_without_factor_tensors_has_plain_rope(source, tmp_path):
    config, tensors = source("phi3")
    plain = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 256}}
    write_hf_gguf(tmp_path / "m.gguf", plain, tensors)
    assert ModelConfig.from_hf_config(load_gguf_config(str(tmp_path / "m.gguf"))).rope_scaling is None


def test_qwen3_moe_renormalises_unless_the_file_says_not(source, tmp_path):
    assert config_of(source, tmp_path, "qwen3_moe")["norm_topk_prob"] is True
    config = config_of(source, tmp_path, "qwen3_moe", qwen3moe__expert_weights_norm=False)
    assert ModelConfig.from_hf_config(config).moe.normalize_top_k is False


@pytest.mark.parametrize("kind, key, value", [
    ("gemma3", "gemma3.attn_logit_softcapping", 50.0),
    ("gemma3", "gemma3.attention.sliding_window_pattern", [True, False, True]),
    ("gemma3", "gemma3.rope.scaling.type", "yarn"),
    ("qwen3", "qwen3.rope.scaling.type", "yarn"),
    ("qwen3", "qwen3.rope.dimension_count", 16),  # partial rotary
    ("qwen3", "qwen3.attention.value_length", 64),
    ("qwen3", "qwen3.attention.head_count_kv", [2, 1]),  # per-layer
    ("phi3", "phi3.rope.dimension_count", 24),
    ("phi3", "phi3.rope.scaling.type", "yarn"),
    ("mixtral", "llama.expert_gating_func", 2),  # sigmoid
    ("mixtral", "llama.vocab_size", 301),
    ("qwen3_moe", "qwen3moe.expert_shared_count", 1),
    ("qwen3_moe", "qwen3moe.expert_weights_scale", 2.5),
])
def test_options_not_served_raise_config_error_naming_the_key(source, tmp_path, kind, key, value):
    config, tensors = source(kind)
    write_hf_gguf(tmp_path / "m.gguf", config, tensors, meta={key: value})
    with pytest.raises(ConfigError) as err:
        load_gguf(str(tmp_path / "m.gguf"))
    assert err.value.field == key


def test_longrope_without_its_factors_raises(source, tmp_path):
    config, tensors = source("phi3")
    plain = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 64}}
    write_hf_gguf(tmp_path / "m.gguf", plain, tensors, meta={"phi3.rope.scaling.type": "longrope"})
    with pytest.raises(ConfigError) as err:
        load_gguf_config(str(tmp_path / "m.gguf"))
    assert (err.value.field, err.value.value) == ("tensor", "rope_factors_long.weight")


def test_a_mixture_of_experts_conversion_is_cached(source, tmp_path):
    config, tensors = source("mixtral")
    write_hf_gguf(tmp_path / "m.gguf", config, tensors)
    _, first = load_gguf(str(tmp_path / "m.gguf"), cache_dir=str(tmp_path / "cache"))
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    _, cached = load_gguf(str(tmp_path / "m.gguf"), cache_dir=str(tmp_path / "cache"))
    assert sorted(cached) == sorted(first)
    assert all(cached[name].equal(first[name]) for name in first)
