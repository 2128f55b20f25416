"""`RequireAllowedHost`: which `Host` a request may name.

A server on a loopback address and without API keys is reachable from a web page the user has
open: a page of another origin whose name is re-pointed at 127.0.0.1 (DNS rebinding) reads and
writes it as same-origin. Such a request names the page's host in its `Host` header, so a server
bound to loopback answers only requests naming a loopback host (`localhost`, `127.0.0.1`,
`::1`, or the address it listens on), as Jupyter does; `--allowed-hosts` names others (`*`: any).
A server on another address answers any host unless `--allowed-hosts` is given. Refusals are 400
in OpenAI's envelope, before anything else runs (health probes included: they name the host too).
"""
import ipaddress
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.openai.errors import ApiError

ANY_HOST = "*"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts(listen_host: str, configured: Collection[str]) -> frozenset[str] | None:
    """The host names a server on `listen_host` answers; None: any. `configured` (from
    `--allowed-hosts`) wins when given."""
    if configured:
        names = frozenset(_normal(name) for name in configured)
        return None if ANY_HOST in names else names
    return LOOPBACK_NAMES | {_normal(listen_host)} if _is_loopback(listen_host) else None


class RequireAllowedHost:
    """ASGI middleware: 400 for an HTTP request whose `Host` is not one of `hosts`."""

    def __init__(self, app: ASGIApp, hosts: Collection[str]) -> None:
        self._app = app
        self._hosts = frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = _host_of(scope)
            if host not in self._hosts:
                shown = "no Host header" if host is None else f"Host {host[:100]!r}"
                error = ApiError(400, f"{shown} is not served here: name the server by one of its allowed hosts "
                                      "(--allowed-hosts)")
                await error.to_response()(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _host_of(scope: Scope) -> str | None:
    """The request's `Host` header without its port, lower case; None when it has none. A value
    that is not `name[:port]` or `[v6]:port` comes back whole (and matches no allowed name)."""
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1").strip()
            if host.startswith("[") and "]" in host:
                name_part, port = host[1:host.index("]")], host[host.index("]") + 1:]
            elif host.count(":") == 1:
                name_part, port = host.split(":")
                port = ":" + port
            else:
                name_part, port = host, ""
            return _normal(name_part) if port == "" or (port[1:].isdigit() and port[0] == ":") else host
    return None


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def _is_loopback(host: str) -> bool:
    if _normal(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(_normal(host)).is_loopback
    except ValueError:
        return False
