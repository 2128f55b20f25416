"""Each benchmark script at its tiny setting, and what its report must then hold.

`{model}` in a script's arguments is the session's tiny checkpoint (test_benchmark_scripts.py),
`{other}` the URL of a `pdserve serve` the session keeps up as the "other server" that
serve_throughput.py and vs_vllm.py compare against. A module of its own (not conftest), so the
test imports it by a name no other test folder uses.
"""
from collections.abc import Callable
from dataclasses import dataclass

# What benchmarks/README.md promises of every script's JSON.
SET_KEYS = {"benchmark", "config", "results", "ratios"}


@dataclass(frozen=True)
class ScriptRun:
    args: tuple[str, ...]
    check: Callable[[dict], None]  # asserts what the script's README section names


def rows_of(report: dict, *keys: str) -> list[tuple]:
    return [tuple(row.get(key) for key in keys) for row in report["results"]]


def _kvcache_ops(report: dict) -> None:
    assert rows_of(report, "policy", "num_requests") == [("priority", 200), ("lru", 200)]
    assert set(report["ratios"]) == {"hit_rate_priority_over_lru", "us_per_request_priority_over_lru"}


def _kvcache_integrity(report: dict) -> None:
    assert rows_of(report, "num_blocks", "num_used_blocks") == [(64, 16), (256, 64)]
    assert set(report["ratios"]) == {"us_per_block_largest_over_smallest"}


def _guided_sampling(report: dict) -> None:
    assert rows_of(report, "num_guided_rows") == [(0,), (1,), (4,)]
    assert report["ratios"]["0_guided_over_unguided"] == 1.0


def _sampler_processors(report: dict) -> None:
    each = ["none", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
            "bad_words"]
    every_row = [(case, mode, 8) for case in each for mode in ("greedy", "sampled")]
    one_in_eight = [("all", mode, rows) for mode in ("greedy", "sampled") for rows in (8, 1)]
    assert rows_of(report, "case", "mode", "rows_with_it") == every_row + one_in_eight
    assert "all_sampled_1rows_over_none" in report["ratios"]


def _router_scale(report: dict) -> None:
    assert rows_of(report, "workers", "indexed_blocks", "num_decisions") == [(1, 500, 5), (2, 500, 5)]
    assert "plan_p50_largest_over_smallest" in report["ratios"]


def _model_forward(report: dict) -> None:
    (row,) = report["results"]
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms_p50"} <= row.keys()
    assert (report["config"]["seqs"], report["config"]["decode_steps"]) == (2, 4)
    assert set(report["ratios"]) == {"decode step p50: CPU / wall"}


def _lora_batching(report: dict) -> None:
    torch_cases = ["torch_lora_off", "torch_lora_on_0_adapters", "torch_lora_on_1_adapters",
                   "torch_lora_on_4_adapters"]
    assert [case for (case,) in rows_of(report, "case")][:4] == torch_cases
    assert "decode torch_lora_on_4_adapters / torch_lora_off" in report["ratios"]


def _packed_products(report: dict) -> None:
    assert rows_of(report, "rows") == [(1,), (8,)]
    assert len(report["ratios"]) == 2 * (len(report["results"][0]["median_ms"]) - 1)


def _prefill_attention(report: dict) -> None:
    assert rows_of(report, "kernel", "round") == [("native", 0), ("torch_flash", 0)]
    assert report["max_abs_difference"] < 0.1  # the two kernels attend alike (bf16 rounding apart)
    assert set(report["ratios"]) == {"ms_per_model: native / torch_flash (medians)"}


def _transfer_bandwidth(report: dict) -> None:
    assert rows_of(report, "mode", "case", "num_blocks") == [
        ("peer", "1 block", 1), ("peer", "16 blocks", 16), ("peer", "256 blocks", 256), ("peer", "64-token prompt", 4)]
    (run,) = report["runs"]
    assert run["setup"]["pool_blocks"] == 2 * 256  # room for the largest case twice over


