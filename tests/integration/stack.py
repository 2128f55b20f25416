"""Helpers for integration tests that start real pdserve processes on loopback."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from pdserve.common.ports import free_ports
from pdserve.serve.tether import set_parent_death_signal

PDSERVE = str(Path(sys.executable).parent / "pdserve")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


def make_tiny_checkpoint(directory: Path, max_model_len: int = 512, hidden_size: int = 64) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer (so prompts are real text); 4 heads,
    so `hidden_size` 128 gives the head_dim 32 that the native CPU kernels need at the least."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pdserve.common.model_source import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_model_len,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def children_of(pid: int) -> list[int]:
    """The pids of `pid`'s children, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def command_of(pid: int) -> str:
    """e.g. "python -m pdserve.serve.tether 1234 15 worker --model ..."."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def serve_credentials_dir(serve_pid: int) -> str:
    """The TLS folder `pdserve serve` gave its router (on the router's command line): a test's
    client calls that serve's workers under the router's identity."""
    (command,) = [command_of(pid) for pid in children_of(serve_pid) if " router " in command_of(pid)]
    args = command.split()
    return args[args.index("--tls-dir") + 1]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a re-parented process may wait a while for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (so a process that starts
    meanwhile cannot take it), and not handed out before in this test session: two picks in a
    row can otherwise return the same port, and two processes would be told to listen on it."""
    while True:
        (port,) = free_ports("127.0.0.1", 1)
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def free_port_pair() -> int:
    """A free loopback port whose successor is free too (`pdserve serve --metrics-port` gives
    worker i the base + i); neither handed out before in this test session."""
    while True:
        base = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        if base + 1 not in _HANDED_OUT:
            _HANDED_OUT.add(base + 1)
            return base


def plain_text(args: Sequence[str]) -> list[str]:
    """`pdserve worker|router` args with `--insecure-internal` unless they give `--tls-dir`: tests
    of other things reach workers with plain-text clients; test_internal_tls.py runs mutual TLS."""
    is_internal = bool(args) and args[0] in ("worker", "router")
    return [*args, "--insecure-internal"] if is_internal and "--tls-dir" not in args else list(args)


def _dies_with_the_tests() -> None:
    """In the child before it runs: SIGTERM when the test process dies, killed without its teardown."""
    set_parent_death_signal(signal.SIGTERM)


def start(args: Sequence[str], log_path: Path | None = None) -> subprocess.Popen:
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen([PDSERVE, *plain_text(args)], stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=_dies_with_the_tests)


def start_serve(directory: Path, args: Sequence[str], timeout_s: float = 180.0) -> tuple[subprocess.Popen, list[str]]:
    """`pdserve serve <args>` on a free HTTP port with its output in `directory`, once its ready
    banner is out; the process and the banner's lines (the URL is `http://127.0.0.1:<port>` of
    the `--port` in `args`)."""
    directory.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pdserve.cli", "serve", *args]
    with open(directory / "serve.out", "wb") as out, open(directory / "serve.err", "wb") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, preexec_fn=_dies_with_the_tests)
    deadline = time.monotonic() + timeout_s
    while b"pdserve is ready" not in (directory / "serve.out").read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait(30)
            raise AssertionError(f"serve was not ready: {(directory / 'serve.err').read_text()[-3000:]}")
        time.sleep(0.2)
    return process, (directory / "serve.out").read_text().splitlines()


def banner_address(banner: list[str], role: str) -> str:
    """A worker's gRPC address from serve's ready banner."""
    (address,) = [line.split()[1] for line in banner if line.startswith(f"  {role} ")]
    return address


def wait_for_worker(address: str, process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    from pdserve.rpc.probe import is_worker_serving

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker at {address} exited with {process.returncode} during start")
        if is_worker_serving(address, timeout_s=1.0):
            return
        time.sleep(0.3)
    raise RuntimeError(f"worker at {address} not serving within {timeout_s} s")


def wait_for_http(url: str, processes: Sequence[subprocess.Popen], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a pdserve process exited during start")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not serving within {timeout_s} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text exposition, 0.0 when absent."""
    body = httpx.get(url, timeout=5.0).text
    key = f"{name}{{{labels}}}" if labels else name
    for line in body.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


@contextlib.contextmanager
def routed_cluster(checkpoint: str, logs: Path, roles: Sequence[str], worker_args: Sequence[str] = (),
                   router_args: Sequence[str] = ()) -> Iterator[tuple[str, dict[str, subprocess.Popen]]]:
    """Workers of `roles` (each on a free port, `worker_args` added) behind one `pdserve router`
    (`router_args` added) on the tiny `checkpoint`; yields the router's URL and the workers by
    address, and stops them all."""
    common = ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
              "--max-kv-tokens", "4096", "--num-threads", "1", *worker_args]
    ports = [free_port() for _ in roles]
    workers = {f"127.0.0.1:{port}": start(["worker", "--role", role, "--port", str(port), *common],
                                          logs / f"{role}-{port}.log")
               for role, port in zip(roles, ports, strict=True)}
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    router = None
    try:
        for address, process in workers.items():
            wait_for_worker(address, process)
        router = start(["router", "--model", checkpoint, "--port", str(router_port), "--worker-poll-interval", "0.2",
                        *router_args, *[arg for address in workers for arg in ("--worker", address)]],
                       logs / "router.log")
        wait_for_http(url, [router])
        yield url, workers
    finally:
        if router is not None:
            stop(router)
        for process in workers.values():
            stop(process)
