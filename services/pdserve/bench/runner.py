"""Drives one benchmark run: arrivals, the concurrency cap, conversations, records.

Conversation i starts at `offsets[i]` after the run starts; its turns go one after
another, each resending the history with the server's earlier answers. With a
concurrency cap, a request waits for a free slot first (reported as queue time, not
counted in TTFT). A failed turn ends its conversation: later turns have no history.
"""
import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.bench.client import StreamResult, stream_request
from pdserve.bench.datasets import Conversation, Turn
from pdserve.bench.metrics import RequestRecord
from pdserve.common.errors import ConfigError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Fields every request carries; `endpoint` picks the body shape."""

    base_url: str
    endpoint: str
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float | None = None  # per request, send to last byte

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError("--endpoint", self.endpoint, f"choose from {', '.join(ENDPOINTS)}")

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint


@dataclass(frozen=True, slots=True)
class RunResult:
    records: list[RequestRecord]  # in the order responses ended
    duration_s: float  # first scheduled send to the last response


def build_payload(
    options: RequestOptions, conversation: Conversation, history: list[tuple[str, str]], turn: Turn
) -> dict:
    """The JSON body for `turn`, after `history` ((user text, server answer) pairs)."""
    body: dict = {
        "model": options.model,
        "max_tokens": turn.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.endpoint == "/v1/completions":
        body["prompt"] = conversation.system + "".join(u + a for u, a in history) + turn.text
        return body
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for user, answer in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    body["messages"] = messages + [{"role": "user", "content": turn.text}]
    return body


class _Run:
    def __init__(
        self, options: RequestOptions, http: httpx.AsyncClient, max_concurrency: int | None,
        count_tokens: Callable[[str], int], on_request_done: Callable[[int], None],
    ) -> None:
        self.options = options
        self.http = http
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.count_tokens = count_tokens
        self.on_request_done = on_request_done
        self.records: list[RequestRecord] = []
        self.started_at = time.perf_counter()

    async def _stream(self, payload: dict) -> tuple[float, float, StreamResult]:
        """(queued at, sent at, result): with a cap, the request waits for a slot first."""
        queued_at = time.perf_counter()
        async with self.slots or contextlib.nullcontext():
            sent_at = time.perf_counter()
            result = await stream_request(self.http, self.options.url, payload, self.options.timeout_s)
        return queued_at, sent_at, result

    async def send(self, payload: dict, estimated_prompt_len: int) -> RequestRecord:
        """Send one request; token counts come from the server's usage when present."""
        queued_at, sent_at, result = await self._stream(payload)
        record = RequestRecord(
            index=len(self.records),
            start_time=sent_at - self.started_at,
            queue_time=sent_at - queued_at,
            prompt_len=estimated_prompt_len if result.prompt_tokens is None else result.prompt_tokens,
            output_len=(self.count_tokens(result.text) if result.completion_tokens is None
                        else result.completion_tokens),
            chunk_times=result.chunk_times,
            finish_time=result.finish_time,
            generated_text=result.text,
            error=result.error,
        )
        self.records.append(record)
        self.on_request_done(1)
        return record

    async def conversation(self, conversation: Conversation, offset: float) -> None:
        await asyncio.sleep(max(0.0, self.started_at + offset - time.perf_counter()))
        history: list[tuple[str, str]] = []
        prompt_len = conversation.system_tokens
        for sent, turn in enumerate(conversation.turns, start=1):
            prompt_len += turn.num_tokens
            record = await self.send(build_payload(self.options, conversation, history, turn), prompt_len)
            if not record.is_success:
                self.on_request_done(len(conversation.turns) - sent)  # the rest is never sent
                return
            history.append((turn.text, record.generated_text))
            prompt_len += record.output_len


async def run_requests(
    options: RequestOptions,
    http: httpx.AsyncClient,
    conversations: list[Conversation],
    offsets: list[float],
    count_tokens: Callable[[str], int],
    max_concurrency: int | None = None,
    on_request_done: Callable[[int], None] = lambda n: None,
) -> RunResult:
    """Send every conversation on its schedule and wait for all of them.

    `count_tokens` counts output tokens when the server sends no usage.
    `on_request_done(n)` is called as n planned requests finish or are abandoned, so a
    progress bar reaches the total number of turns.
    """
    if len(offsets) != len(conversations):
        raise ConfigError("offsets", len(offsets), f"need one per conversation ({len(conversations)})")
    run = _Run(options, http, max_concurrency, count_tokens, on_request_done)
    await asyncio.gather(*(run.conversation(c, t) for c, t in zip(conversations, offsets)))
    return RunResult(run.records, time.perf_counter() - run.started_at)
