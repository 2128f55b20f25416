"""A process's Prometheus registry served over HTTP in the classic text format only.

vLLM's model-server series are named `vllm:...`. prometheus_client (0.26) answers a scraper
that prefers OpenMetrics, as Prometheus does, with those names escaped to `vllm_...`, so
dashboards and schedulers asking for `vllm:num_requests_waiting` would find nothing. The
classic text format (version 0.0.4), which every Prometheus reads, keeps the names as they are.
"""
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` on `host:port` (0: any free port) from a daemon thread; the bound port."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    server = make_server(host, port, text_only, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port
