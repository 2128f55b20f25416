"""The OpenAPI description (`/openapi.json`) of request bodies the routes read themselves.

The generation routes take the raw `Request` (`body.py` reads it within a size bound and answers
400, never 422), so FastAPI cannot see their models. `request_body(model)` names a model as an
operation's JSON body; `describe_request_bodies` puts each model's JSON schema, and the models it
refers to, under `components/schemas`, so the document states every field, type and bound
(schemathesis generates requests from it: `tests/fuzz/`).
"""
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF_TEMPLATE = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` when its JSON body is `model`."""
    schema = {"$ref": _REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def describe_request_bodies(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Make `app`'s OpenAPI document define `models` (the ones `request_body` names)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI builds the document once and keeps it there
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=_REF_TEMPLATE)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend it
