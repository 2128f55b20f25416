"""Tiny GGUF files for the loader and cache tests, written the way llama.cpp's converter writes
them (llama.cpp names, Q/K rows permuted, optional quantization): random Llama weights, or a
tiny HF checkpoint of another family (model_builders)."""
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import safetensors.numpy

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, VOCAB, FFN = 64, 4, 2, 16, 2, 32, 96
LAYER_PARTS = {  # HF suffix -> (gguf part, shape)
    "self_attn.q_proj": ("attn_q", (NUM_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.k_proj": ("attn_k", (NUM_KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.v_proj": ("attn_v", (NUM_KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.o_proj": ("attn_output", (HIDDEN, NUM_HEADS * HEAD_DIM)),
    "mlp.gate_proj": ("ffn_gate", (FFN, HIDDEN)),
    "mlp.up_proj": ("ffn_up", (FFN, HIDDEN)),
    "mlp.down_proj": ("ffn_down", (HIDDEN, FFN)),
    "input_layernorm": ("attn_norm", (HIDDEN,)),
    "post_attention_layernorm": ("ffn_norm", (HIDDEN,)),
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF→GGUF converter does to Q/K rows (so the test checks the inverse)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def make_hf_weights(untied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32),
               "model.norm.weight": rng.standard_normal(HIDDEN, dtype=np.float32)}
    if untied:
        weights["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32)
    for layer in range(NUM_LAYERS):
        for suffix, (_, shape) in LAYER_PARTS.items():
            weights[f"model.layers.{layer}.{suffix}.weight"] = rng.standard_normal(shape, dtype=np.float32)
    return weights


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{LAYER_PARTS['.'.join(rest[:-1])][0]}.weight"


def write_gguf(path, weights, arch="llama", quantize=(), extra=()) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", NUM_LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", NUM_HEADS),
                       ("attention.head_count_kv", NUM_KV_HEADS), ("rope.dimension_count", HEAD_DIM)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for hf_name, array in weights.items():
        if hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, NUM_HEADS)
        elif hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, NUM_KV_HEADS)
        if hf_name in quantize:
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, quantize[hf_name]),
                              raw_dtype=quantize[hf_name])
        else:
            writer.add_tensor(gguf_name(hf_name), array)
    for name, array in extra:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- GGUF files of a tiny HF checkpoint, written as llama.cpp's convert_hf_to_gguf.py writes them.
# Tensor names come from gguf-py's own TensorNameMap (llama.cpp's table, not the loader's).

GGUF_ARCHS = {  # HF architecture -> llama.cpp's (Mixtral is its `llama` with experts)
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3, "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
}
_EXPERT = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight")


def read_hf_checkpoint(directory: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, {HF name: float32 array}) of a checkpoint as saved on disk."""
    config = json.loads((directory / "config.json").read_text())
    tensors = safetensors.numpy.load_file(directory / "model.safetensors")
    return config, {name: array.astype(np.float32) for name, array in tensors.items()}


def with_random_norms(tensors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Every norm weight perturbed: fresh checkpoints have all-ones (or all-zeros) norms, under
    which a norm mapped to the wrong HF name would go unnoticed."""
    rng = np.random.default_rng(seed)
    return {name: array + 0.1 * rng.standard_normal(array.shape, dtype=np.float32) if name.endswith("norm.weight")
            else array for name, array in tensors.items()}


