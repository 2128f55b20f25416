"""`WorkerSettings`: one worker process's settings; and the runtime environment a worker
sets before torch loads."""
import os
import socket
from dataclasses import dataclass

from pdserve.common import config_options as cv
from pdserve.common.model_source import default_model_path, served_name
from pdserve.common.settings.options import (LOG_LEVELS, api_key_option, api_keys_file_option, check, check_positive,
                                             default_cache_dir, insecure_internal_option, opt, protect_metrics_option,
                                             tls_dir_option)
from pdserve.common.stats import WorkerRole
from pdserve.common.speculative import parse_speculative_config

DTYPES = ("auto", "float16", "bfloat16", "float32")
# --kernels: the ISA levels are those the native kernels are built for (engine/model/native/levels.py)
KERNEL_CHOICES = ("auto", "native", "torch", "jit", "avx2", "avx512", "avx512_bf16", "amx")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8")
DEVICES = ("auto", "cpu", "cuda")
POD_NAME_ENV = "POD_NAME"


def _normalised_speculative_config(raw: object) -> str:
    """The JSON (text, or a config file's mapping) checked, and written back in one form."""
    return parse_speculative_config(raw).to_json()
  # a Kubernetes pod's name, set through the downward API


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
    speculative_config: str | None = opt(None, parse=cv.optional(_normalised_speculative_config),
                                         help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                                              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4} (methods: "
                                              "ngram, draft_model, eagle, eagle3, mtp; \"disable_by_batch_size\": N "
                                              "stops drafting while N requests run or wait); unset: none")
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
