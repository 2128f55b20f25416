"""The router's FastAPI app: OpenAI-compatible routes over one `GenerateBackend`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (every served
name, and the LoRA adapters, each with its `parent`), `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (`lora_routes.py`), vLLM's `POST /tokenize`, `POST /detokenize` and
`GET /version` (`tokenization.py`), `GET /metrics`, `GET /openapi.json` (request bodies described
from their models, `openapi.py`), and
health: `GET /health/live` (liveness: 200 while the router answers HTTP), `GET /health/ready`
(readiness: 200 while a decode-capable worker is in rotation, else 503 naming why) and `GET /health`
(as readiness, vLLM's name). With API keys, every `/v1/` route (and `/metrics` when
`protect_metrics`) answers 401 to a request without a valid key, and a request's tenant salts
its KV cache (`access/`). At most `limits.max_pending_requests` generation requests are in
progress at once; one more gets 503 with `Retry-After` at once (`admission.py`). Every response carries `X-Request-Id` (the client's, else the response id);
every error is OpenAI's envelope (see `errors.py`). Behind a routing backend, a generation
response also carries `X-Pdserve-Route` (each prompt's decision, comma-separated, in prompt
order) and the routing backend's session header, if configured, pins a session to its workers.
"""
import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common.errors import PdserveError
from pdserve.common.ids import RequestId
from pdserve.common.stats import EngineStats, ModelInfo
from pdserve.router.backend import GenerateBackend, LoraAdapters, Routing
from pdserve.router.openai.admission import PendingLimit
from pdserve.router.openai.access.guard import RequireApiKey, is_admin, tenant_of
from pdserve.router.openai.access.hosts import RequireAllowedHost
from pdserve.common.api_keys import ApiKeys
from pdserve.router.openai.chat import create_chat_completion
from pdserve.router.openai.completions import create_completion
from pdserve.router.openai.errors import ApiError, from_exception, install_error_handlers
from pdserve.router.openai.logprobs import LogprobFormatter
from pdserve.router.openai.lora_routes import LOAD_PATH, UNLOAD_PATH, add_lora_routes
from pdserve.router.openai.metrics import RouterMetrics
from pdserve.router.openai.openapi import describe_request_bodies, request_body
from pdserve.router.openai.prompts import PromptTokenizer
from pdserve.router.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                            LoadLoraAdapterRequest, TokenizeRequest, UnloadLoraAdapterRequest)
from pdserve.router.openai.responses import ModelCard, ModelList
from pdserve.router.openai.serving import ApiLimits, ClientGone, ServingContext, new_response_id
from pdserve.router.openai.structured.tools import ToolCallConfig
from pdserve.router.openai.tokenization import detokenize, pdserve_version, tokenize

STATS_TIMEOUT_S = 5.0
MAX_REQUEST_ID_CHARS = 256
ROUTE_HEADER = "X-Pdserve-Route"
_STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, metrics count it
_GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
_TOKENIZER_ROUTES = frozenset({"/tokenize", "/detokenize"})
_ROUTES = _GENERATION_ROUTES | _TOKENIZER_ROUTES | {"/v1/models", "/version", "/health", "/health/live",
                                                   "/health/ready", "/metrics", LOAD_PATH, UNLOAD_PATH}
_log = logging.getLogger(__name__)
Handler = Callable[[Request, ServingContext, str], Awaitable[Response]]


def create_app(
    backend: GenerateBackend,
    tokenizer: PromptTokenizer,
    info: ModelInfo,
    model_names: Sequence[str] = (),
    limits: ApiLimits = ApiLimits(),
    routing: Routing | None = None,
    api_keys: ApiKeys | None = None,
    protect_metrics: bool = False,
    sampling_defaults: Mapping[str, float | int] | None = None,
    tool_calls: ToolCallConfig = ToolCallConfig(),
    loras: LoraAdapters | None = None,
    runtime_lora_updating: bool = False,
    allowed_hosts: Collection[str] | None = None,
) -> FastAPI:
    """An app serving `info`'s model (under `model_names` if given, the first reported in responses);
    it closes `backend` on shutdown.
    `routing`: the backend's routing side, when it chooses among workers (usually `backend` itself).
    `api_keys`: who may call `/v1/`, `/tokenize` and `/detokenize` (None: anyone); `protect_metrics`:
    `/metrics` too.
    `sampling_defaults`: the model's, for fields a request leaves unset (`sampling.checked_defaults`).
    `tool_calls`: whether `tool_choice: "auto"` is served, and how tool calls are read back.
    `loras`: the LoRA adapters served (None: none; loads answer 400); `runtime_lora_updating`:
    serve the routes that load and unload them (else they do not exist, as in vLLM).
    `allowed_hosts`: the `Host` names a request may give (None: any; `access/hosts.py`)."""
    ctx = ServingContext(backend, tokenizer, info, tuple(model_names) or (info.model_name,), limits,
                         RouterMetrics(), LogprobFormatter(tokenizer), tool_calls=tool_calls,
                         sampling_defaults=MappingProxyType(dict(sampling_defaults or {})), loras=loras)
    if routing is not None:
        ctx.metrics.registry.register(routing.metrics_collector())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    install_error_handlers(app)
    app.add_middleware(PendingLimit, max_pending=limits.max_pending_requests, paths=_GENERATION_ROUTES,
                       in_progress=ctx.metrics.in_progress, max_body_bytes=limits.max_body_bytes,
                       body_timeout_s=limits.body_timeout_s, send_timeout_s=limits.send_timeout_s)
    if api_keys is not None:  # outside the pending limit: a refused caller never takes a slot
        also = _TOKENIZER_ROUTES | ({"/metrics"} if protect_metrics else set())
        app.add_middleware(RequireApiKey, keys=api_keys, also=also)
    app.add_middleware(_CountRequests, metrics=ctx.metrics)  # refusals are counted too
    if allowed_hosts is not None:  # the outermost: a request from a rebound name reaches nothing
        app.add_middleware(RequireAllowedHost, hosts=allowed_hosts)
    _add_generation_routes(app, ctx, routing)
    _add_tokenizer_routes(app, ctx)
    _add_status_routes(app, ctx)
    if runtime_lora_updating:
        add_lora_routes(app, loras)
    describe_request_bodies(app, (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                                  LoadLoraAdapterRequest, UnloadLoraAdapterRequest))
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext, routing: Routing | None) -> None:
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _answer(request, ctx, routing, create_completion, "cmpl")

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, ctx, routing, create_chat_completion, "chatcmpl")


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> Response:
        return await _answer_plain(request, ctx, tokenize)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        return await _answer_plain(request, ctx, detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pdserve_version()})


