"""What a drafting head loses where it does not see the prompt (a decode worker's), and what
seeing it would cost there.

A head's K/V at a prompt position needs the target's hidden state there; a decode worker
receives the prompt's K/V from its prefill peer and never runs the target over the prompt.
`engine/spec/eagle.py` lets the head start at the first position it sees and attend only over
what it wrote from there. This script measures that choice against the other, in one run:

1. trains an EAGLE-1 head for the target (default: the bundled SmolLM2-135M) over this
   repository's Markdown, teacher-forced in windows of `--window` tokens, as EAGLE-1 was
   trained: from the target's final hidden state at p and the token at p + 1, regress the
   target's hidden state at p + 1 (smooth L1), whose LM head gives the target's own next token,
   plus `--ce-weight` times the cross-entropy of the LM head over the prediction against that
   token on `--ce-rows` rows a window (hidden states from pdserve's runner); saves it as EAGLE
   heads are published (config.json, pytorch_model.bin);
2. generates greedily from prompts cut from text the head did not train on, with the head
   drafting `--k` tokens, twice: `aggregated` (the head watches every prompt chunk, as on an
   aggregated worker) and `decode_worker` (the head is shown the decode steps only, exactly
   what a decode worker's head sees of a prompt a peer prefilled); acceptance per draft
   position and mean accepted tokens per drafting step for each;
3. times a target pass over each prompt (the other choice: recover the prompt's hidden states
   on the decode worker) against the request's decode time on the same runner.

    python benchmarks/head_context.py --json head-context.json
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.common.ids import RequestId
from pdserve.common.model_source import default_model_path
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.core.speculation import Speculator
from pdserve.engine.model.batch import ForwardBatch, ForwardOutput, HiddenCapture, HiddenStates, SeqChunk
from pdserve.engine.model.layers import RotaryEmbedding
from pdserve.engine.model.runner import ModelRunner
from pdserve.engine.spec.proposers import DrafterContext, build_proposer
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from pdserve.models.tokenizer import load_tokenizer

TOKENS_PER_BLOCK = 16
REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    args = _parse()
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model, None)
    text = "\n\n".join(Path(REPO, name).read_text() for name in _markdown_files())
    tokens = tokenizer.encode(text, add_special_tokens=False)
    split = int(len(tokens) * 0.8)
    train, held_out = tokens[:min(split, args.train_tokens)], tokens[split:]
    teacher_s = train_s = 0.0
    losses: list[float] = []
    if args.trained_head:
        head_dir = Path(args.trained_head)
    else:
        runner = _runner(args.model, args.window, args.kernels)
        started = time.monotonic()
        hidden, windows = _teacher(runner, train, args.window)
        teacher_s = time.monotonic() - started
        head_dir = Path(args.head_dir or tempfile.mkdtemp(prefix="pdserve-eagle-head-"))
        started = time.monotonic()
        head, losses = _train(runner, hidden, windows, args)
        train_s = time.monotonic() - started
        _save(head_dir, runner, head)
    prompts = [held_out[i * args.prompt_len * 2:i * args.prompt_len * 2 + args.prompt_len]
               for i in range(args.num_prompts)]
    rows = [_generate(args, head_dir, tokenizer, prompts, view) for view in ("aggregated", "decode_worker")]
    rows.append(_prompt_pass(args, prompts))
    accepted = {row["view"]: row["mean_accepted_per_step"] for row in rows if "view" in row}
    report = {
        "benchmark": "head_context",
        "config": {"model": str(args.model), "k": args.k, "train_tokens": len(train), "window": args.window,
                   "epochs": args.epochs, "num_prompts": len(prompts), "prompt_len": args.prompt_len,
                   "output_len": args.output_len, "kernels": args.kernels, "commit": _commit(),
                   "teacher_s": round(teacher_s, 1), "train_s": round(train_s, 1),
                   "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)] if losses else None,
                   "trained_head": args.trained_head},
        "results": rows,
        "ratios": {"mean_accepted_decode_worker_over_aggregated":
                   round(accepted["decode_worker"] / accepted["aggregated"], 3) if accepted["aggregated"] else None,
                   "prompt_pass_over_decode_time": rows[-1]["prompt_pass_over_decode_time"]},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_path(), help="the target (default: bundled SmolLM2-135M)")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--train-tokens", type=int, default=40000)
    parser.add_argument("--window", type=int, default=256, help="tokens of each training window")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ce-weight", type=float, default=0.1)
    parser.add_argument("--ce-rows", type=int, default=32, help="rows a window whose LM-head loss is taken")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-dir", help="where the trained head is saved (default: a temporary folder)")
    parser.add_argument("--trained-head", help="a head this script saved before: measure it, train none")
    parser.add_argument("--json")
    return parser.parse_args()


def _markdown_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return sorted(out.split())


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def _runner(model: str, num_tokens: int, kernels: str) -> ModelRunner:
    """A float32 runner whose KV cache holds `num_tokens` (and a block to spare)."""
    return ModelRunner.load(model, "float32", "cpu", num_blocks=num_tokens // TOKENS_PER_BLOCK + 2,
                            tokens_per_block=TOKENS_PER_BLOCK, kernels=kernels)


def _teacher(runner: ModelRunner, tokens: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final hidden state at every position of each window, and the windows'
    tokens: (W, window, H), (W, window)."""
    runner.capture_hidden(HiddenCapture(final=True))
    hidden, windows = [], []
    blocks = tuple(range(window // TOKENS_PER_BLOCK + 1))
    for start in range(0, len(tokens) - window + 1, window):
        ids = tokens[start:start + window]
        out = runner.forward(ForwardBatch((SeqChunk(RequestId("w"), tuple(ids), 0, blocks, is_prompt=True),)))
        hidden.append(out.hidden.final)
        windows.append(torch.tensor(ids))
    runner.capture_hidden(HiddenCapture())
    return torch.stack(hidden), torch.stack(windows)


class TrainableHead(torch.nn.Module):
    """EAGLE-1's arithmetic (engine/spec/eagle.py) as a module to train, up to the LM head; the
    target's embedding frozen."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        c = runner.config
        self.c, h, q, kv = c, c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def linear(n, k, scale=0.02):
            return torch.nn.Parameter(torch.randn(n, k) * scale)

        # starts as the identity on the hidden state (fc picks it, the sublayers add nothing)
        self.fc = torch.nn.Parameter(torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1))
        self.q_proj, self.k_proj, self.v_proj = linear(q, h), linear(kv, h), linear(kv, h)
        self.o_proj = linear(h, q, 0.0)
        self.post_norm = torch.nn.Parameter(torch.ones(h))
        self.gate, self.up = linear(c.intermediate_size, h), linear(c.intermediate_size, h)
        self.down = linear(h, c.intermediate_size, 0.0)
        self.rope = RotaryEmbedding(c.rope_of(0), c.head_dim, torch.device("cpu"))
        self.embed = runner.model.embed.detach()
        if runner.model.lm_head is None:  # handed to the native kernels: the embedding's copy where tied
            if not c.tie_word_embeddings:
                raise SystemExit("an untied target's LM head went to the native kernels: run with --kernels torch")
            self.lm_head = self.embed
        else:
            self.lm_head = runner.model.lm_head.detach()

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T), (B, T, H) -> the predicted next hidden states (B, T, H)."""
        c, (b, t) = self.c, next_tokens.shape
        x = F.linear(torch.cat((self.embed[next_tokens], hidden), dim=-1), self.fc)  # (B, T, H)
        cos, sin = self.rope.cos_sin(torch.arange(t), x.dtype)  # (T, 1, hd)
        q = RotaryEmbedding.apply(F.linear(x, self.q_proj).view(b, t, c.num_heads, c.head_dim), cos, sin)
        k = RotaryEmbedding.apply(F.linear(x, self.k_proj).view(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        v = F.linear(x, self.v_proj).view(b, t, c.num_kv_heads, c.head_dim)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              enable_gqa=True, scale=c.attention_scale)  # (B, nh, T, hd)
        h = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), self.o_proj)
        y = F.rms_norm(h, (h.shape[-1],), self.post_norm, c.rms_norm_eps)
        return h + F.linear(F.silu(F.linear(y, self.gate)) * F.linear(y, self.up), self.down)


def _train(runner: ModelRunner, hidden, windows, args) -> tuple[TrainableHead, list[float]]:
    """AdamW over shuffled windows, one a step; the loss averaged per 20 steps."""
    head = TrainableHead(runner)
    params = [p for p in head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * hidden.shape[0]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=max(steps, 1), pct_start=0.1)
    losses = []
    for _ in range(args.epochs):
        for i in torch.randperm(hidden.shape[0]).tolist():
            predicted = head(windows[i:i + 1, 1:], hidden[i:i + 1, :-1])[0]  # row p: (t_{p+1}, h_p) -> h_{p+1}
            loss = F.smooth_l1_loss(predicted, hidden[i, 1:])
            if args.ce_weight:
                rows = torch.randperm(predicted.shape[0])[:args.ce_rows]
                with torch.no_grad():
                    labels = F.linear(hidden[i, 1:][rows], head.lm_head).argmax(dim=1)  # the target's own next tokens
                loss = loss + args.ce_weight * F.cross_entropy(F.linear(predicted[rows], head.lm_head), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    return head, [sum(losses[i:i + 20]) / len(losses[i:i + 20]) for i in range(0, len(losses), 20)]


def _save(directory: Path, runner: ModelRunner, head: TrainableHead) -> None:
    c = runner.config
    directory.mkdir(parents=True, exist_ok=True)
    state = {"fc.weight": head.fc, "layers.0.self_attn.q_proj.weight": head.q_proj,
             "layers.0.self_attn.k_proj.weight": head.k_proj, "layers.0.self_attn.v_proj.weight": head.v_proj,
             "layers.0.self_attn.o_proj.weight": head.o_proj, "layers.0.post_attention_layernorm.weight": head.post_norm,
             "layers.0.mlp.gate_proj.weight": head.gate, "layers.0.mlp.up_proj.weight": head.up,
             "layers.0.mlp.down_proj.weight": head.down}
    torch.save({name: t.detach().clone() for name, t in state.items()}, directory / "pytorch_model.bin")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
              "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))


class DecodeWorkerView:
    """The proposer shown only decode steps: what a decode worker's head sees of a prompt its
    prefill peer computed (its first decode step is the first position it observes)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def propose(self, seqs, num_tokens):
        return self.inner.propose(seqs, num_tokens)

    def observe(self, batch: ForwardBatch, output: ForwardOutput) -> None:
        keep, rows, first = [], [], 0
        for chunk in batch.chunks:
            if not chunk.is_prompt:
                keep.append(chunk)
                rows.append(torch.arange(first, first + len(chunk.token_ids)))
            first += len(chunk.token_ids)
        if keep:
            index = torch.cat(rows)
            hidden = output.hidden
            shown = HiddenStates(None if hidden.final is None else hidden.final[index],
                                 None if hidden.layers is None else hidden.layers[index])
            self.inner.observe(ForwardBatch(tuple(keep)), ForwardOutput([], shown))


def _generate(args, head_dir: Path, tokenizer, prompts: list[list[int]], view: str) -> dict:
    max_len = args.prompt_len + args.output_len + args.k + TOKENS_PER_BLOCK
    runner = _runner(args.model, len(prompts) * max_len, args.kernels)
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK), runner.num_blocks)
    config = SchedulerConfig(len(prompts), 2048, max_len)
    spec = SpeculativeConfig("eagle", args.k, model=str(head_dir))
    proposer = build_proposer(spec, DrafterContext(runner, kv))
    if view == "decode_worker":
        proposer = DecodeWorkerView(proposer)
    engine = LLMEngine(runner, kv, tokenizer, config, speculator=Speculator(spec, proposer, kv, config.max_model_len))
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(RequestId(f"{view}{i}"), tuple(prompt), sampling))
    while engine.has_work:
        engine.step()
    elapsed = time.monotonic() - started
    spec_counts = engine.take_step_stats().spec
    drafts = max(spec_counts.num_drafts, 1)
    return {"view": view, "num_drafts": spec_counts.num_drafts, "num_draft_tokens": spec_counts.num_draft_tokens,
            "num_accepted_tokens": spec_counts.num_accepted_tokens,
            "acceptance_per_position": [round(n / drafts, 3) for n in spec_counts.accepted_per_pos],
            "mean_accepted_per_step": round(spec_counts.num_accepted_tokens / drafts, 3),
            "output_tokens_per_s": round(len(prompts) * args.output_len / elapsed, 1)}


def _prompt_pass(args, prompts: list[list[int]]) -> dict:
    """A target pass over each prompt (the decode worker recovering its hidden states) against
    decoding `--output-len` tokens after it without speculation, on the same runner."""
    runner = _runner(args.model, args.prompt_len + args.output_len + 16, args.kernels)
    runner.capture_hidden(HiddenCapture(final=True))
    pass_s, decode_s = [], []
    table = tuple(range(-(-(args.prompt_len + args.output_len) // TOKENS_PER_BLOCK)))
    for prompt in prompts:
        started = time.monotonic()
        out = runner.forward(ForwardBatch((SeqChunk(RequestId("p"), tuple(prompt), 0, table, is_prompt=True),)))
        pass_s.append(time.monotonic() - started)
        token, started = int(out.logits[0][-1].argmax()), time.monotonic()
        for pos in range(len(prompt), len(prompt) + args.output_len):
            token = int(runner.forward(ForwardBatch((SeqChunk(RequestId("p"), (token,), pos, table),))).logits[0][-1].argmax())
        decode_s.append(time.monotonic() - started)
    return {"prompt_pass_ms_mean": round(1000 * sum(pass_s) / len(pass_s), 1),
            "decode_ms_mean": round(1000 * sum(decode_s) / len(decode_s), 1),
            "prompt_pass_over_decode_time": round(sum(pass_s) / sum(decode_s), 3)}


if __name__ == "__main__":
    sys.exit(main())
