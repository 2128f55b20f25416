"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize` and `GET /version`.

`/tokenize` takes a completion prompt (`prompt`, special tokens added by default) or a chat
(`messages`, rendered with the model's template; its special tokens are in the template, so
none are added by default), exactly as the generation routes would tokenize it, and answers
`{count, max_model_len, tokens}` (plus `token_strs` when asked). `/detokenize` turns
`tokens` back into `{prompt}`. Both check `model` as the generation routes do; bad input is
a 400 in OpenAI's envelope. With API keys configured both need a key, as `/v1/` does; a large
body is tokenized on a worker thread (`prompts.off_loop`).
"""
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.router.openai.body import parse_body, read_body
from pdserve.router.openai.prompts import off_loop, render_chat
from pdserve.router.openai.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.router.openai.sampling import check_token_ids
from pdserve.router.openai.serving import ServingContext


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


async def tokenize(request: Request, ctx: ServingContext) -> Response:
    raw = await read_body(request, ctx.limits.max_body_bytes)
    body = parse_body(raw, TokenizeRequest)
    ctx.check_model(body.model)
    token_ids = await off_loop(len(raw), _token_ids, body, ctx)
    answer: dict[str, object] = {
        "count": len(token_ids), "max_model_len": ctx.info.max_model_len, "tokens": token_ids,
    }
    if body.return_token_strs:
        answer["token_strs"] = [ctx.tokenizer.id_to_token(token_id) for token_id in token_ids]
    return JSONResponse(answer)


def _token_ids(body: TokenizeRequest, ctx: ServingContext) -> list[int]:
    if body.messages is not None:
        text = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt)
        return ctx.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return ctx.tokenizer.encode(body.prompt or "", add_special_tokens=add_special)


async def detokenize(request: Request, ctx: ServingContext) -> Response:
    raw = await read_body(request, ctx.limits.max_body_bytes)
    body = parse_body(raw, DetokenizeRequest)
    ctx.check_model(body.model)
    check_token_ids(body.tokens, ctx.info.vocab_size, "tokens")
    text = await off_loop(len(raw), ctx.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})
