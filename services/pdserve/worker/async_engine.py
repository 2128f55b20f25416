"""`ThreadedEngine`: the `AsyncEngine` a worker serves, driving `LLMEngine` from its own thread.

The step loop runs in one dedicated thread (torch releases the GIL in its kernels, so the
gRPC event loop stays responsive). Requests and aborts reach it through an inbox; outputs go
back to each request's asyncio queue with `call_soon_threadsafe`. The loop also wakes when idle
(`idle_wait_s`), so periodic duties run every step even when no work arrives.
"""
import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from pdserve.common.errors import WorkerTimeoutError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, ModelInfo
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.kvcache import IntegrityError, KvEvent

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    num_completions: int
    num_finished: int = 0


class ThreadedEngine:
    """Implements `worker.engine_api.AsyncEngine` over a synchronous `LLMEngine`."""

    def __init__(self, engine: LLMEngine, info: ModelInfo, idle_wait_s: float = 0.02,
                 admit_timeout_s: float = 60.0) -> None:
        self._engine = engine
        self._info = info
        self._idle_wait_s = idle_wait_s
        self._admit_timeout_s = admit_timeout_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[RequestId, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = self._snapshot()
        self._kv_event_listeners: list[Callable[[list[KvEvent]], None]] = []
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def add_kv_event_listener(self, listener: Callable[[list[KvEvent]], None]) -> None:
        """Call `listener(events)` on the engine thread after each loop iteration that produced
        KV cache events (numbered; a listener added late sees a gap and should resync from
        `kv.cached_block_hashes()` via `call`). The listener must not block."""
        self._kv_event_listeners.append(listener)

    def info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_only: bool = False, hold_lease_s: float = 30.0) -> AsyncIterator[RequestOutput]:
        """Admit and stream the request. `prefill_worker` is ignored here (aggregated serving);
        `prefill_only` stops after the first token and holds the blocks (see LLMEngine)."""
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        stream = _Stream(loop, asyncio.Queue(), request.sampling.n)
        self._send(("add", request, stream, admitted, prefill_only, hold_lease_s))
        try:
            await asyncio.wait_for(admitted, self._admit_timeout_s)
        except asyncio.TimeoutError:
            await self.abort(request.request_id)
            raise WorkerTimeoutError(f"request {request.request_id!r} not admitted within {self._admit_timeout_s}s")
        finished: set[int] = set()
        try:
            while len(finished) < request.sampling.n:
                output = await stream.outputs.get()
                if output.is_finished:
                    finished.add(output.index)
                yield output
        finally:
            if len(finished) < request.sampling.n:
                await self.abort(request.request_id)

    async def abort(self, request_id: RequestId) -> None:
        self._send(("abort", request_id))

    async def call(self, fn: Callable[..., T], *args, timeout_s: float | None = None) -> T:
        """Run `fn(*args)` on the engine thread between steps; its result or exception comes back here.

        RequestOutputs it returns as a list are also delivered to their streams.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(("call", fn, args, loop, done))
        return await asyncio.wait_for(done, timeout_s or self._admit_timeout_s)

    async def check_integrity(self) -> KvIntegrity:
        return await self.call(self._check_integrity)

    def _check_integrity(self) -> KvIntegrity:
        kv = self._engine.kv
        held = self._engine.num_handoffs + self._engine.num_quarantined  # waiting on a transfer's outcome
        try:
            kv.check_integrity()
        except IntegrityError as exc:
            return KvIntegrity(False, str(exc), held, kv.num_used_blocks)
        return KvIntegrity(True, "", held, kv.num_used_blocks)

    def open_stream(self, request_id: RequestId, num_completions: int = 1) -> asyncio.Queue:
        """A queue receiving the request's outputs (for requests admitted through `call`)."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), num_completions)
        self._send(("stream", request_id, stream))
        return stream.outputs

    # ---- the engine thread -------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self._engine.has_work:
                self._step()
            self._deliver(self._engine.reap_expired_leases())
            self._publish_kv_events()
            self._stats = self._snapshot()  # before idling, so load reports are never a turn stale
            if not self._engine.has_work:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                self._run_call(*command[1:])
            elif command[0] == "stream":
                self._streams[command[1]] = command[2]
            else:
                self._deliver(self._engine.abort(command[1]))
                self._streams.pop(command[1], None)

    def _add(self, request: GenerationRequest, stream: _Stream, admitted: asyncio.Future,
             prefill_only: bool, hold_lease_s: float) -> None:
        try:
            self._engine.add_request(request, prefill_only, hold_lease_s)
        except Exception as exc:  # a typed error for the caller, raised in its own loop
            stream.loop.call_soon_threadsafe(_set_exception, admitted, exc)
            return
        self._streams[request.request_id] = stream
        stream.loop.call_soon_threadsafe(_set_result, admitted)

    def _run_call(self, fn: Callable, args: tuple, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            result = fn(*args)
        except Exception as exc:
            loop.call_soon_threadsafe(_set_exception, done, exc)
            return
        if isinstance(result, list) and all(isinstance(r, RequestOutput) for r in result):
            self._deliver(result)
        loop.call_soon_threadsafe(_set_value, done, result)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:  # a failed step fails its requests, never the worker
            log.exception("engine step failed")
            outputs = self._fail_all(f"engine step failed: {exc}")
        self._deliver(outputs)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = []
        for request_id in list(self._streams):
            for out in self._engine.abort(request_id):
                failed.append(RequestOutput(out.request_id, out.index, (), "", (), "error",
                                            out.num_prompt_tokens, out.num_cached_tokens, message))
        return failed

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)
            stream.num_finished += output.is_finished
            if stream.num_finished >= stream.num_completions:
                del self._streams[output.request_id]

    def _publish_kv_events(self) -> None:
        events = self._engine.kv.drain_events()
        if events:
            for listener in self._kv_event_listeners:
                listener(events)

    def _snapshot(self) -> EngineStats:
        kv = self._engine.kv
        scheduler = self._engine.scheduler
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks, num_used_blocks=kv.num_used_blocks,
            num_prefill_tokens_queued=scheduler.num_prefill_tokens_queued,
            prefix_cache_queried_tokens=kv.num_query_tokens, prefix_cache_hit_tokens=kv.num_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
        )


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_value(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
