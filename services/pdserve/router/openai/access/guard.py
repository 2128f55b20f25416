"""`RequireApiKey`: who may call `/v1/*`, and which tenant each caller is.

With keys configured, a request to any path under `/v1/` (and to the others the app names:
`/tokenize`, `/detokenize`, and `/metrics` when protected) must send `Authorization: Bearer <key>`; without a key, or with a wrong one, it is answered 401
in OpenAI's envelope with `WWW-Authenticate: Bearer`, before anything else runs. `/health*`
and `/metrics` stay open by default: orchestrators and Prometheus probe them without keys.
"""
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.common.api_keys import ApiKeys
from pdserve.router.openai.access.tenants import Tenant
from pdserve.router.openai.errors import ApiError

TENANT_SCOPE_KEY = "pdserve.tenant"  # where an authenticated request's tenant is kept in its ASGI scope
ADMIN_SCOPE_KEY = "pdserve.admin"  # whether its key is an admin key
_API_PREFIX = "/v1/"
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


class RequireApiKey:
    """ASGI middleware: 401 for a protected path without a valid key; else the request goes on
    with its tenant in `scope[TENANT_SCOPE_KEY]`. Paths under `/v1/` are protected, and `also`."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, also: Collection[str] = ()) -> None:
        self._app = app
        self._keys = keys
        self._also = frozenset(also)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._is_protected(scope["path"]):
            await self._app(scope, receive, send)
            return
        presented = _bearer_token(scope)
        caller = self._keys.caller_of(presented) if presented is not None else None
        if caller is None:
            message = "invalid API key" if presented is not None else \
                "missing API key: send 'Authorization: Bearer <key>'"
            await ApiError(401, message).to_response(headers=_CHALLENGE)(scope, receive, send)
            return
        scope[TENANT_SCOPE_KEY], scope[ADMIN_SCOPE_KEY] = caller
        await self._app(scope, receive, send)

    def _is_protected(self, path: str) -> bool:
        return path.startswith(_API_PREFIX) or path == _API_PREFIX.rstrip("/") or path in self._also


def _bearer_token(scope: Scope) -> str | None:
    """The credentials of the request's `Authorization: Bearer` header, or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").strip().partition(" ")
            return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None
    return None


def tenant_of(scope: Scope) -> Tenant | None:
    """The tenant `RequireApiKey` authenticated the request as; None when no keys are configured."""
    return scope.get(TENANT_SCOPE_KEY)


def is_admin(scope: Scope) -> bool:
    """Whether the caller may change what is served: an admin key, or anyone when no keys are
    configured (`RequireApiKey` then never runs)."""
    return scope.get(ADMIN_SCOPE_KEY, TENANT_SCOPE_KEY not in scope)
