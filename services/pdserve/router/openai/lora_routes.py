"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, shaped as vLLM's.

Served only when runtime updates are allowed (`--allow-runtime-lora-updating` or vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`); otherwise, as in vLLM, the paths do not exist (404). With
API keys configured only an admin key may call them (403 otherwise). Bodies
`{"lora_name": ..., "lora_path": ...}` and `{"lora_name": ...}`; success is a plain-text 200 as
vLLM answers it; a taken name, a folder outside the workers' `--lora-dir` folders or holding no
adapter of this model, or workers started without `--enable-lora` answer 400, an unknown name on
unload 404 (OpenAI's envelope). The backend loads the adapter on every worker (the router's
`routing/lora_catalog.py`).
"""
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pdserve.router.backend import LoraAdapters
from pdserve.router.openai.access.guard import is_admin
from pdserve.router.openai.body import parse_body, read_body
from pdserve.router.openai.errors import ApiError, bad_request, from_exception
from pdserve.router.openai.openapi import request_body
from pdserve.router.openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MAX_BODY_BYTES = 64 * 1024


def add_lora_routes(app: FastAPI, loras: LoraAdapters | None) -> None:
    """The two routes; without `loras` (a backend that serves no adapters) both answer 400."""

    @app.post(LOAD_PATH, openapi_extra=request_body(LoadLoraAdapterRequest))
    async def load(request: Request) -> Response:
        try:
            _check_admin(request)
            body = parse_body(await read_body(request, MAX_BODY_BYTES), LoadLoraAdapterRequest)
            await _served(loras).load_lora_adapter(body.lora_name, body.lora_path)
        except Exception as exc:  # every failure answers with the envelope
            return from_exception(exc).to_response()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(UNLOAD_PATH, openapi_extra=request_body(UnloadLoraAdapterRequest))
    async def unload(request: Request) -> Response:
        try:
            _check_admin(request)
            body = parse_body(await read_body(request, MAX_BODY_BYTES), UnloadLoraAdapterRequest)
            await _served(loras).unload_lora_adapter(body.lora_name)
        except Exception as exc:
            return from_exception(exc).to_response()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_admin(request: Request) -> None:
    if not is_admin(request.scope):
        raise ApiError(403, "only an admin API key may load or unload LoRA adapters")


def _served(loras: LoraAdapters | None) -> LoraAdapters:
    if loras is None:
        raise bad_request("this server serves no LoRA adapters", "lora_name")
    return loras
