"""pdserve processes for the serving benchmarks: workers and a router on loopback.

`ServingStack` starts each process as `python -m pdserve.cli <kind> <flags>`, waits (bounded)
until it serves, records its start-to-ready time, reads its peak RSS (VmHWM from /proc) and
stops every process it started when the `with` block ends (router first, SIGINT, then kill);
`stop` ends one before that, so routers can take turns on the same workers.
The internal plane is mutual TLS, as users run it: the stack makes an authority and gives each
process a certificate of its name (a worker's name is its worker id) in its role (a worker's
`--role`); its readiness checks hold a probe's certificate; `insecure=True` runs it in plain
text instead (`--insecure-internal`), for measuring what TLS costs. `env` is the processes'
environment (serving_overhead.py: another checkout's `services` first on PYTHONPATH).
Also builds the random-weight 160M Llama checkpoint (`--random-160m`).
"""
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Self

from pdserve.common import pki
from pdserve.common.ports import free_ports
from pdserve.common.tls import TlsConfig

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.2
COMMAND = (sys.executable, "-m", "pdserve.cli")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (so a worker that starts
    meanwhile cannot take it for a transfer listener or an outgoing connection), and not handed
    out before in this benchmark run: two picks in a row could otherwise return the same port."""
    while True:
        (port,) = free_ports("127.0.0.1", 1)
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def vm_hwm_mib(pid: int) -> float | None:
    """Peak resident set size of a live process (VmHWM), None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if line is None else int(line.split()[1]) / 1024