def _decode_bandwidth(report: dict) -> None:
    assert rows_of(report, "system") == [("forward-native",), ("forward-torch",), ("served-agg (TPOT p50)",)]
    assert {"read_bandwidth_gb_s", "read_bandwidth_after_gb_s", "limit_ms"} <= report.keys()
    assert set(report["ratios"]) == {"forward step: torch / native"}


def _serve_throughput(report: dict) -> None:
    assert rows_of(report, "system", "workload") == [
        ("pdserve", "startup"), ("pdserve", "offline"), ("pdserve", "random"), ("pdserve", "prefix16"),
        ("other", "random"), ("other", "prefix16")]
    assert [row.get("completed") for row in report["results"][1:]] == [2] * 5  # offline: mutual TLS to the worker
    assert "output_tok_s (prefix16): pdserve / other" in report["ratios"]


def _disagg_vs_agg(report: dict) -> None:
    assert rows_of(report, "system", "workload") == [
        (name, workload) for name in ("agg-1", "disagg") for workload in ("startup", "random", "prefix16")]
    disagg_start = report["results"][3]
    assert any(key.startswith("kv_transfer_blocks_count") for key in disagg_start)
    assert "output_tok_s (random): disagg / agg-1" in report["ratios"]


def _burst(report: dict) -> None:
    assert rows_of(report, "system", "completed", "failed") == [("1p1d", 4, 0), ("aggregated", 4, 0)]
    assert report["results"][0]["remote_prefills"] + report["results"][0]["local_prefills"] == 4
    assert report["results"][1]["remote_prefills"] == 0  # nothing moves between aggregated workers
    assert "ttft_p50_ms: 1p1d / aggregated" in report["ratios"]


def _routing(report: dict) -> None:
    assert rows_of(report, "policy", "num_requests", "num_failed") == [("kv_aware", 4, 0), ("round_robin", 4, 0)]
    assert report["config"]["workers"] == {"prefill": 1, "decode": 1}
    assert report["results"][0]["api_cached_rate"] > 0  # the second turn extends the first
    assert "kv_aware_over_round_robin_output_tok_s" in report["ratios"]


def _vs_vllm(report: dict) -> None:
    workloads = ["random", "single", "prefix192", "long"]
    assert rows_of(report, "system", "workload") == [
        ("pdserve-agg", "startup"), *[(system, w) for w in workloads for system in ("pdserve-agg", "other")]]
    assert "output_tok_s (long): pdserve-agg / other" in report["ratios"]


def _internal_tls(report: dict) -> None:
    assert rows_of(report, "system", "workload") == [
        ("tls", "grpc_call"), ("plain", "grpc_call"), ("tls", "write_grant_64_blocks"),
        *[(system, workload) for system in ("tls", "plain") for workload in ("startup", "single", "random")]]
    assert "output_tok_s (random): tls / plain" in report["ratios"]


def _isolation_audit(report: dict) -> None:
    # two samples of each kind: the victim's repeats hit its cache, the attacker's probes never do
    assert rows_of(report, "kind", "samples", "num_with_cached_tokens") == [
        ("hit", 2, 2), ("cross", 2, 0), ("miss", 2, 0)]
    assert set(report["verdicts"]) == {"ttft_s", "cached_tokens"}
    assert set(report["ratios"]) == {"ttft_p50_ms: hit / miss", "ttft_p50_ms: cross / miss"}


def _tiers(report: dict) -> None:
    by_workload = {}
    for workload, system in rows_of(report, "workload", "system"):
        by_workload.setdefault(workload, []).append(system)
    assert by_workload["priority_vs_lru"] == ["priority", "lru"]
    assert by_workload["tier_ttft"][0] == "prefix in nowhere"  # where the tiny model's prompts land: no eviction
    assert by_workload["multi_turn"] == ["device only", "device + host", "device + host + disk"]
    assert "output_tok_s (multi_turn): device + host + disk / device only" in report["ratios"]