def _add_status_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        cards = [ModelCard(id=name, max_model_len=ctx.info.max_model_len) for name in ctx.model_names]
        adapters = ctx.loras.lora_adapters() if ctx.loras is not None else ()
        shows_folders = is_admin(request.scope)  # an adapter's folder is the operator's business
        cards += [ModelCard(id=a.name, root=a.path if shows_folders else a.name, parent=ctx.model_name,
                            max_model_len=ctx.info.max_model_len) for a in adapters]
        return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/health/ready")
    async def ready() -> Response:
        return await _readiness(ctx)

    @app.get("/health")
    async def health() -> Response:
        return await _readiness(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _answer(request: Request, ctx: ServingContext, routing: Routing | None, handler: Handler,
                  id_prefix: str) -> Response:
    """Run a generation handler; any failure becomes the envelope, with `X-Request-Id` set
    (and `X-Pdserve-Route` once routed)."""
    response_id = new_response_id(id_prefix)
    request_id = request.headers.get("x-request-id") or response_id
    try:
        if not _is_header_value_ok(request_id):
            request_id = response_id
            raise ApiError(400, f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} printable characters",
                           "X-Request-Id")
        caller_ctx = dataclasses.replace(_for_session(request, ctx, routing), tenant=tenant_of(request.scope))
        response = await handler(request, caller_ctx, response_id)
    except ClientGone:
        response = Response(status_code=_STATUS_CLIENT_CLOSED)
    except Exception as exc:  # every failure answers with the envelope, never a bare 500
        error = from_exception(exc)
        if error.status >= 500:
            _log.warning("%s failed: %s (%s)", response_id, error.message, type(exc).__name__)
        response = error.to_response()
    response.headers["X-Request-Id"] = request_id
    if routing is not None and (route := _describe_routes(routing, response_id)):
        response.headers[ROUTE_HEADER] = route
    return response


async def _answer_plain(request: Request, ctx: ServingContext,
                        handler: Callable[[Request, ServingContext], Awaitable[Response]]) -> Response:
    """Run a route that calls no worker; any failure becomes the envelope."""
    try:
        return await handler(request, ctx)
    except Exception as exc:  # every failure answers with the envelope, never a bare 500
        return from_exception(exc).to_response()


def _is_header_value_ok(value: str) -> bool:
    return len(value) <= MAX_REQUEST_ID_CHARS and value.isprintable()


def _for_session(request: Request, ctx: ServingContext, routing: Routing | None) -> ServingContext:
    """`ctx` with its backend bound to the request's session, when routing has sessions."""
    header = routing.session_header if routing is not None else None
    session_id = request.headers.get(header) if header else None
    if routing is None or header is None or not session_id:
        return ctx
    if not _is_header_value_ok(session_id):
        raise ApiError(400, f"{header} must be at most {MAX_REQUEST_ID_CHARS} printable characters", header)
    return dataclasses.replace(ctx, backend=routing.for_session(session_id))


def _describe_routes(routing: Routing, response_id: str) -> str:
    """Each prompt's routing decision, in prompt order (`generation_requests` numbers them)."""
    routes = []
    while (route := routing.describe_route(RequestId(f"{response_id}-{len(routes)}"))) is not None:
        routes.append(route)
    return ", ".join(routes)


async def _readiness(ctx: ServingContext) -> Response:
    """200 when the backend can take requests (a decode-capable worker in rotation); else 503 naming why."""
    try:
        await asyncio.wait_for(ctx.backend.stats(), STATS_TIMEOUT_S)
    except PdserveError as exc:  # e.g. every decode worker down, each with its reason
        return ApiError(503, f"not ready: {exc}").to_response()
    except Exception as exc:
        return ApiError(503, f"not ready: the generation service is not answering ({type(exc).__name__})").to_response()
    return Response(status_code=200)


class _CountRequests:
    """Counts every response by route (unknown paths as "other") and status code."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _ROUTES else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._metrics.count_request(route, message["status"])
            await send(message)

        await self._app(scope, receive, counting_send)
