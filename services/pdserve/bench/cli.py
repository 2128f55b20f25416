"""`pdserve bench`: load-test any OpenAI-compatible endpoint over HTTP.

Wires the parts together: flags -> served model and tokenizer -> dataset -> warm-up ->
timed run -> table, JSON and plot. Speaks HTTP only: never imports torch or the server.
"""
import asyncio
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import EndpointError, fetch_model_ids
from pdserve.bench.datasets import Conversation, build_dataset, warmup_conversations
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.options import BenchConfig, UsageError, parse_config
from pdserve.bench.plot import write_plot
from pdserve.bench.prompts import TextTokenizer
from pdserve.bench.report import RunInfo, format_table, result_json, write_json
from pdserve.bench.runner import RequestOptions, RunResult, run_requests
from pdserve.common.errors import ConfigError

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Target:
    """The served model and the tokenizer that counts its tokens."""

    model: str
    tokenizer_path: str
    tokenizer: TextTokenizer


def _tokenizer_path(flag: str | None, model: str) -> str:
    """The tokenizer that builds and counts prompts: --tokenizer, else the served model id when
    it is a local path (pdserve and vLLM serve `--model PATH` under PATH), else pdserve's bundled
    default model when the server serves it under its own name. Any other model without
    --tokenizer is a ConfigError: another model's tokenizer would build prompts of the wrong
    lengths, which the server then refuses."""
    if flag:
        return flag
    if Path(model).exists():
        return model
    from pdserve.common.model_source import default_model_path, served_name

    default = default_model_path()
    if served_name(default) == model:
        return default
    raise ConfigError("--tokenizer", None, f"the served model {model!r} is not a local path; pass --tokenizer "
                                           "PATH (its tokenizer), or --model PATH if the server serves it by path")


def _load_tokenizer(path: str) -> TextTokenizer:
    from pdserve.models.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("--tokenizer", path, f"cannot load a tokenizer: {exc}") from None


async def _resolve_target(config: BenchConfig, http: httpx.AsyncClient) -> Target:
    """Check the server answers `/v1/models` (the readiness check) and pick the model."""
    served = await fetch_model_ids(http, config.base_url)
    if config.model is None and not served:
        raise EndpointError(f"{config.base_url}/v1/models lists no model; pass --model")
    model = config.model or served[0]
    path = _tokenizer_path(config.tokenizer, model)
    return Target(model, path, _load_tokenizer(path))


async def _timed_run(
    config: BenchConfig, http: httpx.AsyncClient, target: Target, conversations: list[Conversation]
) -> RunResult:
    options = RequestOptions(config.base_url, config.endpoint, target.model, config.temperature,
                             config.ignore_eos, config.request_timeout_s)

    def count(text: str) -> int:
        return len(target.tokenizer.encode(text, add_special_tokens=False))

    if config.num_warmups:
        warmups = warmup_conversations(conversations, config.num_warmups, target.tokenizer, config.seed)
        await run_requests(options, http, warmups, [0.0] * len(warmups), count, config.max_concurrency)
    offsets = arrival_offsets(len(conversations), config.request_rate, config.burstiness, config.seed)
    total = sum(len(c.turns) for c in conversations)
    with tqdm(total=total, disable=not config.show_progress, unit="req", file=sys.stderr) as bar:
        return await run_requests(options, http, conversations, offsets, count,
                                  config.max_concurrency, bar.update)


def _run_info(config: BenchConfig, target: Target, date: str) -> RunInfo:
    return RunInfo(
        date=date, backend="openai-chat" if "chat" in config.endpoint else "openai",
        model_id=target.model, tokenizer_id=target.tokenizer_path, dataset_name=config.dataset.name,
        num_prompts=config.dataset.num_prompts, request_rate=config.request_rate,
        burstiness=config.burstiness, max_concurrency=config.max_concurrency,
        num_warmups=config.num_warmups, seed=config.seed, slo=config.slo,
    )


async def run_benchmark(config: BenchConfig) -> int:
    """Run one benchmark and report it; 0 if any request succeeded, else 1."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    timeout = httpx.Timeout(config.request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
        target = await _resolve_target(config, http)
        conversations = build_dataset(config.dataset, target.tokenizer, config.seed)
        result = await _timed_run(config, http, target, conversations)
    metrics = compute_metrics(result.records, result.duration_s, config.slo, config.percentiles)
    info = _run_info(config, target, date)
    print(format_table(metrics, info))
    if config.json_path:
        write_json(config.json_path, result_json(metrics, result.records, info))
    if config.plot_path:
        write_plot(result.records, result.duration_s, config.plot_path, f"{target.model} {date}")
    if metrics.completed == 0:
        first_error = next((r.error for r in result.records if r.error), "no request was sent")
        return _fail(f"every request failed; first error: {first_error}", 1)
    return 0


def _fail(message: str, code: int) -> int:
    print(f"pdserve bench: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdserve bench`. Bad input exits non-zero with one line, no traceback."""
    try:
        config = parse_config(list(sys.argv[1:] if argv is None else argv))
        return asyncio.run(run_benchmark(config))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        return _fail(f"{exc} (see pdserve bench --help)", 2)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except EndpointError as exc:
        return _fail(str(exc), 1)
    except OSError as exc:  # --json / --plot path not writable
        return _fail(f"{exc.filename}: {exc.strerror}", 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
