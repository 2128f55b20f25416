"""Command-line flags of `pdserve bench`, named as in `vllm bench serve` where they mean
the same, parsed once into a frozen `BenchConfig`."""
import argparse
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pdserve.bench.arrivals import validate_arrivals
from pdserve.bench.datasets import (
    DATASET_ALIASES, DATASET_NAMES, DatasetSpec, canonical_dataset_name, check_spec,
)
from pdserve.bench.plot import check_plotting
from pdserve.bench.runner import ENDPOINTS
from pdserve.bench.slo import Slo, parse_slo, parse_vllm_goodput
from pdserve.common.errors import ConfigError

CHAT_BACKENDS = ("openai-chat",)
API_KEY_ENV = ("PDSERVE_API_KEY", "OPENAI_API_KEY")  # the first set one is sent when --api-key is not given
BACKENDS = ("vllm", "openai", "openai-chat")


class UsageError(Exception):
    """argparse rejected the command line; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's hook; raising keeps it to one line
        raise UsageError(message)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    endpoint: str
    model: str | None  # None: the first model `/v1/models` lists
    tokenizer: str | None  # None: the served model if it is a local path (else an error, see cli.py)
    dataset: DatasetSpec
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    num_warmups: int
    seed: int
    temperature: float
    ignore_eos: bool
    slo: Slo | None
    percentiles: tuple[float, ...]
    request_timeout_s: float
    json_path: str | None
    plot_path: str | None
    show_progress: bool
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer`, never printed


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--endpoint", choices=ENDPOINTS, help="default /v1/completions")
    group.add_argument("--backend", choices=BACKENDS, help="accepted for vLLM compatibility; "
                       "openai-chat implies --endpoint /v1/chat/completions")
    group.add_argument("--model", help="model name sent in requests (default: first of /v1/models)")
    group.add_argument("--tokenizer", help="tokenizer path used to count and build prompts (default: the served model, "
                                                "when it is a local path)")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    group.add_argument("--api-key", help=f"bearer key for a server that wants one (default: ${API_KEY_ENV[0]}, "
                                         f"then ${API_KEY_ENV[1]})")


def _add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    names = DATASET_NAMES + tuple(DATASET_ALIASES)
    group.add_argument("--dataset-name", default="random", help=f"one of {', '.join(names)}")
    group.add_argument("--dataset-path", help="ShareGPT JSON file (--dataset-name sharegpt)")
    group.add_argument("--num-prompts", type=int, default=1000, help="requests (conversations for multi-turn)")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0)
    group.add_argument("--random-prefix-len", type=int, default=0)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group.add_argument("--multi-turn-num-turns", type=int, default=3)
    group.add_argument("--multi-turn-input-len", type=int, default=128, help="tokens per user message")
    group.add_argument("--multi-turn-output-len", type=int, default=64)
    group.add_argument("--sharegpt-output-len", type=int, help="fixed output length")
    group.add_argument("--copy-input-len", type=int, default=512, help="prompt tokens: an instruction to repeat "
                       "a passage of prose, and the passage")
    group.add_argument("--copy-output-len", type=int, default=128)


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf)")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    group.add_argument("--max-concurrency", type=int, help="most requests in flight")
    group.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")


def _add_report_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--slo", help="goodput bounds, e.g. ttft=500ms,tpot=50ms,e2el=2s")
    group.add_argument("--goodput", nargs="+", help="vLLM spelling of --slo: ttft:500 tpot:50 (ms)")
    group.add_argument("--metric-percentiles", default="90,99", help="comma-separated, e.g. 50,90,99")
    group.add_argument("--json", dest="json_path", metavar="PATH", help="write the result JSON here")
    group.add_argument("--save-result", action="store_true", help="vLLM spelling: write the JSON to "
                       "--result-dir/--result-filename (default ./pdserve-bench-DATE.json)")
    group.add_argument("--result-dir", help="with --save-result")
    group.add_argument("--result-filename", help="with --save-result")
    group.add_argument("--plot", dest="plot_path", metavar="PATH.png", help="write latency/throughput plots")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve bench", description="Load-test an OpenAI-compatible endpoint.")
    for add in (_add_target_flags, _add_dataset_flags, _add_load_flags, _add_report_flags):
        add(parser)
    return parser


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ConfigError("--metric-percentiles", text, "expected numbers such as 90,99") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise ConfigError("--metric-percentiles", text, "each percentile must be in (0, 100]")
    return values


def _slo(args: argparse.Namespace) -> Slo | None:
    if args.slo is not None and args.goodput is not None:
        raise ConfigError("--goodput", " ".join(args.goodput), "give --slo or --goodput, not both")
    if args.slo is not None:
        return parse_slo(args.slo)
    return None if args.goodput is None else parse_vllm_goodput(args.goodput)


def _endpoint(args: argparse.Namespace) -> str:
    if args.backend in CHAT_BACKENDS:
        if args.endpoint not in (None, "/v1/chat/completions"):
            raise ConfigError("--endpoint", args.endpoint, f"--backend {args.backend} sends chat requests")
        return "/v1/chat/completions"
    return args.endpoint or "/v1/completions"


def _dataset(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=canonical_dataset_name(args.dataset_name), num_prompts=args.num_prompts,
        path=args.dataset_path, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_len=args.prefix_repetition_prefix_len, suffix_len=args.prefix_repetition_suffix_len,
        prefix_output_len=args.prefix_repetition_output_len, num_turns=args.multi_turn_num_turns,
        turn_input_len=args.multi_turn_input_len, turn_output_len=args.multi_turn_output_len,
        sharegpt_output_len=args.sharegpt_output_len, copy_input_len=args.copy_input_len,
        copy_output_len=args.copy_output_len,
    )


def _check_counts(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency", args.max_concurrency, "must be at least 1")
    if args.num_warmups < 0:
        raise ConfigError("--num-warmups", args.num_warmups, "must be >= 0")
    if not args.request_timeout > 0:
        raise ConfigError("--request-timeout", args.request_timeout, "must be > 0 seconds")


def _json_path(args: argparse.Namespace) -> str | None:
    """--json PATH, or where vLLM's --save-result flags put the file."""
    if args.json_path is not None or not args.save_result:
        return args.json_path
    name = args.result_filename or f"pdserve-bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(args.result_dir or ".") / name)


def _check_output_paths(json_path: str | None, plot_path: str | None) -> None:
    """Fail before the run, not after it, when a result cannot be written."""
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ConfigError(flag, path, "its directory does not exist")
    if plot_path is not None:
        check_plotting(plot_path)


def parse_config(argv: list[str]) -> BenchConfig:
    """Parse the command line. Raises UsageError (argparse) or ConfigError (bad value)."""
    args = build_parser().parse_args(argv)
    _check_counts(args)
    json_path = _json_path(args)
    _check_output_paths(json_path, args.plot_path)
    validate_arrivals(args.request_rate, args.burstiness)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError("--base-url", args.base_url, "must start with http:// or https://")
    dataset = _dataset(args)
    check_spec(dataset)
    return BenchConfig(
        base_url=base_url, endpoint=_endpoint(args), model=args.model, tokenizer=args.tokenizer,
        dataset=dataset, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, seed=args.seed,
        temperature=args.temperature, ignore_eos=args.ignore_eos, slo=_slo(args),
        percentiles=_percentiles(args.metric_percentiles), request_timeout_s=args.request_timeout,
        json_path=json_path, plot_path=args.plot_path, show_progress=not args.disable_tqdm,
        api_key=args.api_key or next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None),
    )
