"""NIXL KV transfer bandwidth between two processes, against a plain copy of the same bytes.

Two spawned processes on this machine: a decode-side target and a prefill-side initiator,
each with a NixlTransport over a block-major KV tensor of realistic block size (default
SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bf16, 16 tokens per block = 360 KiB).
The initiator WRITEs blocks with a notification (the push protocol the workers use) and,
interleaved with every repetition, times `dst.copy_(src)` of the same number of bytes.
Cases: 1, 16 and 256 blocks at scattered ids (no two adjacent: one descriptor per block), and
a 4k-token prompt's KV at contiguous ids as a fresh allocation gets them (one descriptor).
UCX's protocol choice is read from its own log (UCX_PROTO_INFO). Nothing is asserted.

    python benchmarks/transfer_bandwidth.py --json transfer_bandwidth.json
    python benchmarks/transfer_bandwidth.py --env THP_MEM_ALLOC_ENABLE=1 --json thp.json
    python benchmarks/transfer_bandwidth.py --env UCX_TLS=tcp,self --json tcp.json
"""
import argparse
import json
import multiprocessing
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from pdserve.common.ids import BlockId, WorkerId
from pdserve.transfer.blocks import pair_block_ids
from pdserve.transfer.layout import KvLayoutSpec
from pdserve.transfer.nixl_transport import NixlConfig, NixlTransport

PREFILL, DECODE = WorkerId("bench-prefill"), WorkerId("bench-decode")
REPLY_TIMEOUT_S = 120.0
TRANSFER_TIMEOUT_S = 30.0
_PROTOCOL_ROW = re.compile(r"\|\s*(\d+\.\.\S+)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|")


@dataclass(frozen=True)
class Case:
    name: str
    num_blocks: int
    is_scattered: bool


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per case")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--error-handling-modes", default="peer,none",
                        help="UCX error handling modes to measure, each with fresh processes")
    parser.add_argument("--notify", default="bench", help="notification sent with each write ('' for none)")
    parser.add_argument("--num-threads", type=int, default=0, help="UCX backend threads")
    parser.add_argument("--progress-thread", action="store_true", help="use NIXL's progress thread")
    parser.add_argument("--target-poll-ms", type=float, default=1.0,
                        help="how often the target drains notifications, as a worker's loop would")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of both processes, e.g. UCX_TLS=tcp,self or "
                             "THP_MEM_ALLOC_ENABLE=1 (torch allocates on huge pages) (repeatable)")
    return parser.parse_args()


def make_spec(args: argparse.Namespace) -> KvLayoutSpec:
    return KvLayoutSpec("bench", args.dtype, args.num_layers, args.num_kv_heads, args.head_dim,
                        args.tokens_per_block)


