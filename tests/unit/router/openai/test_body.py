"""read_body's size bound, on a real Starlette request fed chunk by chunk."""
import asyncio

import pytest
from starlette.requests import Request

from pdserve.router.openai.body import read_body
from pdserve.router.openai.errors import ApiError


def request(chunks: list[bytes], content_length: int | None) -> tuple[Request, list[int]]:
    """A request whose body arrives in `chunks`; the list counts the chunks read."""
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    pending = list(chunks)
    read: list[int] = []

    async def receive() -> dict[str, object]:
        chunk = pending.pop(0)
        read.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}
    return Request(scope, receive), read


def test_body_within_the_bound_is_returned_whole() -> None:
    req, _ = request([b'{"a":', b" 1}"], None)
    assert asyncio.run(read_body(req, max_bytes=9)) == b'{"a": 1}'


def test_declared_length_over_the_bound_is_refused_unread() -> None:
    req, read = request([b"x" * 20], 20)
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body(req, max_bytes=10))
    assert (caught.value.status, caught.value.message, read) == (413, "request body exceeds 10 bytes", [])


def test_chunked_body_is_refused_once_it_passes_the_bound() -> None:
    req, read = request([b"x" * 6, b"x" * 6, b"x" * 6], None)
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body(req, max_bytes=10))
    assert (caught.value.status, read) == (413, [6, 6])