def _soak(report: dict) -> None:
    # the workers' KV bookkeeping, read over their mutual TLS, checks out once the load stops
    assert (report["ratios"]["integrity_ok_after decode"], report["ratios"]["integrity_ok_after prefill"]) == (1.0, 1.0)
    assert report["config"]["kill"]["answering_again_after_s"] is not None
    assert [s["phase"] for s in report["samples"]][::len(report["samples"]) - 1] == ["idle-before", "idle-after"]


def _startup(report: dict) -> None:
    assert rows_of(report, "part", "case") == [  # no metadata to parse: the tiny model is a checkpoint directory
        ("worker", "no_cache"), ("worker", "empty_cache"), ("worker", "filled_cache"),
        ("router_tokenizer", "no_cache"), ("router_tokenizer", "filled_cache")]
    assert set(report["ratios"]) == {"worker total_s: filled_cache / no_cache",
                                     "router_tokenizer total_s: filled_cache / no_cache"}


def _abuse(report: dict) -> None:
    cases = ["slow_bodies", "stalled_readers", "tokenize", "completion_batch", "echo_logprobs", "plain_companions",
             "logit_bias", "guided_schemas"]
    assert [row["case"] for row in report["results"]] == ["baseline", *cases, "baseline_end"]
    assert all(row["streams_ok"] == row["streams"] > 0 for row in report["results"])  # no normal stream refused
    abusers = {row["case"]: row["abusers"] for row in report["results"][1:-1]}
    assert abusers["slow_bodies"]["status_counts"] == {"408": 20}  # answered, none given a place
    assert abusers["stalled_readers"]["status_counts"] == {"200": 2}
    assert abusers["stalled_readers"]["places_freed_after_s"] is not None
    assert abusers["tokenize"]["status_counts"] == {"200": 1}
    assert abusers["completion_batch"]["error_param"] == "prompt[7]"  # the too-long last prompt, once all are read
    assert abusers["echo_logprobs"]["prompt_tokens_answered"] == [512, 512]
    assert abusers["logit_bias"]["over_cap"] == {"entries": 1025, "status": 400}
    assert set(abusers["guided_schemas"]["status_counts"]) <= {"200"}
    ratios = {f"tpot: {case} / baseline" for case in cases} | {"tpot: logit_bias / plain_companions"}
    assert ratios <= report["ratios"].keys()
    assert set(report["targets"]) == set(cases)


def _moe_vs_dense(report: dict) -> None:
    assert rows_of(report, "system", "workload", "streams", "completed", "failed") == [
        (model, workload, streams, completed, 0) for model in ("moe", "dense")
        for workload, streams, completed in (("single", 1, 2), ("in_flight", 4, 4))]
    paths = report["config"]["forward_path"]
    assert set(paths) == {"moe", "dense"} and paths["moe"] == paths["dense"]  # both native (or both torch)
    active = report["config"]["active_parameters"]
    # the same MLP weights run per token (the mixture's router apart: 2 layers x 4 experts x 128)
    assert active["moe"] - active["dense"] == 2 * 4 * 128 and active["moe"] < report["config"]["parameters"]["moe"]
    assert "output_tok_s (in_flight): moe / dense" in report["ratios"]


def _serving_overhead(report: dict) -> None:
    # HEAD in a worktree against this tree: both trees' processes ran under the stub forward
    assert set(report["config"]["trees"]) == {"before", "after"}
    assert rows_of(report, "tree", "streams", "failed") == [("before", 1, 0), ("before", 4, 0), ("after", 1, 0),
                                                            ("after", 4, 0)]
    assert all(row["output_tokens"] == row["expected_tokens"] for row in report["results"])  # ignore_eos: all of them
    figures = {"router_cpu_s_per_1k_tokens", "worker_both_cpu_s_per_1k_tokens", "total_cpu_s_per_1k_tokens",
               "tokens_per_s", "itl_p50_ms", "itl_p99_ms"}
    assert [(s["tree"], s["streams"]) for s in report["summary"]] == [("before", 1), ("after", 1), ("before", 4),
                                                                      ("after", 4)]
    assert all(figures <= s.keys() for s in report["summary"])
    assert {"total_cpu_s_per_1k_tokens @4: after / before", "itl_p99_ms @4: after / before"} <= report["ratios"].keys()
    assert set(report["targets"]) == {"total_cpu_after_over_before_at_4", "itl_p99_after_over_before_at_4"}
    assert {"cpu", "isa"} <= report["machine"].keys()