def save_hf_checkpoint(directory: Path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")


def hf_gguf_metadata(config: dict) -> dict:
    """The metadata llama.cpp's converter writes for `config` (full keys), plus what the tiny
    Gemma 3 needs beyond it: its per-layer windows and its score scale, which the converter
    leaves to llama.cpp's fixed rules (every 6th layer global; 1/sqrt(head_dim))."""
    arch = gguf.MODEL_ARCH_NAMES[GGUF_ARCHS[config["architectures"][0]]]
    rope = config["rope_parameters"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    meta = {f"{arch}.{key}": value for key, value in [
        ("block_count", config["num_hidden_layers"]), ("context_length", config["max_position_embeddings"]),
        ("embedding_length", config["hidden_size"]), ("feed_forward_length", config["intermediate_size"]),
        ("attention.head_count", config["num_attention_heads"]),
        ("attention.head_count_kv", config["num_key_value_heads"]),
        ("attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"])),
        ("rope.freq_base", float(rope.get("full_attention", rope)["rope_theta"]))]}
    if config.get("head_dim"):
        meta |= {f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim}
    if experts := config.get("num_local_experts") or config.get("num_experts"):
        meta |= {f"{arch}.expert_count": experts, f"{arch}.expert_used_count": config["num_experts_per_tok"]}
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            meta[f"tokenizer.ggml.{key}"] = config[key]
    if arch == "llama":
        meta |= {"llama.vocab_size": config["vocab_size"], "llama.rope.dimension_count": head_dim}
    if arch == "qwen3moe":
        meta["qwen3moe.expert_feed_forward_length"] = config["moe_intermediate_size"]
    if arch == "gemma3":
        meta |= {"gemma3.attention.sliding_window": config["sliding_window"],
                 "gemma3.rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
                 "gemma3.attention.sliding_window_pattern": [t == "sliding_attention" for t in config["layer_types"]],
                 "gemma3.attention.scale": config["query_pre_attn_scalar"] ** -0.5}
        if config.get("final_logit_softcapping") is not None:
            meta["gemma3.final_logit_softcapping"] = float(config["final_logit_softcapping"])
    if arch == "phi3":
        original = rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        meta |= {"phi3.rope.dimension_count": head_dim, "phi3.rope.scaling.original_context_length": original,
                 "phi3.attention.sliding_window": config.get("sliding_window") or 0}
        if rope.get("rope_type") == "longrope":
            meta |= {"phi3.rope.scaling.type": "longrope", "phi3.rope.scaling.attn_factor":
                     math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0}
    return meta


def hf_gguf_tensors(config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{llama.cpp name: array} as the converter writes them: experts stacked (E, rows, cols),
    Gemma's norms as 1 + w, the llama arch's Q/K rows permuted, Phi-3's LongRoPE factors as tensors."""
    arch = GGUF_ARCHS[config["architectures"][0]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"])  # MoE's dense layers
    out, experts = {}, {}
    for name, array in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if match := _EXPERT.fullmatch(name):
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = array
            continue
        if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            array = array + 1
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = llama_cpp_permute(array, heads)
        stem, kind = name.rsplit(".", 1)  # kind: weight or bias (Qwen2's q/k/v)
        out[f"{names.get_name(stem) or dense_names.get_name(stem)}.{kind}"] = array
    for stem, by_expert in experts.items():
        out[f"{names.get_name(stem)}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def write_hf_gguf(path, config: dict, tensors: dict[str, np.ndarray], qtype=None, meta=None) -> None:
    """A GGUF of the HF checkpoint (`config`, `tensors`); with `qtype`, every matrix quantized
    (vectors stay F32, as the converter keeps them). `meta` replaces or adds keys (None: drop)."""
    metadata = {**hf_gguf_metadata(config), **(meta or {})}
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCHS[config["architectures"][0]]])
    for key, value in metadata.items():
        if value is not None:
            _add_value(writer, key, value)
    for name, array in hf_gguf_tensors(config, tensors).items():
        if qtype is not None and array.ndim >= 2:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_value(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def make_family_source(directory: Path, kind: str, seed: int) -> tuple[dict, dict[str, np.ndarray]]:
    """A tiny HF checkpoint of `kind` (model_builders) saved in `directory`, its norms randomized:
    (config.json, tensors). transformers loads it as the reference model."""
    from model_builders import make_checkpoint
    make_checkpoint(directory / "fresh", kind)
    config, tensors = read_hf_checkpoint(directory / "fresh")
    tensors = with_random_norms(tensors, seed)
    save_hf_checkpoint(directory, config, tensors)
    return config, tensors
