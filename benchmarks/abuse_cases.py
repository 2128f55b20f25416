"""The abuses of `abuse.py` (issue 42, items 3, 4, 6 and 7), each a coroutine that takes a `Run`,
sets `run.engaged` once it is under way, and returns what the abusers got (status counts, the
sizes it used). Those that must find a normal stream already streaming wait on `run.streaming`;
the companion streams run until `run.stop`. Raw sockets where a client misbehaves below HTTP
(a body sent a byte at a time, an answer never read), httpx otherwise.
"""
import argparse
import asyncio
import itertools
import json
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

MAX_BODY_BYTES = 8 << 20  # the router's bound on a request body (413 above)
MAX_LOGIT_BIAS_TOKENS = 1024  # the router's bound (400 above)
STREAM_PROMPT = "The old lighthouse keeper climbed the stairs every night and wrote in his log about"
WORDS = ("river bridge lamp stair keeper night harbor stone window market garden letter winter "
         "engine signal valley forest copper mirror candle orbit thunder meadow castle").split()
SENTENCE = "The old lighthouse keeper climbed the stairs every night. "
SLOW_BODY_BYTES = 1000  # what a slow connection declares; it never sends half of it
STALLED_RCVBUF = 4096  # a stalled reader's receive buffer: its answer backs up into the router soon
JSON = {"Content-Type": "application/json"}


@dataclass
class Run:
    """One case's shared state: the abuse says when it is under way (`engaged`), the normal
    streams say when the first of them streams (`streaming`); `stop` ends a companion abuse."""

    args: argparse.Namespace
    address: tuple[str, int]  # the router's
    http: httpx.AsyncClient
    max_model_len: int
    engaged: asyncio.Event = field(default_factory=asyncio.Event)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    num_normal_answering: int = 0  # normal streams whose answer has begun (the router counts them in progress)