def cases(args: argparse.Namespace) -> list[Case]:
    prompt_blocks = -(-args.prompt_tokens // args.tokens_per_block)
    return [Case("1 block", 1, True), Case("16 blocks", 16, True), Case("256 blocks", 256, True),
            Case(f"{args.prompt_tokens}-token prompt", prompt_blocks, False)]


def pool_blocks(args: argparse.Namespace) -> int:
    """Room for the largest case twice over: scattered ids use even ids only."""
    return 2 * max(case.num_blocks for case in cases(args))


def nixl_config(args: argparse.Namespace) -> NixlConfig:
    return NixlConfig(args.mode, num_threads=args.num_threads,
                      use_progress_thread=args.progress_thread)


def make_kv(args: argparse.Namespace, fill: float) -> torch.Tensor:
    spec = make_spec(args)
    return torch.full((pool_blocks(args), *spec.block_shape), fill, dtype=getattr(torch, spec.dtype))


def target_main(conn: Connection, args: argparse.Namespace) -> None:
    """Decode side: serve our metadata, then make progress until told to stop."""
    with NixlTransport(DECODE, make_kv(args, 0.0), make_spec(args), nixl_config(args)) as transport:
        conn.send(transport.local_metadata())
        num_notifications = 0
        while not conn.poll(args.target_poll_ms / 1e3):
            num_notifications += len(transport.drain_notifications())
        conn.recv()
        conn.send(num_notifications)


def initiator_main(conn: Connection, args: argparse.Namespace, decode_metadata: bytes) -> None:
    """Prefill side: time setup, then every case; send the results back."""
    kv = make_kv(args, 1.0)
    started = time.perf_counter()
    transport = NixlTransport(PREFILL, kv, make_spec(args), nixl_config(args))
    registered = time.perf_counter()
    transport.add_peer(DECODE, decode_metadata)
    setup = {"startup_ms": 1e3 * (registered - started),
             "add_peer_ms": 1e3 * (time.perf_counter() - registered), "pool_blocks": pool_blocks(args)}
    rng = np.random.default_rng(0)
    rows = [run_case(transport, case, args, rng) for case in cases(args)]
    setup["anon_huge_pages_kib"] = anon_huge_pages_kib()
    transport.close()
    conn.send((setup, rows))


def anon_huge_pages_kib() -> int:
    """This process's memory on transparent huge pages (Linux), 0 where unknown."""
    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.exists():
        return 0
    for line in rollup.read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def block_ids(case: Case, num_pool: int, rng: np.random.Generator) -> tuple[list[BlockId], list[BlockId]]:
    """(local, remote) ids: random even ids when scattered, else [0, n) -> [n, 2n)."""
    if not case.is_scattered:
        return list(range(case.num_blocks)), list(range(case.num_blocks, 2 * case.num_blocks))
    local = 2 * rng.choice(num_pool // 2, case.num_blocks, replace=False)
    remote = 2 * rng.choice(num_pool // 2, case.num_blocks, replace=False)
    return local.tolist(), remote.tolist()


def run_case(transport: NixlTransport, case: Case, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    local, remote = block_ids(case, transport.num_blocks, rng)
    nbytes = case.num_blocks * transport.spec.bytes_per_block
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    timed_write(transport, local, remote, args.notify.encode())  # warm-up: first-touch pages, connection, caches
    dst.copy_(src)
    nixl_s, copy_s, copy_1t_s = [], [], []
    for _ in range(args.reps):
        nixl_s.append(timed_write(transport, local, remote, args.notify.encode()))
        copy_s.append(timed_copy(dst, src, torch.get_num_threads()))
        copy_1t_s.append(timed_copy(dst, src, 1))
    pairs = pair_block_ids("WRITE", local, remote, transport.num_blocks, transport.num_blocks)
    nixl_median = statistics.median(nixl_s)
    return {"mode": args.mode, "case": case.name, "num_blocks": case.num_blocks, "bytes": nbytes,
            "descriptors": pairs.num_runs, **summary("nixl", nixl_s, nbytes), **summary("copy", copy_s, nbytes),
            **summary("copy_1thread", copy_1t_s, nbytes),
            "ratio_median": statistics.median(copy_s) / nixl_median,
            "ratio_1thread_median": statistics.median(copy_1t_s) / nixl_median,
            "ratio_best_copy_median": min(statistics.median(copy_s), statistics.median(copy_1t_s)) / nixl_median}


def timed_copy(dst: torch.Tensor, src: torch.Tensor, num_threads: int) -> float:
    """`dst.copy_(src)` on `num_threads` torch threads; UCX's cma copy runs on one core."""
    default_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    started = time.perf_counter()
    dst.copy_(src)
    elapsed = time.perf_counter() - started
    torch.set_num_threads(default_threads)
    return elapsed


def timed_write(transport: NixlTransport, local: list[BlockId], remote: list[BlockId], notify: bytes) -> float:
    started = time.perf_counter()
    handle = transport.write_blocks(DECODE, local, remote, notify, TRANSFER_TIMEOUT_S)
    transport.wait(handle)
    elapsed = time.perf_counter() - started
    transport.release(handle)
    return elapsed


def summary(name: str, seconds: list[float], nbytes: int) -> dict:
    """Median and p90 time, and the bandwidth each gives (p90 time = the slow tail)."""
    median, p90 = statistics.median(seconds), float(np.percentile(seconds, 90))
    return {f"{name}_us_median": 1e6 * median, f"{name}_us_p90": 1e6 * p90,
            f"{name}_gbps_median": nbytes / median / 1e9, f"{name}_gbps_p90": nbytes / p90 / 1e9}


def limits(run: dict) -> list[str]:
    """What one mode's figures say bounds the transfer, in words."""
    by_name = {row["case"]: row for row in run["rows"]}
    scattered, prompt, single = by_name["256 blocks"], run["rows"][-1], by_name["1 block"]
    configs = sorted({p["config"] for p in run["protocols"]}) or ["unknown (no UCX protocol log)"]
    setup = run["setup"]
    notes = [f"UCX put protocol: {', '.join(configs)}" + (
        " -- cma is a zero-copy process_vm_writev by the initiator's kernel on one core,"
        f" while the plain copy may use {torch.get_num_threads()} torch threads"
        if any(c.startswith("cma") for c in configs) else "")]
    notes.append(f"descriptors: 256 scattered blocks = {scattered['descriptors']} descriptors at "
                 f"{scattered['nixl_gbps_median']:.2f} GB/s; {prompt['case']} = {prompt['descriptors']} "
                 f"descriptor(s) at {prompt['nixl_gbps_median']:.2f} GB/s (NIXL merges ids contiguous on both sides)")
    notes.append(f"fixed cost per transfer (post, poll, flush, notify): {single['nixl_us_median']:.0f} us median "
                 f"for 1 block vs {single['copy_1thread_us_median']:.1f} us to copy it on one thread")
    notes.append(f"pages: {setup['anon_huge_pages_kib']} KiB of the initiator on transparent huge pages; "
                 "CMA pins every page it copies, so 4 KiB pages cost it more than 2 MiB ones "
                 "(THP_MEM_ALLOC_ENABLE=1 makes torch allocate large tensors on huge pages)")
    notes.append(f"registration: once at start, {setup['startup_ms']:.1f} ms to create the agent and UCX backend, "
                 f"register the tensor and prepare {setup['pool_blocks']} block descriptors; "
                 f"{setup['add_peer_ms']:.1f} ms per peer; never on the transfer path")
    return notes


def apply_env(args: argparse.Namespace) -> None:
    """The wiring script sets its children's environment; no library code reads it."""
    for setting in args.env:
        key, _, value = setting.partition("=")
        os.environ[key] = value
    os.environ["UCX_PROTO_INFO"] = "y"


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One target and one initiator process with error handling `mode`; their results."""
    args = argparse.Namespace(**vars(args), mode=mode)
    context = multiprocessing.get_context("spawn")
    target_conn, target_child = context.Pipe()
    initiator_conn, initiator_child = context.Pipe()
    with tempfile.TemporaryDirectory() as log_dir:
        os.environ["UCX_LOG_FILE"] = str(Path(log_dir) / "ucx.%p.log")
        target = context.Process(target=target_main, args=(target_child, args), daemon=True)
        target.start()
        try:
            decode_metadata = receive(target_conn, "target metadata")
            initiator = context.Process(target=initiator_main, args=(initiator_child, args, decode_metadata))
            initiator.start()
            setup, rows = receive(initiator_conn, "initiator results")
            initiator.join(timeout=REPLY_TIMEOUT_S)
            target_conn.send("stop")
            num_notifications = receive(target_conn, "target notification count")
        finally:
            target.join(timeout=10)
            if target.is_alive():
                target.kill()
        protocols = put_protocols(Path(log_dir))
    return {"mode": mode, "setup": setup, "rows": rows, "notifications_received": num_notifications,
            "protocols": protocols}


def receive(conn: Connection, what: str) -> object:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no {what} within {REPLY_TIMEOUT_S} s")
    return conn.recv()


def put_protocols(log_dir: Path) -> list[dict]:
    """UCX's chosen protocols for remote writes (`ucp_put*` tables), from its UCX_PROTO_INFO log."""
    found, table = [], ""
    for path in sorted(log_dir.glob("ucx.*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if " by ucp_" in line:
                table = line.split("|")[1].strip()
            elif "ucp_put" in table and (match := _PROTOCOL_ROW.search(line)):
                row = {"table": table, "range": match[1], "description": match[2], "config": match[3]}
                if row not in found:
                    found.append(row)
    return found


def print_run(run: dict) -> None:
    print(f"\nerror_handling_mode={run['mode']}  (ratio = NIXL GB/s / copy GB/s, medians)")
    print(f"{'case':<20}{'blocks':>7}{'MiB':>7}{'descs':>6}{'nixl GB/s':>10}{'p90':>6}"
          f"{'copy GB/s':>10}{'ratio':>6}{'1-thr copy':>11}{'ratio':>6}")
    for row in run["rows"]:
        print(f"{row['case']:<20}{row['num_blocks']:>7}{row['bytes'] / 2**20:>7.1f}{row['descriptors']:>6}"
              f"{row['nixl_gbps_median']:>10.2f}{row['nixl_gbps_p90']:>6.2f}{row['copy_gbps_median']:>10.2f}"
              f"{row['ratio_median']:>6.2f}{row['copy_1thread_gbps_median']:>11.2f}{row['ratio_1thread_median']:>6.2f}")
    for note in run["limits"]:
        print(f"- {note}")


def main() -> None:
    args = parse_args()
    apply_env(args)
    runs = []
    for mode in args.error_handling_modes.split(","):
        run = measure(args, mode)
        run["limits"] = limits(run)
        print_run(run)
        runs.append(run)
    config = {**{k: v for k, v in vars(args).items() if k != "json"},
              "bytes_per_block": make_spec(args).bytes_per_block, "cpu_count": os.cpu_count(),
              "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0],
              "torch_threads": torch.get_num_threads()}
    report = {"benchmark": "transfer_bandwidth", "config": config,
              "results": [row for run in runs for row in run["rows"]],
              "ratios": {f"{row['mode']}: {row['case']} vs best copy": row["ratio_best_copy_median"]
                         for run in runs for row in run["rows"]},
              "runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs]}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