@contextlib.contextmanager
def work_dir(keep: str | None, prefix: str) -> Iterator[Path]:
    """`keep` (created if missing) when given, else a temporary directory removed afterwards."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        yield Path(scratch)


@dataclass(frozen=True, slots=True)
class Started:
    """One process that became ready: what it is, its pid and how long it took."""

    name: str
    address: str  # host:port for a worker, http://host:port for the router
    pid: int
    ready_s: float


def _is_worker_serving(address: str, tls_dir: str | None) -> bool:
    from pdserve.rpc.probe import is_worker_serving

    return is_worker_serving(address, 1.0, None, tls_dir)


def _is_router_serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ServingStack:
    """Processes started for one measurement; a context manager that stops them all.

    Every process of a stack holds a certificate of the stack's one authority, so a router and
    the workers it calls must be started by the same stack (a router of another stack fails
    their TLS handshakes)."""

    def __init__(self, log_dir: Path, insecure: bool = False, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self._env = env  # every process's environment; None: this process's
        self._running: dict[int, tuple[subprocess.Popen, IO[bytes]]] = {}  # by pid, in start order
        self._authority = None if insecure else pki.Authority.create("pdserve benchmark")
        self._probe_tls = self._tls_flags("probe", pki.Role.PROBE, "probe")[1] if self._authority else None

    def _tls_flags(self, identity: str, role: pki.Role, folder_name: str) -> list[str]:
        """`--tls-dir` with a fresh certificate of `identity` in `role`, or `--insecure-internal`."""
        if self._authority is None:
            return ["--insecure-internal"]
        issued = self._authority.issue(identity, role, ("127.0.0.1",))
        return ["--tls-dir", str(issued.write(self.log_dir / "tls" / folder_name))]

    def client_tls(self) -> TlsConfig | None:
        """Credentials of this stack's authority for a client of its workers (the benchmark's own
        gRPC load, which calls them as a router does); None when the stack runs in plain text."""
        if self._authority is None:
            return None
        return TlsConfig.from_dir(self._tls_flags("bench-client", pki.Role.ROUTER, "bench-client")[1])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for pid in reversed(list(self._running)):  # the router first, then its workers
            self._stop_pid(pid)

    def stop(self, started: Started) -> None:
        """Stop one process of this stack now (SIGINT, then kill); the others keep running."""
        if started.pid not in self._running:
            raise ValueError(f"{started.name} (pid {started.pid}) is not running in this stack")
        self._stop_pid(started.pid)

    def _stop_pid(self, pid: int) -> None:
        process, log = self._running.pop(pid)
        stop_process(process)
        log.close()

    def _start(self, name: str, kind: str, flags: list[str], address: str, is_ready) -> Started:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the process writes it until stopped
        started_at = time.perf_counter()
        process = subprocess.Popen([*COMMAND, kind, *flags], stdout=log, stderr=subprocess.STDOUT, env=self._env)
        self._running[process.pid] = (process, log)
        deadline = started_at + READY_TIMEOUT_S
        while not is_ready():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{_tail(log.name)}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{name} not ready within {READY_TIMEOUT_S:.0f} s:\n{_tail(log.name)}")
            time.sleep(POLL_S)
        return Started(name, address, process.pid, time.perf_counter() - started_at)

    def start_worker(self, name: str, flags: list[str]) -> Started:
        """A `pdserve worker` on a free loopback port; `flags` must not set --host/--port."""
        address = f"127.0.0.1:{free_port()}"
        host, port = address.split(":")
        tls = self._tls_flags(name, pki.Role(_flag_value(flags, "--role", "both")), name)
        return self._start(name, "worker", ["--host", host, "--port", port, *tls, *flags], address,
                           lambda: _is_worker_serving(address, self._probe_tls))

    def start_router(self, workers: list[Started], flags: list[str], name: str = "router") -> Started:
        """A `pdserve router` calling `workers` (one `--worker` each), ready when /v1/models answers;
        `name` names its log (its certificate's identity is "router", whatever the name)."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        worker_flags = [arg for w in workers for arg in ("--worker", w.address)]
        tls = self._tls_flags("router", pki.Role.ROUTER, name)
        return self._start(name, "router", ["--port", str(port), *worker_flags, *tls, *flags], url,
                           lambda: _is_router_serving(url))


def _flag_value(flags: list[str], flag: str, default: str) -> str:
    """The value `flags` give `flag` (`--flag value` or `--flag=value`, the last one wins)."""
    value = default
    for i, arg in enumerate(flags):
        if arg == flag and i + 1 < len(flags):
            value = flags[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _tail(path: str, num_chars: int = 3000) -> str:
    return Path(path).read_text(errors="replace")[-num_chars:]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(c) for c in task.read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def stop_process(process: subprocess.Popen) -> None:
    """SIGINT, then kill after STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


RANDOM_160M = {"hidden_size": 1024, "intermediate_size": 3840, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000}


def _truncated_tokenizer_json(tokenizer_json: str, vocab_size: int) -> str:
    """SmolLM2's byte-level BPE cut to its first `vocab_size` ids: merges whose parts or
    result fall outside are dropped, so every text still encodes (bytes are low ids)."""
    import json

    spec = json.loads(tokenizer_json)
    vocab = {piece: i for piece, i in spec["model"]["vocab"].items() if i < vocab_size}
    merges = []
    for merge in spec["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    spec["model"].update(vocab=vocab, merges=merges)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
    return json.dumps(spec)


def save_tokenizer(directory: Path, vocab_size: int):
    """SmolLM2's tokenizer cut to `vocab_size` ids, saved in `directory` (a random-weight
    checkpoint's, so prompts are real text); returns it."""
    from pdserve.common.model_source import default_model_path
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf = Path(default_model_path())
    source = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer_file = directory / "tokenizer.json"
    tokenizer_file.write_text(_truncated_tokenizer_json(source.backend_tokenizer.to_str(), vocab_size))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token=source.bos_token,
                                        eos_token=source.eos_token, unk_token=source.unk_token)
    tokenizer.chat_template = source.chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


def make_random_160m(directory: Path) -> tuple[Path, int]:
    """A random-weight Llama (hidden 1024, 8 layers, vocab 32000, tied embeddings) saved with
    a 32000-id tokenizer. Returns the directory and the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = save_tokenizer(directory, 32000)
    torch.manual_seed(0)
    config = LlamaConfig(**RANDOM_160M, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory, sum(p.numel() for p in model.parameters())
