"""Time the model forward alone: prefill throughput and batched decode throughput.

A random-weight Llama (default shape: the common 160M Llama, hidden 768, 12 layers,
12 heads, intermediate 3072, vocab 32000) runs in bf16. Prefill computes every prompt in
steps of at most `--prefill-budget` tokens; decode then runs `--decode-steps` steps with one
new token for each of `--seqs` sequences per step, as a continuous batch would. Prints one
JSON object in the set's shape (`README.md`; its one row holds the figures), and writes it to
`--json PATH` when given, as `run_all.py` asks.

    .venv/bin/python benchmarks/model_forward.py --seqs 64 --prompt-len 128 --decode-steps 128

KV blocks hold 64 tokens, as a worker on a CPU stores them (`--tokens-per-block` changes it),
and the C heap keeps freed memory between steps, as a worker sets it (`pdserve/worker/cpu/heap.py`).
"""
import argparse
import json
import time

import torch

from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.decoder import CausalLM
from pdserve.engine.model.kv_tensor import PagedKvCache, allocate_kv_tensor
from pdserve.engine.model.native_forward import KERNEL_CHOICES, build_native
from pdserve.engine.model.runner import ModelRunner
from pdserve.worker.cpu.heap import keep_step_memory
from pdserve.worker.memory_budget import num_parameters


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("hidden", 768), ("layers", 12), ("heads", 12), ("kv-heads", 12),
                          ("intermediate", 3072), ("vocab", 32000), ("seqs", 64), ("prompt-len", 128),
                          ("decode-steps", 128), ("prefill-budget", 2048), ("tokens-per-block", 64),
                          ("threads", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                   help="native CPU kernels (auto: where they run) or torch ops")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args()


def random_runner(args: argparse.Namespace) -> ModelRunner:
    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "max_position_embeddings": 4096,
    })
    dtype, device = getattr(torch, args.dtype), torch.device("cpu")
    shapes = {"model.embed_tokens.weight": (args.vocab, args.hidden), "model.norm.weight": (args.hidden,),
              "lm_head.weight": (args.vocab, args.hidden)}
    q, kv = args.heads * config.head_dim, args.kv_heads * config.head_dim
    for i in range(args.layers):
        for part, shape in [("input_layernorm", (args.hidden,)), ("post_attention_layernorm", (args.hidden,)),
                            ("self_attn.q_proj", (q, args.hidden)), ("self_attn.k_proj", (kv, args.hidden)),
                            ("self_attn.v_proj", (kv, args.hidden)), ("self_attn.o_proj", (args.hidden, q)),
                            ("mlp.gate_proj", (args.intermediate, args.hidden)),
                            ("mlp.up_proj", (args.intermediate, args.hidden)),
                            ("mlp.down_proj", (args.hidden, args.intermediate))]:
            shapes[f"model.layers.{i}.{part}.weight"] = shape
    tensors = {name: (torch.randn(shape) * 0.02).to(dtype) for name, shape in shapes.items()}
    max_len = args.prompt_len + args.decode_steps
    num_blocks = args.seqs * -(-max_len // args.tokens_per_block)
    storage = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    cache = PagedKvCache(allocate_kv_tensor(config, num_blocks, args.tokens_per_block, storage), dtype)
    model = CausalLM(config, tensors, device)
    return ModelRunner(model, cache, dtype, device, build_native(model, cache, args.kernels, None))


def block_tables(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """Sequence i owns blocks i, i + seqs, ...: scattered, like a pool after some churn."""
    per_seq = -(-(args.prompt_len + args.decode_steps) // args.tokens_per_block)
    return [tuple(range(i, per_seq * args.seqs, args.seqs)) for i in range(args.seqs)]


def prefill(runner: ModelRunner, prompts: list[list[int]], tables, budget: int) -> float:
    """Seconds to compute every prompt, whole prompts packed into steps of <= budget tokens."""
    steps, current, used = [], [], 0
    for i, tokens in enumerate(prompts):
        if current and used + len(tokens) > budget:
            steps.append(current)
            current, used = [], 0
        current.append(SeqChunk(str(i), tuple(tokens), 0, tables[i], is_prompt=True))
        used += len(tokens)
    steps.append(current)
    start = time.perf_counter()
    for chunks in steps:
        runner.forward(ForwardBatch(tuple(chunks)))
    return time.perf_counter() - start


def decode(runner: ModelRunner, prompt_len: int, tables, num_steps: int) -> tuple[list[float], list[float]]:
    """Per-step (wall, process CPU) seconds of greedy decode of every sequence together.

    CPU seconds are what the step cost this process: on a shared machine they stay steady
    while wall time swings with other load (with several threads they add up across threads)."""
    last = [1] * len(tables)
    wall, cpu = [], []
    for step in range(num_steps):
        pos = prompt_len + step
        batch = ForwardBatch(tuple(SeqChunk(str(i), (last[i],), pos, t) for i, t in enumerate(tables)))
        start, start_cpu = time.perf_counter(), time.process_time()
        out = runner.forward(batch)
        last = torch.cat(out.logits).argmax(dim=-1).tolist()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = random_runner(args)
    heap = keep_step_memory()  # as a worker does once its model is loaded
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.seqs, args.prompt_len), generator=generator).tolist()
    tables = block_tables(args)
    prefill(runner, prompts[:2], tables, args.prefill_budget)  # warm up kernels and allocator
    prefill_s = prefill(runner, prompts, tables, args.prefill_budget)
    step_s, step_cpu_s = decode(runner, args.prompt_len, tables, args.decode_steps)
    steady, steady_cpu = sorted(step_s[1:] or step_s), sorted(step_cpu_s[1:] or step_cpu_s)
    figures = {
        "prefill_tokens_per_s": round(args.seqs * args.prompt_len / prefill_s, 1),
        "decode_tokens_per_s": round(args.seqs * args.decode_steps / sum(step_s), 1),
        "decode_step_ms_p50": round(1e3 * steady[len(steady) // 2], 2),
        "decode_step_ms_p90": round(1e3 * steady[int(len(steady) * 0.9)], 2),
        "decode_step_cpu_ms_p50": round(1e3 * steady_cpu[len(steady_cpu) // 2], 2),
    }
    result = {
        "benchmark": "model_forward",
        "config": {
            "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")},
            "params_m": round(num_parameters(runner.config) / 1e6, 1),
            "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "threads": torch.get_num_threads(),
            "kernels": "native" if runner.native is not None else "torch",
            "seqs": args.seqs, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
            "tokens_per_block": args.tokens_per_block, "prefill_budget": args.prefill_budget, "c_heap": heap,
        },
        "results": [figures],
        # the share of the wall time this process computed (threads add up): below 1 per thread,
        # the machine's other load took the rest
        "ratios": {"decode step p50: CPU / wall": steady_cpu[len(steady_cpu) // 2] / steady[len(steady) // 2]},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
