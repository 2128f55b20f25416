"""A small OpenAI-compatible SSE server whose answers the tests know exactly.

Every accepted request streams `max_tokens` chunks of text "t{i} " and, unless usage is
turned off, a final usage chunk with prompt_tokens = PROMPT_TOKENS_BASE + len(prompt text)
(deliberately unlike any client-side estimate) and completion_tokens = max_tokens.
`Behavior.refuse(body)` returns an HTTP status to refuse with (or None); `fail_midway(body)`
makes the stream send two chunks and then an error event inside the HTTP 200 stream.
"""
import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PROMPT_TOKENS_BASE = 1000
MODEL_ID = "fake-model"
START_TIMEOUT_S = 10.0


def prompt_text(body: dict) -> str:
    if "prompt" in body:
        return body["prompt"]
    return "".join(message["content"] for message in body["messages"])


@dataclass
class Behavior:
    refuse: Callable[[dict], int | None] = lambda body: None
    fail_midway: Callable[[dict], bool] = lambda body: False
    include_usage: bool = True
    chunk_delay_s: float = 0.0
    model_id: str = MODEL_ID  # what /v1/models lists (a local path makes it the tokenizer)
    api_key: str | None = None  # when set, /v1/* without `Authorization: Bearer <key>` is 401
    bodies: list[dict] = field(default_factory=list)  # every POST body, in arrival order
    num_in_flight: int = 0
    max_in_flight: int = 0


def _event(body: dict, text: str) -> str:
    if "messages" in body:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
    return "data: " + json.dumps({"object": "chunk", "choices": [choice]}) + "\n\n"


async def _stream(body: dict, behavior: Behavior):
    behavior.num_in_flight += 1
    behavior.max_in_flight = max(behavior.max_in_flight, behavior.num_in_flight)
    try:
        if "messages" in body:  # chat servers send the role first, without text
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
        for i in range(body["max_tokens"]):
            await asyncio.sleep(behavior.chunk_delay_s)
            if i == 2 and behavior.fail_midway(body):
                yield "data: " + json.dumps({"error": {"message": "engine failed", "code": 500}}) + "\n\n"
                return
            yield _event(body, f"t{i} ")
        if behavior.include_usage:
            usage = {"prompt_tokens": PROMPT_TOKENS_BASE + len(prompt_text(body)),
                     "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        behavior.num_in_flight -= 1


def make_app(behavior: Behavior) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if behavior.api_key and request.headers.get("authorization") != f"Bearer {behavior.api_key}":
            return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": behavior.model_id, "object": "model"}]}

    async def generate(request: Request):
        body = await request.json()
        behavior.bodies.append(body)
        status = behavior.refuse(body)
        if status is not None:
            return JSONResponse({"error": {"message": "refused", "code": status}}, status_code=status)
        return StreamingResponse(_stream(body, behavior), media_type="text/event-stream")

    app.post("/v1/completions")(generate)
    app.post("/v1/chat/completions")(generate)
    return app


class FakeServer:
    """Runs the app on 127.0.0.1 (a free port) in a thread; use as a context manager."""

    def __init__(self, behavior: Behavior) -> None:
        self.behavior = behavior
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(make_app(behavior), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=START_TIMEOUT_S)
        self._socket.close()
