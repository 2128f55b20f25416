"""One real stack for the fuzz runs: a router in front of an aggregated worker, a prefill worker (the
only role that serves `KvTransfer`) and a decode worker (the only one that dials the prefill worker
a request names), all on a tiny random-weight checkpoint on loopback."""
from collections.abc import Iterator

import pytest

from tests.fuzz.worker_calls import Baseline, FuzzStack, greedy_tokens, integrity
from tests.integration.stack import free_port, make_tiny_checkpoint, start, stop, wait_for_http, wait_for_worker

MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzStack]:
    checkpoint = str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_model_len=MAX_MODEL_LEN))
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
              "--max-kv-tokens", "4096", "--num-threads", "1", "--cache-dir", ""]
    ports = {name: free_port() for name in ("both", "prefill", "decode", "router")}
    extra = {"both": [], "prefill": [],  # the decode worker dials whatever `prefill_worker` a request names
             "decode": ["--disagg-min-prefill-tokens", "1", "--kv-transfer-timeout", "5"]}
    workers = {role: start(["worker", "--role", role, "--port", str(ports[role]), *common, *extra[role]],
                           logs / f"{role}.log")
               for role in ("both", "prefill", "decode")}
    procs = list(workers.values())
    try:
        for role, proc in workers.items():
            wait_for_worker(f"127.0.0.1:{ports[role]}", proc)
        router_url = f"http://127.0.0.1:{ports['router']}"
        procs.append(start(["router", "--model", checkpoint, "--port", str(ports["router"]), "--cache-dir", "",
                            "--worker", f"127.0.0.1:{ports['both']}"], logs / "router.log"))
        wait_for_http(router_url, procs)
        addresses = [f"127.0.0.1:{ports[role]}" for role in ("both", "prefill", "decode")]
        baselines = {address: Baseline(integrity(address), greedy_tokens(address, "baseline")) for address in addresses}
        yield FuzzStack(router_url, *addresses, baselines)
    finally:
        for proc in reversed(procs):
            stop(proc)