async def in_progress(run: Run) -> float:
    """The router's generation requests in progress (`pdserve_http_requests_in_progress`)."""
    text = (await run.http.get("/metrics")).text
    match = re.search(r"^pdserve_http_requests_in_progress (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ---- prompts ---------------------------------------------------------------------------------

async def token_ids(run: Run, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` ids of random words (the router's own tokenizer, through /tokenize)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens + 16))
    answer = await run.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    answer.raise_for_status()
    return answer.json()["tokens"][:num_tokens]


async def chars_per_token(run: Run) -> float:
    answer = await run.http.post("/tokenize", json={"prompt": SENTENCE * 64, "add_special_tokens": False})
    return len(SENTENCE * 64) / answer.json()["count"]


def filler(num_chars: int) -> str:
    return (SENTENCE * (num_chars // len(SENTENCE) + 1))[:num_chars]


def echo_tokens(run: Run, wanted: int, max_tokens: int) -> int:
    """`wanted`, or the most the model's length leaves beside `max_tokens`."""
    return min(wanted, run.max_model_len - max_tokens)


# ---- raw connections -------------------------------------------------------------------------

def request_bytes(path: str, body: bytes, declared: int | None = None) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if declared is None else declared}\r\n\r\n")
    return head.encode() + body


async def connect(run: Run, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, run.address)
    return sock


async def read_until(sock: socket.socket, deadline: float, enough: Callable[[bytes], bool]) -> tuple[bytes, str]:
    """What the socket gave until `enough(received)` ("enough"), its end ("closed"), a reset
    ("reset") or `deadline` ("timed out"), and which of those."""
    loop, received = asyncio.get_running_loop(), b""
    while not enough(received):
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return received, "timed out"
        except ConnectionError:
            return received, "reset"
        if not chunk:
            return received, "closed"
        received += chunk
    return received, "enough"


def status_of(answer: bytes) -> str:
    match = re.match(rb"HTTP/1\.1 (\d{3})", answer)
    return match.group(1).decode() if match else "no answer"


# ---- item 3: slow clients --------------------------------------------------------------------

async def slow_bodies(run: Run) -> dict:
    """Connections that send a body's first byte and then one byte every interval; each is read
    until the router answers it and closes. The normal streams begin as they are opened."""
    head = request_bytes("/v1/completions", b"{", declared=SLOW_BODY_BYTES)
    loop, sockets = asyncio.get_running_loop(), []
    run.engaged.set()
    began = time.monotonic()
    try:
        for _ in range(run.args.slow_connections):
            sockets.append(sock := await connect(run))
            await loop.sock_sendall(sock, head)
        opened = time.monotonic()
        trickle = asyncio.create_task(trickle_bytes(sockets, run.args.slow_byte_interval))
        deadline = opened + run.args.body_read_timeout + 60.0
        answers = await asyncio.gather(*(read_until(sock, deadline, lambda _: False) for sock in sockets))
        answered_s = time.monotonic() - opened
        trickle.cancel()
    finally:
        for sock in sockets:
            sock.close()
    statuses = Counter(status_of(answer) if answer else how for answer, how in answers)
    return {"requests": len(sockets), "status_counts": dict(statuses), "opened_in_s": round(opened - began, 2),
            "all_answered_after_s": round(answered_s, 2), "declared_body_bytes": SLOW_BODY_BYTES,
            "byte_interval_s": run.args.slow_byte_interval}


async def trickle_bytes(sockets: list[socket.socket], interval_s: float) -> None:
    for _ in range(SLOW_BODY_BYTES // 2):
        await asyncio.sleep(interval_s)
        for sock in sockets:
            try:
                sock.send(b" ")
            except OSError:  # answered and closed, or its buffer full
                pass


async def stalled_readers(run: Run) -> dict:
    """Streamed answers (`n` choices, 20 logprobs a token) whose clients read the status line,
    then nothing, until the router frees their places; then each is read to its end to see
    whether it was cut off."""
    args = run.args
    loop, sockets, heads = asyncio.get_running_loop(), [], []
    try:
        for i in range(args.stalled_readers):
            body = {"prompt": f"Reader {i}: {STREAM_PROMPT}", "max_tokens": args.stalled_max_tokens,
                    "n": args.stalled_choices, "logprobs": 20, "ignore_eos": True, "temperature": 0, "stream": True}
            sockets.append(sock := await connect(run, rcvbuf=STALLED_RCVBUF))
            await loop.sock_sendall(sock, request_bytes("/v1/completions", json.dumps(body).encode()))
        deadline = time.monotonic() + 600.0
        heads = [head for head, _ in await asyncio.gather(
            *(read_until(sock, deadline, lambda got: b"\r\n\r\n" in got) for sock in sockets))]
        answering = time.monotonic()
        run.engaged.set()
        freed_after_s = await places_freed(run, answering, args.send_timeout + 600.0)
        for sock in sockets:  # read the rest quickly: whether each was cut off is all that is left to see
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        ends = await asyncio.gather(*(read_until(sock, time.monotonic() + 30.0, lambda _: False) for sock in sockets))
    finally:
        for sock in sockets:
            sock.close()
    outcomes = Counter(outcome(head + rest, how) for head, (rest, how) in zip(heads, ends, strict=True))
    return {"requests": len(sockets), "status_counts": dict(Counter(map(status_of, heads))),
            "outcomes": dict(outcomes), "places_freed_after_s": freed_after_s, "choices": args.stalled_choices,
            "max_tokens": args.stalled_max_tokens, "logprobs": 20, "client_rcvbuf": STALLED_RCVBUF}


def outcome(answer: bytes, how: str) -> str:
    """A stalled reader's answer once read: whole (the buffers took all of it), or cut off."""
    if b"data: [DONE]" in answer:
        return "whole answer"
    return "still open" if how == "timed out" else f"cut off ({how})"


async def places_freed(run: Run, since: float, limit_s: float) -> float | None:
    """Seconds from `since` until the router holds no request in progress but the normal
    stream's, twice in a row half a second apart; None past `limit_s`. The normal stream is
    counted from its first byte, after the router counts it, so this never ends early."""
    num_clear = 0
    while time.monotonic() - since < limit_s:
        held = await in_progress(run) - run.num_normal_answering
        num_clear = num_clear + 1 if held <= 0 else 0
        if num_clear == 2:
            return round(time.monotonic() - since, 2)
        await asyncio.sleep(0.5)
    return None


# ---- item 4: large inputs --------------------------------------------------------------------

def tokenize_body(num_bytes: int) -> bytes:
    wrapper = b'{"prompt": "", "add_special_tokens": false}'
    text = filler(min(num_bytes, MAX_BODY_BYTES) - len(wrapper))
    return json.dumps({"prompt": text, "add_special_tokens": False}).encode()


async def tokenize(run: Run) -> dict:
    body = tokenize_body(run.args.tokenize_bytes)
    run.engaged.set()
    await run.streaming.wait()
    sent = time.monotonic()
    answer = await run.http.post("/tokenize", content=body, headers=JSON)
    count = re.match(rb'\{"count":\s*(\d+)', answer.content)
    return {"requests": 1, "status_counts": {str(answer.status_code): 1}, "body_bytes": len(body),
            "answered_after_s": round(time.monotonic() - sent, 2), "answer_bytes": len(answer.content),
            "tokens": int(count.group(1)) if count else None}


async def batch_body(run: Run) -> tuple[bytes, dict]:
    """A completion batch within the byte budget: prompts that fit the model, the last one too long."""
    args, per_token = run.args, await chars_per_token(run)
    budget = min(args.tokenize_bytes, MAX_BODY_BYTES) - 200
    last_chars = int(1.5 * run.max_model_len * per_token)
    each_chars = min(int(0.9 * run.max_model_len * per_token), (budget - last_chars) // (args.batch_prompts - 1) - 4)
    prompts = [filler(each_chars)] * (args.batch_prompts - 1) + [filler(last_chars)]
    body = json.dumps({"prompt": prompts, "max_tokens": 1}).encode()
    return body, {"prompts": len(prompts), "chars_per_prompt": each_chars, "last_prompt_chars": last_chars}


async def completion_batch(run: Run) -> dict:
    body, sizes = await batch_body(run)
    run.engaged.set()
    await run.streaming.wait()
    sent = time.monotonic()
    answer = await run.http.post("/v1/completions", content=body, headers=JSON)
    param = answer.json().get("error", {}).get("param") if answer.status_code != 200 else None
    return {"requests": 1, "status_counts": {str(answer.status_code): 1}, "body_bytes": len(body), **sizes,
            "answered_after_s": round(time.monotonic() - sent, 2), "error_param": param}


# ---- item 6: large answers -------------------------------------------------------------------

async def echo_logprobs(run: Run) -> dict:
    args = run.args
    num_prompt = echo_tokens(run, args.echo_tokens, 1)
    bodies = [{"prompt": await token_ids(run, num_prompt, 2000 + i), "max_tokens": 1, "echo": True, "logprobs": 20,
               "temperature": 0} for i in range(args.echo_requests)]
    run.engaged.set()
    await run.streaming.wait()
    sent = time.monotonic()
    answers = await asyncio.gather(*(run.http.post("/v1/completions", json=body) for body in bodies))
    usage = [re.search(rb'"prompt_tokens":\s*(\d+)', a.content) for a in answers]
    return {"requests": len(bodies), "status_counts": dict(Counter(str(a.status_code) for a in answers)),
            "prompt_tokens": num_prompt, "logprobs": 20, "answer_bytes": [len(a.content) for a in answers],
            "prompt_tokens_answered": [int(u.group(1)) if u else None for u in usage],
            "answered_after_s": round(time.monotonic() - sent, 2)}


# ---- item 7: one request slowing every step --------------------------------------------------

def json_schema(number: int) -> dict:
    """An object schema whose property names no other number shares (so a guide compiled anew)."""
    properties = {f"f{number}_{kind}": {"type": kind} for kind in ("string", "integer", "boolean", "number")}
    properties[f"f{number}_choice"] = {"enum": [f"v{number}_{i}" for i in range(4)]}
    properties[f"f{number}_list"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def plain_body(run: Run, number: int) -> dict:
    return {"prompt": f"Companion {number}: {STREAM_PROMPT}", "max_tokens": run.args.stream_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}


def biased_body(run: Run, number: int) -> dict:
    bias = {str(100 + i): 0.5 for i in range(run.args.logit_bias_entries)}
    return {**plain_body(run, number), "logit_bias": bias}


def guided_body(run: Run, number: int) -> dict:
    return {"prompt": f"Record {number} as JSON:", "max_tokens": run.args.guided_max_tokens, "temperature": 0,
            "stream": True, "guided_json": json_schema(number)}


async def companion(run: Run, body: dict, answering: asyncio.Event) -> str:
    """One companion stream read to its end; its status."""
    try:
        async with run.http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                answering.set()
                if line.startswith('data: {"error"'):
                    return "error event"
            return str(response.status_code)
    finally:
        answering.set()


async def companions(run: Run, body_of: Callable[[Run, int], dict]) -> dict:
    """`--companions` loops, each sending a stream after the other, until `run.stop`."""
    statuses: Counter[str] = Counter()  # of the streams read to their end
    answering = [asyncio.Event() for _ in range(run.args.companions)]
    numbers = itertools.count()

    async def loop(i: int) -> None:
        while True:
            statuses[await companion(run, body_of(run, next(numbers)), answering[i])] += 1

    tasks = [asyncio.create_task(loop(i)) for i in range(run.args.companions)]
    try:
        await asyncio.gather(*(event.wait() for event in answering))
        run.engaged.set()
        await run.stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"requests": next(numbers), "status_counts": dict(statuses), "concurrent": run.args.companions}


async def plain_companions(run: Run) -> dict:
    return await companions(run, plain_body)


async def logit_bias(run: Run) -> dict:
    num_over = max(run.args.logit_bias_entries, MAX_LOGIT_BIAS_TOKENS) + 1
    over = {**plain_body(run, 0), "stream": False, "logit_bias": {str(100 + i): 0.5 for i in range(num_over)}}
    over_cap = await run.http.post("/v1/completions", json=over)
    found = await companions(run, biased_body)
    return {**found, "entries": run.args.logit_bias_entries,
            "over_cap": {"entries": len(over["logit_bias"]), "status": over_cap.status_code}}


async def guided_schemas(run: Run) -> dict:
    found = await companions(run, guided_body)
    return {**found, "distinct_schemas": found["requests"], "max_tokens": run.args.guided_max_tokens}
