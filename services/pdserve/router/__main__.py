"""`pdserve router`: wire settings, tokenizer, the worker's gRPC client and the HTTP app together.

Exit status: 0 after a clean stop (SIGINT/SIGTERM), 2 for a bad setting, 1 when the worker
cannot be reached within `--worker-wait-timeout`.
"""
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

import uvicorn

from pdserve.common.errors import ConfigError, WorkerUnavailableError
from pdserve.common.settings import RouterSettings, resolve_router_settings
from pdserve.common.stats import ModelInfo
from pdserve.common.tokenizer import Tokenizer, load_tokenizer
from pdserve.router.app import create_app
from pdserve.router.grpc_backend import GrpcBackend
from pdserve.router.serving import ApiLimits

_RETRY_S = 0.5
_log = logging.getLogger("pdserve.router")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = resolve_router_settings(argv)
        if len(settings.workers) != 1:
            raise ConfigError("workers", ",".join(settings.workers), "the router serves exactly one worker")
        tokenizer = load_tokenizer(settings.model, settings.cache_dir)
    except ConfigError as err:
        print(f"pdserve router: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        asyncio.run(_serve(settings, tokenizer))
    except (WorkerUnavailableError, TimeoutError) as err:
        print(f"pdserve router: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT or SIGTERM; uvicorn re-raises the signal after its graceful stop
        return 0
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops the router the way SIGINT does."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


async def _serve(settings: RouterSettings, tokenizer: Tokenizer) -> None:
    """Serve HTTP until a signal stops uvicorn; the app's shutdown closes the backend."""
    backend = GrpcBackend(
        settings.workers[0], rpc_timeout_s=settings.rpc_timeout_s, generate_timeout_s=settings.generate_timeout_s
    )
    try:
        info = await _wait_for_worker(backend, settings.worker_wait_timeout_s)
    except BaseException:
        await backend.close()
        raise
    limits = ApiLimits(first_output_timeout_s=settings.first_output_timeout_s, output_timeout_s=settings.output_timeout_s)
    app = create_app(backend, tokenizer, info, settings.served_model_name, limits)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", timeout_graceful_shutdown=5)
    _log.info("serving %s from worker %s on http://%s:%d", settings.served_model_name or info.model_name,
              settings.workers[0], settings.host, settings.port)
    await uvicorn.Server(config).serve()


async def _wait_for_worker(backend: GrpcBackend, timeout_s: float) -> ModelInfo:
    """The worker's `ModelInfo`, retrying while it is unreachable, for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await backend.info()
        except WorkerUnavailableError:
            if time.monotonic() + _RETRY_S > deadline:
                raise
            await asyncio.sleep(_RETRY_S)


if __name__ == "__main__":
    sys.exit(main())