def _speculative(report: dict) -> None:
    assert rows_of(report, "system", "workload", "concurrency", "failed") == [
        (system, workload, 1, 0) for system in ("no_spec", "spec") for workload in ("copy", "random")]
    spec = [row for row in report["results"] if row["system"] == "spec"]
    assert all(row["num_drafts"] > 0 and 0 <= row["num_accepted_tokens"] <= row["num_draft_tokens"] for row in spec)
    assert all(row["num_drafts"] == 0 for row in report["results"] if row["system"] == "no_spec")
    assert set(report["ratios"]) == {f"{figure} ({workload} @1): spec / no_spec" for workload in ("copy", "random")
                                     for figure in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")}


def _head_context(report: dict) -> None:
    assert rows_of(report, "view") == [("aggregated",), ("decode_worker",), (None,)]
    assert {"acceptance_per_position", "mean_accepted_per_step"} <= report["results"][0].keys()
    assert set(report["ratios"]) == {"mean_accepted_decode_worker_over_aggregated", "prompt_pass_over_decode_time"}


SMALL_SERVING = ("--model", "{model}", "--num-prompts", "2", "--input-len", "32", "--output-len", "4",
                 "--prefix-len", "16", "--max-concurrency", "2", "--num-warmups", "0", "--kv-cache-memory", "64MiB")
SMALL_MODEL = ("--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "256",
               "--vocab", "512", "--seqs", "2", "--prompt-len", "16")

# Longest first: the test runs them side by side in this order.
RUNS: dict[str, ScriptRun] = {
    "tiers.py": ScriptRun(("--model", "{model}", "--trials", "1", "--conversations", "1", "--turns", "2"), _tiers),
    "vs_vllm.py": ScriptRun(("--model", "{model}", "--scale", "0.01", "--only", "pdserve-agg",
                             "--compare", "other={other}"), _vs_vllm),
    "internal_tls.py": ScriptRun(("--model", "{model}", "--scale", "0.03", "--single-pass", "--calls", "20"),
                                 _internal_tls),
    "soak.py": ScriptRun(("--model", "{model}", "--minutes", "0.15", "--sample-interval", "1"), _soak),
    "abuse.py": ScriptRun(("--model", "{model}", "--stream-tokens", "16", "--baseline-streams", "1", "--case-streams",
                           "1", "--companion-rounds", "1", "--slow-connections", "20", "--slow-byte-interval", "0.3",
                           "--body-read-timeout", "2", "--stalled-readers", "2", "--stalled-choices", "2",
                           "--stalled-max-tokens", "64", "--send-timeout", "2", "--tokenize-bytes", "262144",
                           "--batch-prompts", "8", "--echo-tokens", "512", "--companions", "2",
                           "--guided-max-tokens", "16"), _abuse),
    "startup.py": ScriptRun(("--model", "{model}",), _startup),
    "burst.py": ScriptRun(("--model", "{model}", "--num-prompts", "4", "--input-len", "48", "--output-len", "4",
                           "--num-warmups", "0", "--serve-flags", "--max-model-len 256 --kv-cache-memory 64MiB"),
                          _burst),
    "routing.py": ScriptRun(("--model", "{model}", "--prefill", "1", "--decode", "1", "--num-system-prompts", "1",
                             "--num-users", "2", "--turns", "2", "--system-len", "64", "--user-len", "16",
                             "--reply-len", "8", "--output-len", "4", "--max-kv-tokens", "4096"), _routing),
    "serving_overhead.py": ScriptRun(("--model", "{model}", "--before", "HEAD", "--streams", "1,4", "--prompt-len",
                                      "16", "--max-tokens", "8", "--min-tokens", "64", "--repeats", "1"),
                                     _serving_overhead),
    "moe_vs_dense.py": ScriptRun(("--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts",
                                  "4", "--expert-intermediate", "64", "--vocab", "512", "--single-prompts", "2",
                                  "--in-flight", "4", "--input-len", "16", "--output-len", "4", "--num-warmups", "0",
                                  "--rounds", "1", "--serve-flags", "--kv-cache-memory 64MiB --max-model-len 256"),
                                 _moe_vs_dense),
    "serve_throughput.py": ScriptRun((*SMALL_SERVING, "--compare-url", "{other}"), _serve_throughput),
    "disagg_vs_agg.py": ScriptRun((*SMALL_SERVING, "--only", "agg-1", "--only", "disagg"), _disagg_vs_agg),
    "decode_bandwidth.py": ScriptRun(("--model", "{model}", "--context", "16", "--steps", "4", "--serve-prompts", "1",
                                      "--serve-output-len", "8"), _decode_bandwidth),
    "transfer_bandwidth.py": ScriptRun(("--reps", "1", "--prompt-tokens", "64", "--num-layers", "2",
                                        "--error-handling-modes", "peer"), _transfer_bandwidth),
    "isolation_audit.py": ScriptRun(("--model", "{model}", "--aggregated", "--num-prompts", "4",
                                     "--prompt-words", "120"), _isolation_audit),
    "lora_batching.py": ScriptRun((*SMALL_MODEL, "--decode-steps", "2", "--rank", "4", "--rounds", "1"),
                                  _lora_batching),
    "guided_sampling.py": ScriptRun(("--batch", "4", "--repeats", "2"), _guided_sampling),
    "sampler_processors.py": ScriptRun(("--batch", "8", "--vocab", "1024", "--prompt-len", "16", "--output-len", "8",
                                        "--num-biases", "4", "--num-bad-words", "4", "--repeats", "1"),
                                       _sampler_processors),
    "model_forward.py": ScriptRun((*SMALL_MODEL, "--decode-steps", "4"), _model_forward),
    "speculative.py": ScriptRun(("--model", "{model}", "--concurrency", "1", "--num-prompts", "2", "--input-len", "96",
                                 "--output-len", "8", "--num-warmups", "0", "--rounds", "1"), _speculative),
    "head_context.py": ScriptRun(("--model", "{model}", "--train-tokens", "512", "--window", "64", "--epochs", "1",
                                  "--num-prompts", "2", "--prompt-len", "32", "--output-len", "8"), _head_context),
    "packed_products.py": ScriptRun(("--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
                                     "--head-dim", "32", "--vocab", "512", "--layers", "1", "--rounds", "1",
                                     "--repeat", "1", "--rows", "1,8"), _packed_products),
    "prefill_attention.py": ScriptRun(("--seqs", "1", "--prompt-len", "64", "--heads", "4", "--kv-heads", "2",
                                       "--head-dim", "32", "--layers", "1", "--rounds", "1", "--repeat", "1"),
                                      _prefill_attention),
    "router_scale.py": ScriptRun(("--workers", "1", "2", "--blocks", "500", "--num-prompts", "5", "--repeats", "1"),
                                 _router_scale),
    "kvcache_ops.py": ScriptRun(("--num-requests", "200", "--num-prefixes", "20", "--num-blocks", "256"), _kvcache_ops),
    "kvcache_integrity.py": ScriptRun(("--sizes", "64", "256", "--repeats", "1"), _kvcache_integrity),
}

# The other Python files of benchmarks/, and why the test does not run them.
NOT_RUN = {
    "export_hf.py": "a tool, not a measurement: it writes a checkpoint, no report",
    "run_all.py": "runs every script above at full size; tests/unit/bench/test_bench_run_all.py covers it",
    "report_markdown.py": "run_all.py's Markdown, covered with it",
    "serving_stack.py": "a helper of the serving scripts, run through them",
    "serving_load.py": "a helper of the serving scripts, run through them",
    "router_scale_workload.py": "router_scale.py's synthetic streams, run through it",
    "abuse_cases.py": "abuse.py's abusers, run through it",
}
