"""A deterministic stand-in for the worker, and a real uvicorn server on loopback to put it behind.

`WordBackend` generates from a 16-word vocabulary of single tokens of the real tokenizer:
greedy output is a function of the prompt; sampled output of (seed, choice index, prompt),
or fresh randomness without a seed. Stop strings are honoured with the real `StopChecker`
and stop token ids end a choice, as the worker does. Knobs make it hang or fail on demand.
"""
import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from pdserve.engine.core.detokenizer import StopChecker
from pdserve.common.errors import WorkerError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput, TokenLogprob
from pdserve.common.stats import EngineStats, ModelInfo, WorkerRole
from pdserve.models.tokenizer import Tokenizer, load_tokenizer

WORDS = (" red", " green", " blue", " cat", " dog", " sun", " moon", " tree",
         " rock", " fish", " bird", " star", " hill", " lake", " wind", " rain")
MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 128
STATS = EngineStats(num_running=2, num_waiting=1, num_free_blocks=40, num_total_blocks=64,
                    num_used_blocks=24, num_prefill_tokens_queued=0, prefix_cache_queried_tokens=300,
                    prefix_cache_hit_tokens=120, num_preemptions=0)


def load_test_tokenizer(cache_root: Path) -> Tokenizer:
    """The default model's tokenizer; converted once per test session under `cache_root`."""
    return load_tokenizer(None, cache_dir=str(cache_root / "tokenizer-cache"))


def model_info(tokenizer: Tokenizer) -> ModelInfo:
    return ModelInfo(model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN, tokens_per_block=16,
                     block_hash_algorithm="sha256-v1", role=WorkerRole.BOTH,
                     vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids)


def greedy_word(prompt: tuple[int, ...], step: int) -> int:
    """Index into WORDS of the greedy token at `step`."""
    return (sum(prompt) + step) % len(WORDS)


class WordBackend:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.word_ids = [tokenizer.encode(word, add_special_tokens=False)[0] for word in WORDS]
        self.reset()

    def reset(self) -> None:
        """Back to a well-behaved worker with no history (one server serves many tests)."""
        self.requests: list[GenerationRequest] = []
        self.num_cached_tokens = 0
        self.hang_after: int | None = None  # outputs sent before waiting forever
        self.fail_after: int | None = None  # outputs sent before raising WorkerError
        self.fail_on_start: Exception | None = None
        self.first_output_delay_s = 0.0  # a queued request: seconds before the first output
        self.token_interval_s = 0.0  # seconds between two steps of a request
        self.stats_error: Exception | None = None
        self.closed_early = threading.Event()  # a stream was abandoned before it finished
        self.closed_ids: list[RequestId] = []
        self.aborted: list[RequestId] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if self.fail_on_start is not None:
            raise self.fail_on_start
        finished = False
        try:
            async for output in self._outputs(request):
                yield output
            finished = True
        finally:
            if not finished:
                self.closed_ids.append(request.request_id)
                self.closed_early.set()

    async def _outputs(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        sampling = request.sampling
        rngs = [self._rng(request, i) for i in range(sampling.n)]
        stops = [StopChecker(sampling.stop, sampling.include_stop_str_in_output) for _ in range(sampling.n)]
        unfinished = set(range(sampling.n))
        num_sent = 0
        await asyncio.sleep(self.first_output_delay_s)
        for step in range(sampling.max_tokens):
            for i in sorted(unfinished):
                if num_sent == self.hang_after:
                    await asyncio.Event().wait()
                if num_sent == self.fail_after:
                    raise WorkerError("the fake worker failed on purpose")
                output = self._step(request, rngs[i], stops[i], i, step)
                if output.is_finished:
                    unfinished.discard(i)
                yield output
                num_sent += 1
            await asyncio.sleep(self.token_interval_s)

    def _step(self, request: GenerationRequest, rng: random.Random | None, stop: StopChecker,
              index: int, step: int) -> RequestOutput:
        sampling = request.sampling
        word = greedy_word(request.prompt_token_ids, step) if rng is None else rng.randrange(len(WORDS))
        token = self.word_ids[word]
        if token in sampling.stop_token_ids:
            piece_text, reason = stop.flush(), "stop"
        else:
            piece = stop.feed(WORDS[word])
            piece_text = piece.text
            reason = "stop" if piece.stopped else None
        if reason is None and step == sampling.max_tokens - 1:
            piece_text, reason = piece_text + stop.flush(), "length"
        logprobs = ()
        if sampling.logprobs is not None:
            top = tuple((self.word_ids[(word + j) % len(WORDS)], -0.25 * (j + 1)) for j in range(sampling.logprobs))
            logprobs = (TokenLogprob(token, -0.125, top),)
        return RequestOutput(request.request_id, index, (token,), piece_text, logprobs, reason,
                             len(request.prompt_token_ids), self.num_cached_tokens)

    @staticmethod
    def _rng(request: GenerationRequest, index: int) -> random.Random | None:
        if request.sampling.is_greedy:
            return None
        if request.sampling.seed is None:
            return random.Random()
        return random.Random(f"{request.sampling.seed}/{index}/{request.prompt_token_ids}")

    async def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)

    async def stats(self) -> EngineStats:
        if self.stats_error is not None:
            raise self.stats_error
        return STATS

    async def info(self) -> ModelInfo:
        return model_info(self.tokenizer)

    async def close(self) -> None:
        return None


@contextmanager
def serve(app: object) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 10 s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)


@contextmanager
def word_server(cache_root: Path, **app_options: object) -> Iterator[tuple[str, WordBackend]]:
    """A real uvicorn serving the default model's tokenizer over a fresh `WordBackend`, the app
    built with `app_options` (`create_app`'s); yields (base URL, backend)."""
    from pdserve.router.openai.app import create_app

    tokenizer = load_test_tokenizer(cache_root)
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer), **app_options)) as url:
        yield url, backend
