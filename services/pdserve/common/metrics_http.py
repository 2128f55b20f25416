"""A process's Prometheus registry served over HTTP in the classic text format only.

vLLM's model-server series are named `vllm:...`. prometheus_client (0.26) answers a scraper
that prefers OpenMetrics, as Prometheus does, with those names escaped to `vllm_...`, so
dashboards and schedulers asking for `vllm:num_requests_waiting` would find nothing. The
classic text format (version 0.0.4), which every Prometheus reads, keeps the names as they are.
"""
import json
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pdserve.common.api_keys import ApiKeys

TEXT_FORMAT = "text/plain; version=0.0.4"
_UNAUTHORIZED = json.dumps({"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      "type": "AuthenticationError", "param": None, "code": 401}}).encode()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int, keys: ApiKeys | None = None) -> int:
    """Serve `registry` on `host:port` (0: any free port) from a daemon thread; the bound port.
    With `keys` (`--protect-metrics`), a scrape without one of them is answered 401, as the
    router's own /metrics is (Prometheus sends it with `authorization: {credentials: ...}`)."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        if keys is not None and not _has_key(environ, keys):
            start_response("401 Unauthorized", [("Content-Type", "application/json"),
                                                ("WWW-Authenticate", "Bearer")])
            return [_UNAUTHORIZED]
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    server = make_server(host, port, text_only, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port


def _has_key(environ: dict, keys: ApiKeys) -> bool:
    scheme, _, credentials = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
    return scheme.lower() == "bearer" and bool(credentials.strip()) and keys.caller_of(credentials.strip()) is not None
