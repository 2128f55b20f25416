"""Every setting of every pdserve process, resolved in this one module.

Each field has a flag, an environment variable and a config-file key, all spelled after the
flag: `--max-model-len`, `PDSERVE_MAX_MODEL_LEN`, `max-model-len:` (or `max_model_len:`).
Precedence, highest first: flag > environment variable > file named by `--config` (or
`PDSERVE_CONFIG`; YAML, TOML or JSON) > the field's default. Flags take vLLM's names where
the meaning is the same. A bad value raises ConfigError naming where it came from, e.g.
`PDSERVE_BLOCK_SIZE='12': must be a power of two`. The sources are read in
`setting_sources.py`; no module beyond these two reads the environment.
`pdserve serve`'s settings (a router and its workers) are built from these in `serve/settings.py`.
"""
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdserve.common import config_options as cv
from pdserve.common.errors import ConfigError
from pdserve.common.model_source import default_model_path, served_name
from pdserve.common.setting_sources import build_section, resolve_sources
from pdserve.common.stats import WorkerRole


ENV_PREFIX = cv.ENV_PREFIX

DTYPES = ("auto", "float16", "bfloat16", "float32")
# --kernels: the ISA levels are those the native kernels are built for (engine/model/native/levels.py)
KERNEL_CHOICES = ("auto", "native", "torch", "jit", "avx2", "avx512", "avx512_bf16", "amx")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTING_POLICIES = ("kv_aware", "round_robin", "least_loaded", "random")
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")  # router/openai/tool_parsers.py reads each
DEFAULT_WORKER = "127.0.0.1:50051"
POD_NAME_ENV = "POD_NAME"  # a Kubernetes pod's name, set through the downward API


def default_cache_dir() -> str:
    """Where converted models (tokenizer, dequantized GGUF weights) are kept by default."""
    return str(Path.home() / ".cache" / "pdserve")


def opt(default: object = dataclasses.MISSING, *, help: str, parse: cv.Parser, flag: str | None = None,
        factory: object = dataclasses.MISSING, secret: bool = False) -> Any:
    """A settings field: its default, help text, parser and (when not its name) flag. A secret
    reaches a child process in its environment, never on its command line (`child_environ`)."""
    meta = {"help": help, "parse": parse, "flag": flag, "secret": secret}
    return field(default=default, default_factory=factory, metadata=meta,  # type: ignore[call-overload]
                 repr=not secret)


def tls_dir_option() -> Any:
    """The internal plane's credentials: a worker's and a router's `--tls-dir`."""
    return opt(None, parse=cv.optional(cv.parse_str),
               help="folder with ca.crt, tls.crt and tls.key: mutual TLS on every internal gRPC call "
                    "(`pdserve certs` makes them)")


def insecure_internal_option() -> Any:
    return opt(False, parse=cv.parse_bool,
               help="internal gRPC in plain text, without --tls-dir: anyone who reaches the port can read and write "
                    "the KV cache (logged as a warning)")


def api_key_option(use: str) -> Any:
    return opt((), parse=cv.parse_api_keys, secret=True,
               help=f"{use} (prefer PDSERVE_API_KEY: a flag shows in the process list)")


def api_keys_file_option(use: str) -> Any:
    return opt(None, parse=cv.optional(cv.parse_str), help=use)


def protect_metrics_option() -> Any:
    return opt(False, parse=cv.parse_bool,
               help="/metrics requires an API key too (the router's, each worker's --metrics-port and serve's "
                    "--serve-metrics-port; /health* stays open)")


def check(is_ok: bool, name: str, value: object, reason: str) -> None:
    if not is_ok:
        raise ConfigError(name, value, reason)


