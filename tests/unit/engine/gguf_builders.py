"""Tiny Llama GGUF files for the loader and cache tests: random HF weights written the way
llama.cpp's converter writes them (llama.cpp names, Q/K rows permuted, optional quantization)."""
import gguf
import numpy as np

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
