"""What the internal plane's security costs: mutual TLS on gRPC and the write grant of each
prefill order, measured side by side in one run.

1. Served: `pdserve serve` (1 prefill + 1 decode worker) with its default mutual TLS and with
   `--insecure-internal`, the same workloads through `pdserve bench`, in A-B-B-A order over
   `--rounds` (so drift on a shared machine hits both alike): output throughput, TTFT and TPOT.
2. One gRPC call on loopback, TLS against plain text: a unary call on a new channel (the TLS
   handshake included) and on a warm channel, with a 1 KiB message.
3. The write grant: minting one (decode side) and checking it (prefill side) for an order of 64
   blocks, in microseconds.

    python benchmarks/internal_tls.py --json internal-tls.json
    python benchmarks/internal_tls.py --scale 0.25 --rounds 1    # a quick look
    python benchmarks/internal_tls.py --scale 0.03 --single-pass --calls 20    # does it still run?
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
import timeit
from pathlib import Path

import grpc

from pdserve.common import pki
from pdserve.common.disagg import PrefillOrder
from pdserve.common.ids import BlockId, RequestId, WorkerId
from pdserve.common.model_source import default_model_path
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.rpc.tls import add_port, aio_channel
from pdserve.worker.kv.write_grants import granted, is_granted, new_order_key

from serving_load import Workload, ratio
from serving_stack import work_dir
from vs_vllm import measure_topology

CONFIGS = {"tls": [], "plain": ["--insecure-internal"]}
COMPARED = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")
ECHO = "/bench.Echo/Echo"


def workloads(scale: float, seed: int) -> list[Workload]:
    def n(count: int) -> int:
        return max(1, round(count * scale))
    return [Workload("single", n(8), 256, 32, max_concurrency=1, seed=seed),
            Workload("random", n(32), 256, 32, max_concurrency=n(32), seed=seed + 1)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--keep-dir", metavar="DIR", help="keep logs and raw bench JSON here")
    parser.add_argument("--model", help="GGUF file or HF checkpoint dir (default: bundled SmolLM2-135M GGUF)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's prompt count")
    parser.add_argument("--rounds", type=int, default=1, help="A-B-B-A rounds of the two configurations")
    parser.add_argument("--single-pass", action="store_true",
                        help="each configuration once (A-B, half the starts): a smoke run, not for figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=2000, help="warm gRPC calls per configuration")
    return parser.parse_args(argv)


def served(args: argparse.Namespace, model: str, out_dir: Path) -> list[dict]:
    """Each configuration's rows, workloads averaged over its runs."""
    passes = ("tls", "plain") if args.single_pass else ("tls", "plain", "plain", "tls")
    order = [name for _ in range(args.rounds) for name in passes]
    runs: dict[tuple[str, str], list[dict]] = {}
    for i, name in enumerate(order):
        rows = measure_topology(name, CONFIGS[name], model, workloads(args.scale, args.seed + 10 * i), out_dir)
        for row in rows:
            runs.setdefault((name, row["workload"]), []).append(row)
    return [{"system": name, "workload": workload, "runs": len(rows),
             **{k: statistics.fmean(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}}
            for (name, workload), rows in runs.items()]


async def _calls(tls: TlsConfig | None, num_calls: int) -> dict[str, float]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)})])
    port = add_port(server, "127.0.0.1:0", tls)
    await server.start()
    payload = bytes(1024)
    try:
        firsts = []
        for _ in range(20):
            started = time.perf_counter()
            async with aio_channel(f"127.0.0.1:{port}", tls, pki.WORKER_NAME) as channel:
                await channel.unary_unary(ECHO)(payload, timeout=10)
            firsts.append(time.perf_counter() - started)
        async with aio_channel(f"127.0.0.1:{port}", tls, pki.WORKER_NAME) as channel:
            call = channel.unary_unary(ECHO)
            await call(payload, timeout=10)
            started = time.perf_counter()
            for _ in range(num_calls):
                await call(payload, timeout=10)
            warm = (time.perf_counter() - started) / num_calls
    finally:
        await server.stop(0)
    return {"new_channel_call_ms": statistics.median(firsts) * 1e3, "warm_call_us": warm * 1e6}


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def grpc_calls(num_calls: int) -> list[dict]:
    tls = TlsConfig.from_issued(pki.Authority.create("bench authority").issue("bench", pki.Role.BOTH))
    return [{"system": name, "workload": "grpc_call", **asyncio.run(_calls(config, num_calls))}
            for name, config in (("tls", tls), ("plain", None))]


def grant_cost() -> dict:
    key = new_order_key()
    order = PrefillOrder(GenerationRequest(RequestId("bench-request-0001"), tuple(range(1024)),
                                           SamplingParams(max_tokens=1)),
                         WorkerId("decode@10.0.0.7:50051"), 0, tuple(BlockId(b) for b in range(64)), 30.0)
    signed = granted(key, order)
    number = 20000
    mint = timeit.timeit(lambda: granted(key, order), number=number) / number
    check = timeit.timeit(lambda: is_granted(key, signed), number=number) / number
    return {"system": "tls", "workload": "write_grant_64_blocks", "mint_us": mint * 1e6, "check_us": check * 1e6}


def ratios(rows: list[dict]) -> dict[str, float | None]:
    by = {(r["system"], r["workload"]): r for r in rows}
    found: dict[str, float | None] = {}
    for (system, workload), row in by.items():
        plain = by.get(("plain", workload))
        if system != "tls" or plain is None:
            continue
        for metric in (*COMPARED, "new_channel_call_ms", "warm_call_us"):
            if metric in row:
                found[f"{metric} ({workload}): tls / plain"] = ratio(row[metric], plain[metric])
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path()
    rows = [*grpc_calls(args.calls), grant_cost()]
    with work_dir(args.keep_dir, "internal-tls-") as out_dir:
        rows += served(args, model, out_dir)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model,
              "workloads": [w.as_dict() for w in workloads(args.scale, args.seed)]}
    result = {"benchmark": "internal_tls", "config": config, "results": rows, "ratios": ratios(rows)}
    print(json.dumps({"results": rows, "ratios": result["ratios"]}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
