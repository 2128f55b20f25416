"""`RouterSettings`: the HTTP router's settings."""
from dataclasses import dataclass

from pdserve.common import config_options as cv
from pdserve.common.model_source import default_model_path
from pdserve.common.settings.options import (LOG_LEVELS, api_key_option, api_keys_file_option, check, check_positive,
                                             default_cache_dir, insecure_internal_option, opt, protect_metrics_option,
                                             tls_dir_option)

ROUTING_POLICIES = ("kv_aware", "round_robin", "least_loaded", "random")
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")  # router/openai/tool_parsers.py reads each
DEFAULT_WORKER = "127.0.0.1:50051"


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