def check_positive(settings: object, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        check(value is None or value > 0, name, value, "must be > 0")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """One worker process: its engine, its KV cache and where it serves gRPC.

    KV cache capacity is the smallest of the limits set: `kv_cache_memory` bytes,
    `max_kv_tokens` tokens, and what `gpu_memory_utilization` of a GPU leaves after the
    weights and activations (worker/memory_budget.py; on CPU, most of the RAM available).
    """

    model: str = opt(factory=default_model_path, parse=cv.parse_str,
                     help="GGUF file or Hugging Face checkpoint directory (default: bundled SmolLM2-135M)")
    served_model_name: tuple[str, ...] = opt((), parse=cv.parse_names,
                                             help="model name(s) in the API, e.g. `--served-model-name a b`: "
                                                  "requests may name any, responses report the first "
                                                  "(default: --model as given)")
    role: WorkerRole = opt(WorkerRole.BOTH, parse=cv.member_of(WorkerRole), help="both | prefill | decode")
    host: str = opt("127.0.0.1", parse=cv.parse_str, help="gRPC listen address")
    port: int = opt(50051, parse=cv.parse_int, help="gRPC listen port (0: any free port)")
    device: str = opt("auto", parse=cv.choice(*DEVICES), help="auto picks cuda when present")
    dtype: str = opt("auto", parse=cv.choice(*DTYPES, aliases=DTYPE_ALIASES), help="model dtype")
    kv_cache_dtype: str = opt("auto", parse=cv.choice(*KV_CACHE_DTYPES), help="auto: the model dtype")
    block_size: int | None = opt(None, parse=cv.optional(cv.parse_int),
                                 help="tokens per KV block (a power of two; default 64 on a CPU, 16 on a GPU)")
    max_model_len: int | None = opt(None, parse=cv.optional(cv.parse_int),
                                    help="longest prompt + output (default: the model's context length)")
    max_num_seqs: int = opt(64, parse=cv.parse_int, help="most requests running at once")
    max_num_batched_tokens: int = opt(2048, parse=cv.parse_int, help="token budget of one engine step")
    enable_prefix_caching: bool = opt(True, parse=cv.parse_bool, help="reuse cached prompt blocks")
    kv_cache_memory: int | None = opt(None, parse=cv.optional(cv.parse_bytes),
                                      help="KV cache bytes, e.g. 512MiB")
    max_kv_tokens: int | None = opt(None, parse=cv.optional(cv.parse_int), help="KV cache size in tokens")
    host_cache_size: int = opt(0, parse=cv.parse_bytes,
                               help="bytes of host memory for KV blocks evicted from the device, e.g. 4GiB "
                                    "(a second tier: a prefix hit there is copied back, not recomputed; 0: none)")
    disk_cache_dir: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                     help="folder for KV blocks the host tier lets go (needs --host-cache-size); "
                                          "found again at the next start")
    disk_cache_size: int = opt(4 << 30, parse=cv.parse_bytes, help="bytes of --disk-cache-dir the disk tier may use")
    secondary_offload_min_priority: int = opt(35, parse=cv.parse_int,
                                              help="blocks evicted with a retention priority at or above this "
                                                   "move down to the host tier; lower ones are dropped "
                                                   "(default 35: default-priority blocks move down)")
    gpu_memory_utilization: float = opt(0.9, parse=cv.parse_float,
                                        help="fraction of a GPU's total memory this worker may use, weights and "
                                             "activations included (vLLM's meaning); the KV cache gets the rest. "
                                             "CPU: unused (see --kv-cache-memory)")
    num_threads: int | None = opt(None, parse=cv.optional(cv.parse_int), help="torch CPU threads")
    core_share_file: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                      help="a file the workers of one machine share: a worker with work also runs "
                                           "on the cores its idle peers' --num-threads leave (pdserve serve makes "
                                           "one for several workers); unset: always --num-threads")
    kernels: str = opt("auto", parse=cv.choice(*KERNEL_CHOICES),
                       help="auto: the native CPU kernels built for the best ISA level this CPU has, else torch "
                            "ops; native: the same, or fail; avx2 | avx512 | avx512_bf16 | amx: that level; jit: "
                            "compiled at start for this CPU (needs a C++ compiler); torch: torch ops")
    cache_dir: str | None = opt(factory=default_cache_dir, parse=cv.optional(cv.parse_str),
                                help="directory keeping GGUF conversions for fast restarts ('' turns it off)")
    enable_lora: bool = opt(False, parse=cv.parse_bool,
                            help="serve LoRA adapters (PEFT format) next to the base model")
    lora_modules: tuple[str, ...] = opt((), parse=cv.parse_lora_modules,
                                        help="adapters loaded at start: name=path ... (or vLLM's JSON "
                                             "{\"name\": ..., \"path\": ...}); requests name them as their model")
    max_loras: int = opt(1, parse=cv.parse_int, help="LoRA adapters loaded at once (so also in one batch)")
    max_lora_rank: int = opt(16, parse=cv.parse_int, help="highest LoRA rank an adapter may have")
    lora_dir: tuple[str, ...] = opt((), parse=cv.parse_names, flag="lora-dir",
                                    help="folders an adapter loaded at runtime (/v1/load_lora_adapter) must lie "
                                         "in, links resolved; none: runtime loads are refused")
    drain_timeout_s: float = opt(5.0, parse=cv.parse_float, flag="drain-timeout",
                                 help="seconds running requests may finish after SIGTERM")
    log_level: str = opt("info", parse=cv.choice(*LOG_LEVELS), help="logging level")
    worker_id: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                help="name of this worker to its peers (default: the identity in its TLS "
                                     f"certificate, <identity>/${POD_NAME_ENV} in a pod; without TLS ${POD_NAME_ENV} "
                                     "when set (Kubernetes' downward API), else <role>@<host name>:<port>)")
    tls_dir: str | None = tls_dir_option()
    insecure_internal: bool = insecure_internal_option()
    deployment_id: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                    help="the deployment this worker belongs to, told to routers that ask; a router "
                                         "with a deployment id admits only its own workers (pdserve serve: a fresh "
                                         "id per launch)")
    metrics_port: int | None = opt(None, parse=cv.optional(cv.parse_int),
                                   help="serve Prometheus metrics over HTTP on this port (0: any free port)")
    protect_metrics: bool = protect_metrics_option()
    api_key: tuple[str, ...] = api_key_option("with --protect-metrics: API key(s) /metrics accepts as "
                                              "'Authorization: Bearer <key>', comma-separated")
    api_keys_file: str | None = api_keys_file_option("with --protect-metrics: file of '<key> <tenant> [admin]' "
                                                     "lines, any of whose keys /metrics accepts")
    health_port: int | None = opt(None, parse=cv.optional(cv.parse_int),
                                  help="serve only the standard gRPC health service (grpc.health.v1), in plain text, "
                                       "on this port, for probes that cannot present a client certificate "
                                       "(Kubernetes' grpc probes; 0: any free port)")
    kv_transfer_timeout_s: float = opt(30.0, parse=cv.parse_float, flag="kv-transfer-timeout",
                                       help="bound on one prompt's prefill + KV transfer, from the latest moment "
                                            "the prefill may start (seconds)")
    prefill_queue_timeout_s: float = opt(30.0, parse=cv.parse_float, flag="prefill-queue-timeout",
                                         help="decode worker: how long a prompt may wait in a prefill worker's queue "
                                              "before that worker refuses it and we prefill it here (seconds)")
    max_prefill_queue: int = opt(8, parse=cv.parse_int,
                                 help="decode worker: prompts sent to one prefill worker and not yet answered; "
                                      "beyond it, prompts are prefilled here (as Dynamo's max_prefill_queue_size)")
    disagg_min_prefill_tokens: int = opt(32, parse=cv.parse_int,
                                         help="a decode worker prefills locally when fewer prompt tokens "
                                              "are missing from its own cache")
    kv_transfer_failure: str = opt("recompute", parse=cv.choice("recompute", "fail"),
                                   help="after a failed KV transfer: recompute locally or fail the request")
    max_waiting_requests: int = opt(256, parse=cv.parse_int,
                                    help="requests waiting for their first token at once; one more is refused at "
                                         "once (gRPC RESOURCE_EXHAUSTED, HTTP 503 with Retry-After)")
    engine_step_timeout_s: float = opt(60.0, parse=cv.parse_float, flag="engine-step-timeout",
                                       help="an engine thread that finishes no step for this long while work waits "
                                            "is wedged: health answers NOT_SERVING until it moves again (seconds)")

    def __post_init__(self) -> None:
        check_positive(self, "kv_transfer_timeout_s", "prefill_queue_timeout_s", "max_waiting_requests",
                       "engine_step_timeout_s", "max_prefill_queue")
        check(not self.protect_metrics or bool(self.api_key) or self.api_keys_file is not None, "protect_metrics",
              self.protect_metrics, "needs --api-key or --api-keys-file")
        check(self.prefill_queue_timeout_s + self.kv_transfer_timeout_s <= 600, "kv_transfer_timeout_s",
              self.kv_transfer_timeout_s, f"with --prefill-queue-timeout ({self.prefill_queue_timeout_s:g}) must be at "
                                          "most 600 seconds (the longest a prefill worker holds blocks for a peer)")
        check_positive(self, "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                        "kv_cache_memory", "max_kv_tokens", "num_threads", "drain_timeout_s", "max_loras",
                        "max_lora_rank")
        check(self.enable_lora or not self.lora_modules, "lora_modules", self.lora_modules, "needs --enable-lora")
        check(len(self.lora_modules) <= self.max_loras, "lora_modules", self.lora_modules,
              f"more adapters than --max-loras ({self.max_loras})")
        check(self.block_size is None or self.block_size & (self.block_size - 1) == 0, "block_size",
              self.block_size, "must be a power of two")
        for name in ("port", "metrics_port", "health_port"):
            port = getattr(self, name)
            check(port is None or 0 <= port < 65536, name, port, "must be in 0..65535")
        check(self.host_cache_size >= 0, "host_cache_size", self.host_cache_size, "must be >= 0")
        check(0 <= self.secondary_offload_min_priority <= 100, "secondary_offload_min_priority",
              self.secondary_offload_min_priority, "must be in 0..100")
        check(self.disk_cache_size > 0, "disk_cache_size", self.disk_cache_size, "must be > 0")
        check(not self.disk_cache_dir or self.host_cache_size > 0, "disk_cache_dir", self.disk_cache_dir,
              "a disk tier needs a host tier above it: set --host-cache-size too")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               self.max_num_batched_tokens, f"must be >= max-num-seqs ({self.max_num_seqs})")

    @property
    def model_name(self) -> str:
        """The name the API reports the model under (the first served name)."""
        return self.served_model_name[0] if self.served_model_name else served_name(self.model)

    @property
    def lora_module_pairs(self) -> tuple[tuple[str, str], ...]:
        """`lora_modules` as (name, path) pairs."""
        return tuple((name, path) for name, _, path in (m.partition("=") for m in self.lora_modules))

    @property
    def address(self) -> str:
        """Where a client on this machine reaches the worker."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    @property
    def peer_name(self) -> str:
        """This worker's name in KV transfers (NIXL agent name): `worker_id`, else
        <role>@<host>:<port> with this machine's name for a wildcard host, so that workers
        listening on 0.0.0.0 on two hosts do not share a name."""
        if self.worker_id:
            return self.worker_id
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{self.role}@{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The HTTP router: where it listens, what it tokenizes with, which workers it calls."""

    model: str = opt(factory=default_model_path, parse=cv.parse_str,
                     help="GGUF file or Hugging Face checkpoint directory, whose tokenizer and chat "
                          "template the router uses (default: bundled SmolLM2-135M)")
    served_model_name: tuple[str, ...] = opt((), parse=cv.parse_names,
                                             help="model name(s) in the API: requests may name any, responses "
                                                  "report the first (default: the workers' name)")
    cache_dir: str | None = opt(factory=default_cache_dir, parse=cv.optional(cv.parse_str),
                                help="directory keeping GGUF conversions for fast restarts ('' turns it off)")
    host: str = opt("127.0.0.1", parse=cv.parse_str, help="HTTP listen address")
    port: int = opt(8000, parse=cv.parse_int, help="HTTP listen port")
    allowed_hosts: tuple[str, ...] = opt((), parse=cv.parse_names,
                                         help="host names a request's Host header may name, comma-separated ('*': "
                                              "any); default: on a loopback --host only loopback names (a web page "
                                              "cannot reach the server by DNS rebinding), else any")
    workers: tuple[str, ...] = opt((), parse=cv.parse_addresses, flag="worker",
                                   help="worker gRPC address(es), comma-separated host:port (default: "
                                        f"{DEFAULT_WORKER} unless --worker-dns is given)")
    rpc_timeout_s: float = opt(5.0, parse=cv.parse_float, flag="rpc-timeout",
                               help="deadline of each control call to a worker (seconds)")
    generate_timeout_s: float = opt(3600.0, parse=cv.parse_float, flag="generate-timeout",
                                    help="deadline of one generation stream (seconds)")
    worker_wait_timeout_s: float = opt(60.0, parse=cv.parse_float, flag="worker-wait-timeout",
                                       help="how long the router waits at start for its workers (seconds)")
    first_output_timeout_s: float = opt(600.0, parse=cv.parse_float, flag="first-output-timeout",
                                        help="wait for a request's first output, queueing included")
    output_timeout_s: float = opt(120.0, parse=cv.parse_float, flag="output-timeout",
                                  help="longest wait between two outputs of one request (seconds)")
    body_read_timeout_s: float = opt(30.0, parse=cv.parse_float, flag="body-read-timeout",
                                     help="a generation request's body must be in within this (seconds; 408 "
                                          "otherwise); no admission slot is taken before it is")
    send_timeout_s: float = opt(60.0, parse=cv.parse_float, flag="send-timeout",
                                help="a client must take each write of its answer within this (seconds), else it "
                                     "is cut off and its request aborted")
    sse_keepalive_interval_s: float = opt(0.0, parse=cv.parse_float, flag="sse-keepalive-interval",
                                          help="a stream with no event for this long (a queued request, a long "
                                               "prefill) gets an SSE comment, so idle-timeout proxies keep it open "
                                               "(seconds; 0, the default: never, as vLLM)")
    generation_config: str = opt("auto", parse=cv.parse_str,
                                 help="default sampling parameters for fields a request leaves unset: auto (the "
                                      "model folder's generation_config.json, as vLLM), vllm (none), or a folder")
    migration_limit: int = opt(3, parse=cv.parse_int,
                               help="times one request may move to another decode worker when its own fails "
                                    "mid-stream, continuing from the tokens already sent (0: the stream ends "
                                    "with an error instead)")
    max_pending_requests: int = opt(1024, parse=cv.parse_int,
                                    help="generation requests in progress at once; one more is answered 503 with "
                                         "Retry-After at once")
    log_level: str = opt("info", parse=cv.choice(*LOG_LEVELS), help="logging level")
    deployment_id: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                    help="admit only workers started with this --deployment-id (pdserve serve: a "
                                         "fresh id per launch); unset: admit any worker and log the id it reports")
    tls_dir: str | None = tls_dir_option()
    insecure_internal: bool = insecure_internal_option()
    # ---- API keys and tenants (see common/api_keys.py and router/openai/access/) ----
    api_key: tuple[str, ...] = api_key_option("API key(s) every /v1 request must send as 'Authorization: Bearer "
                                              "<key>', comma-separated; all of tenant 'default'")
    api_keys_file: str | None = api_keys_file_option("file of '<key> <tenant> [admin]' lines; each tenant has a KV "
                                                     "cache of its own; admin keys may also load and unload LoRA "
                                                     "adapters")
    protect_metrics: bool = protect_metrics_option()
    allow_runtime_lora_updating: bool = opt(False, parse=cv.parse_bool,
                                            help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (or "
                                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's switch); with API keys "
                                                 "only an admin key may call them")
    # ---- tool calling (see router/openai/tools.py) ----
    enable_auto_tool_choice: bool = opt(False, parse=cv.parse_bool,
                                        help='serve tool_choice "auto": the model decides, its output is read with '
                                             "--tool-call-parser")
    tool_call_parser: str | None = opt(None, parse=cv.optional(cv.choice(*TOOL_CALL_PARSER_NAMES)),
                                       help="how tool calls are read from the output: "
                                            + " | ".join(TOOL_CALL_PARSER_NAMES))
    # ---- routing across workers (see router/cost.py and router/policy.py) ----
    routing_policy: str = opt("kv_aware", parse=cv.choice(*ROUTING_POLICIES),
                              help=" | ".join(ROUTING_POLICIES) + "; the others exist for comparison")
    router_temperature: float = opt(0.0, parse=cv.parse_float,
                                    help="kv_aware: 0 picks the lowest cost; > 0 samples a softmax over costs")
    prefill_load_scale: float = opt(1.0, parse=cv.parse_float,
                                    help="weight of prefill work (queued and this prompt's) against held blocks")
    local_prefill_queue_tokens: int = opt(2048, parse=cv.parse_int,
                                          help="a decode worker computes a prompt itself while the prefill worker "
                                               "has at least this many prompt tokens queued and it has at most this "
                                               "many, the prompt's included (conditional disaggregation); 0: never")
    host_cache_hit_weight: float = opt(0.75, parse=cv.parse_float,
                                       help="credit for a prompt block a worker holds in host memory (device: 1)")
    disk_cache_hit_weight: float = opt(0.25, parse=cv.parse_float,
                                       help="credit for a prompt block a worker holds on disk")
    session_header: str | None = opt(None, parse=cv.optional(cv.parse_str),
                                     help="HTTP header naming a session (e.g. X-Session-Id) whose requests keep "
                                          "to the same workers; unset: no session affinity")
    session_ttl_s: float = opt(600.0, parse=cv.parse_float, flag="session-ttl",
                               help="seconds a session keeps its workers after its last request")
    worker_poll_interval_s: float = opt(0.5, parse=cv.parse_float, flag="worker-poll-interval",
                                        help="seconds between load queries to each worker")
    worker_failure_threshold: int = opt(3, parse=cv.parse_int,
                                        help="failed load queries in a row that take a worker out of rotation")
    worker_dns: tuple[str, ...] = opt((), parse=cv.parse_addresses,
                                      help="DNS name(s) of workers, comma-separated NAME:PORT (a Kubernetes headless "
                                           "Service, a compose service): every address behind a name is admitted like "
                                           "a --worker, and drained out once it leaves the name")
    worker_dns_interval_s: float = opt(5.0, parse=cv.parse_float, flag="worker-dns-interval",
                                       help="seconds between resolutions of each --worker-dns name")

    def __post_init__(self) -> None:
        check(0 < self.port < 65536, "port", self.port, "must be in 1..65535")
        check(self.sse_keepalive_interval_s >= 0, "sse_keepalive_interval_s", self.sse_keepalive_interval_s,
              "must be >= 0")
        check_positive(self, "rpc_timeout_s", "generate_timeout_s", "worker_wait_timeout_s",
                       "first_output_timeout_s", "output_timeout_s", "session_ttl_s", "worker_poll_interval_s",
                       "worker_failure_threshold", "max_pending_requests", "worker_dns_interval_s",
                       "body_read_timeout_s", "send_timeout_s")
        check(len(set(self.workers)) == len(self.workers), "workers", ",".join(self.workers),
              "names a worker twice")
        check(self.migration_limit >= 0, "migration_limit", self.migration_limit, "must be >= 0")
        check(len(set(self.worker_dns)) == len(self.worker_dns), "worker_dns", ",".join(self.worker_dns),
              "names a DNS name twice")
        check(self.router_temperature >= 0, "router_temperature", self.router_temperature, "must be >= 0")
        check(self.prefill_load_scale >= 0, "prefill_load_scale", self.prefill_load_scale, "must be >= 0")
        check(self.local_prefill_queue_tokens >= 0, "local_prefill_queue_tokens", self.local_prefill_queue_tokens,
              "must be >= 0")
        for name in ("host_cache_hit_weight", "disk_cache_hit_weight"):
            check(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        check(not self.protect_metrics or self.has_api_keys, "protect_metrics", self.protect_metrics,
              "needs --api-key or --api-keys-file")
        check(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "enable_auto_tool_choice",
              self.enable_auto_tool_choice, "needs --tool-call-parser")

    @property
    def has_api_keys(self) -> bool:
        return bool(self.api_key) or self.api_keys_file is not None

    @property
    def static_workers(self) -> tuple[str, ...]:
        """The `--worker` addresses; the default one only when no DNS name is given either."""
        return self.workers or (() if self.worker_dns else (DEFAULT_WORKER,))


# ---- resolution: flag > environment > config file > default (see setting_sources.py) --------

T = TypeVar("T")


def _resolve_one(cls: type[T], prog: str, argv: Sequence[str] | None,
                 environ: Mapping[str, str] | None) -> T:
    options = cv.options_of(cls, "")
    values, labels = resolve_sources(prog, options, argv, environ)
    return build_section(cls, "", options, values, labels)


def resolve_worker_settings(argv: Sequence[str] | None = None,
                            environ: Mapping[str, str] | None = None) -> WorkerSettings:
    """`pdserve worker`'s settings. `environ` None reads the process environment.
    Raises ConfigError for a bad value; exits (argparse) on an unknown flag or --help."""
    settings = _resolve_one(WorkerSettings, "pdserve worker", argv, environ)
    pod = pod_name(environ)
    if settings.worker_id is None and settings.tls_dir is None and pod:
        # With TLS the certificate names the worker, the pod its instance (`worker/__main__.py`).
        return dataclasses.replace(settings, worker_id=pod)
    return settings


def pod_name(environ: Mapping[str, str] | None = None) -> str | None:
    """The Kubernetes pod this process runs in (`POD_NAME`, from the downward API), if any."""
    return (os.environ if environ is None else environ).get(POD_NAME_ENV) or None


def resolve_router_settings(argv: Sequence[str] | None = None,
                            environ: Mapping[str, str] | None = None) -> RouterSettings:
    """`pdserve router`'s settings; as `resolve_worker_settings`."""
    return _resolve_one(RouterSettings, "pdserve router", argv, environ)


def to_argv(settings: WorkerSettings | RouterSettings) -> list[str]:
    """Flags that resolve back to `settings`, with `child_environ(settings)` for its secrets
    (a field left None is passed as '', which unsets it)."""
    argv = []
    for o in cv.options_of(type(settings), ""):
        value = getattr(settings, o.targets[0][1])
        if o.is_secret:
            continue
        if value is None:
            argv += [f"--{o.flag}", ""]
        elif o.is_list:
            argv += [arg for item in value for arg in (f"--{o.flag}", item)]
        elif o.is_bool:
            argv.append(f"--{o.flag}" if value else f"--no-{o.flag}")
        else:
            argv += [f"--{o.flag}", str(value)]
    return argv


def child_environ(settings: WorkerSettings | RouterSettings | None = None) -> dict[str, str]:
    """This process's environment without its PDSERVE_ variables, for a child that gets
    every setting as a flag (a serve config file's keys would be unknown to a worker), plus
    `settings`' secrets, which `to_argv` leaves out (a command line is world-readable). Without
    POD_NAME: serve's workers in one pod would all take the pod's name as their id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != POD_NAME_ENV}
    for o in cv.options_of(type(settings), "") if settings is not None else ():
        value = getattr(settings, o.targets[0][1])
        if o.is_secret and value:
            env[o.env_var] = ",".join(value)
    return env


# The OpenMP runtime and torch's allocator read these once, when torch loads, so a worker
# puts them in its environment before importing torch; a value the user set wins.
# Transparent huge pages: NIXL pins the KV tensor page by page, and transfers ran 1.4-2x
# faster on huge pages (docs/transfer.md). A long OpenMP spin (some milliseconds) before a
# waiting thread sleeps: a decode step opens ~250 parallel regions, and waking a sleeping
# thread for each (OMP_WAIT_POLICY=PASSIVE, or libgomp's short spin when it counts more
# threads than cores) cost a third of a batch-1 step; a thread still sleeps once the engine
# idles (benchmarks/README.md, "Threads").
WORKER_RUNTIME_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1", "GOMP_SPINCOUNT": "1000000"}


def apply_worker_runtime_defaults() -> dict[str, str]:
    """Set WORKER_RUNTIME_DEFAULTS where the environment leaves them unset; the values in force."""
    for name, value in WORKER_RUNTIME_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in WORKER_RUNTIME_DEFAULTS}


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0))

