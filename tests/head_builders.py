"""Drafting heads for speculative decoding tests, random and tiny, stored as the published ones are:
an EAGLE-1 head (yuhuili/EAGLE-LLaMA3-Instruct-8B's layout: `fc`, `layers.0.*` without an input
norm, a Llama config, PyTorch's pickled state dict in float16), an EAGLE-3 head
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's: `LlamaForCausalLMEagle3`, `fc` over three target layers,
`midlayer.*` with q/k/v over twice the width, `norm`, `lm_head` over a draft vocabulary, `d2t` and
`t2d`; safetensors in bfloat16) and a MiMo-style checkpoint (Xiaomi MiMo-7B's: a Qwen2 body,
`MiMoForCausalLM`, `num_nextn_predict_layers` and `model.mtp_layers.0.*` in the same files)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SCALE = 0.1  # wide, as the tiny targets' initializer_range: logits far apart, no near-ties in argmax


def _target_config(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


def _head_config(target: dict, **fields) -> dict:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id")
    config = {key: target[key] for key in keep if key in target}
    config.setdefault("rope_theta", 10000.0)
    return {**config, "hidden_act": "silu", "num_hidden_layers": 1, "model_type": "llama", "rope_scaling": None,
            "tie_word_embeddings": False, **fields}


def _layer(prefix: str, c: dict, generator: torch.Generator, input_width: int, qkv_bias: bool = False) -> dict:
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def matrix(*shape):
        return torch.randn(*shape, generator=generator) * SCALE

    tensors = {
        prefix + "self_attn.q_proj.weight": matrix(q, input_width),
        prefix + "self_attn.k_proj.weight": matrix(kv, input_width),
        prefix + "self_attn.v_proj.weight": matrix(kv, input_width),
        prefix + "self_attn.o_proj.weight": matrix(hidden, q),
        prefix + "post_attention_layernorm.weight": _norm(hidden, generator),
        prefix + "mlp.gate_proj.weight": matrix(inter, hidden),
        prefix + "mlp.up_proj.weight": matrix(inter, hidden),
        prefix + "mlp.down_proj.weight": matrix(hidden, inter),
    }
    if qkv_bias:
        tensors |= {prefix + f"self_attn.{p}_proj.bias": torch.randn(n, generator=generator) * SCALE
                    for p, n in (("q", q), ("k", kv), ("v", kv))}
    return tensors


def _norm(width: int, generator: torch.Generator) -> torch.Tensor:
    return 1.0 + torch.randn(width, generator=generator) * SCALE


def make_eagle_head(directory: Path, target: Path, seed: int = 1) -> Path:
    """An EAGLE-1 head for `target` (a Llama checkpoint)."""
    c = _target_config(target)
    generator = torch.Generator().manual_seed(seed)
    hidden = c["hidden_size"]
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * SCALE,
               **_layer("layers.0.", c, generator, hidden)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_head_config(c, architectures=["LlamaForCausalLM"],
                                                                   torch_dtype="float16")))
    torch.save({name: t.half() for name, t in tensors.items()}, directory / "pytorch_model.bin")
    return directory


def make_eagle3_head(directory: Path, target: Path, seed: int = 2, draft_vocab: int = 64,
                     aux_layers: list[int] | None = None, own_embedding: bool = False) -> Path:
    """An EAGLE-3 head for `target`: its draft vocabulary a random sorted subset of the target's;
    `aux_layers` goes into its config as `eagle_aux_hidden_state_layer_ids` (None: vLLM's default)."""
    c = _target_config(target)
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    targets = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=generator) * SCALE,
        **_layer("midlayer.", c, generator, 2 * hidden),
        "midlayer.input_layernorm.weight": _norm(hidden, generator),
        "midlayer.hidden_norm.weight": _norm(hidden, generator),
        "norm.weight": _norm(hidden, generator),
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=generator) * SCALE,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=generator) * SCALE
    tensors = {name: t.bfloat16() for name, t in tensors.items()}
    tensors |= {"d2t": targets - torch.arange(draft_vocab), "t2d": t2d}  # target id = draft id + d2t[draft id]
    fields = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab, "torch_dtype": "bfloat16"}
    if aux_layers is not None:
        fields["eagle_aux_hidden_state_layer_ids"] = aux_layers
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_head_config(c, **fields)))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def make_mimo_checkpoint(directory: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A MiMo-style checkpoint: a tiny Qwen2 saved by transformers, renamed `MiMoForCausalLM`, with
    one MTP layer's tensors beside its own. Returns the Qwen2 body (transformers' reference)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=300, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
    config = Qwen2Config(**fields | overrides)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    hf = json.loads((directory / "config.json").read_text())
    hf |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": 1}
    (directory / "config.json").write_text(json.dumps(hf))
    generator = torch.Generator().manual_seed(seed + 100)
    c = hf
    mtp = {**_layer("model.mtp_layers.0.", c, generator, c["hidden_size"], qkv_bias=True),
           "model.mtp_layers.0.input_layernorm.weight": _norm(c["hidden_size"], generator),
           "model.mtp_layers.0.token_layernorm.weight": _norm(c["hidden_size"], generator),
           "model.mtp_layers.0.hidden_layernorm.weight": _norm(c["hidden_size"], generator),
           "model.mtp_layers.0.input_proj.weight": torch.randn(c["hidden_size"], 2 * c["hidden_size"],
                                                               generator=generator) * SCALE,
           "model.mtp_layers.0.final_layernorm.weight": _norm(c["hidden_size"], generator)}
    weights = load_file(str(directory / "model.safetensors"))
    save_file(weights | mtp, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return model
