"""`ThreadedEngine`: the `AsyncEngine` a worker serves, driving `LLMEngine` from its own thread.

The step loop runs in one thread (torch releases the GIL in its kernels, so the event loop
stays responsive). Requests, aborts and queries reach it through one inbox of typed commands,
taken in order between steps (`engine_inbox.py`); outputs go back to each request's asyncio
queue with `call_soon_threadsafe`. It also wakes when idle (`idle_wait_s`) for its periodic
duties. Before each step it sizes its torch threads by the cores its idle peers leave
(`core_share.py`); while it waits for a core it takes queries and aborts, up to the first admission.

A worker builds its engine on the loop's own thread (`built_on_loop_thread`): OpenMP keeps a
thread pool per thread that opens parallel regions, and with two (weights loaded on the asyncio
thread, steps run here) libgomp counts more threads than cores and all but stops spinning at its
barriers: each of a step's ~250 parallel regions waits for a woken thread (batch-1 step: 1.6x).
"""
import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from pdserve.common.engine_api import OUTPUT_SINK
from pdserve.common.errors import WorkerTimeoutError
from pdserve.common.ids import BlockHash, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, KvIntegrity, LoraAdapterInfo, ModelInfo
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.request_stats import StepStats
from pdserve.worker.cpu.core_share import CoreShare, FixedThreads
from pdserve.engine.loading.lora_files import LoraCheckpoint
from pdserve.worker.engine_inbox import Abort, Admit, AdmitForDecode, Command, DecodeVerdict, Inbox, Op, Query, Stream
from pdserve.worker.engine_ops import operations
from pdserve.worker.engine_views import QueueView, engine_stats, queue_view
from pdserve.kvcache import KvEvent, Tier

log = logging.getLogger(__name__)


class ThreadedEngine:
    """Implements `worker.engine_api.AsyncEngine` over a synchronous `LLMEngine`."""

    def __init__(self, engine: LLMEngine, info: ModelInfo, idle_wait_s: float = 0.02,
                 admit_timeout_s: float = 60.0, cores: CoreShare | FixedThreads | None = None,
                 _on_thread: threading.Thread | None = None) -> None:
        self._engine = engine
        self._cores = cores or FixedThreads()
        self._info = info
        self._idle_wait_s = idle_wait_s
        self._admit_timeout_s = admit_timeout_s
        self._inbox = Inbox()
        self._streams: dict[RequestId, Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = engine_stats(engine)
        self._queues = QueueView()
        self._kv_event_listeners: list[Callable[[list[KvEvent]], None]] = []
        self._step_stats_listeners: list[Callable[[StepStats], None]] = []
        self._go = threading.Event()  # start() on an engine built on its loop thread
        self._thread = _on_thread or threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._operations = operations(engine)

    @classmethod
    def built_on_loop_thread(cls, build: Callable[[], tuple[LLMEngine, ModelInfo]], **options) -> "ThreadedEngine":
        """`build()` runs on a new thread, which then runs the steps once `start` is called; returns
        when it is built, raising what `build` raised. Every torch thread pool of the engine
        belongs to that one thread (see the module's docstring). `options`: the constructor's."""
        built: concurrent.futures.Future = concurrent.futures.Future()

        def body() -> None:
            try:
                threaded = cls(*build(), **options, _on_thread=threading.current_thread())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                built.set_exception(exc)
                return
            built.set_result(threaded)
            threaded._go.wait()
            threaded._run()

        threading.Thread(target=body, name="engine-loop", daemon=True).start()
        return built.result()

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def start(self) -> None:
        if self._thread.is_alive():
            self._go.set()
        else:
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._go.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def add_kv_event_listener(self, listener: Callable[[list[KvEvent]], None]) -> None:
        """Call `listener(events)` on the engine thread after each loop iteration that produced
        KV cache events (numbered; a listener added late sees a gap and should resync from
        `kv.cached_blocks_by_tier()` via `call`). The listener must not block."""
        self._kv_event_listeners.append(listener)

    def add_step_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener(stats)` on the engine thread after each loop iteration that produced
        request figures (the engine's clock is `time.monotonic`). The listener must not block."""
        self._step_stats_listeners.append(listener)

    def info(self) -> ModelInfo:
        return self._info

    def set_lora_adapters(self, adapters: tuple[LoraAdapterInfo, ...]) -> None:
        """The adapters `info()` lists from now on (worker/lora_registry.py keeps them)."""
        self._info = dataclasses.replace(self._info, lora_adapters=adapters)

    def stats(self) -> EngineStats:
        return self._stats

    def queues(self) -> QueueView:
        return self._queues  # as of the last loop turn

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None, *, prefill_only: bool = False,
                       hold_lease_s: float = 30.0, start_by: float | None = None) -> AsyncIterator[RequestOutput]:
        """Admit and stream the request. `prefill_worker` (and its id) is ignored here (aggregated serving);
        `prefill_only` stops after the first token and holds the blocks, and a request not
        started by `start_by` (time.monotonic()) ends with an error (see LLMEngine)."""
        await self.prepare_guide(request)
        loop = asyncio.get_running_loop()
        stream = Stream(loop, asyncio.Queue(), request.sampling.n)
        admitted = loop.create_future()
        self._send(Admit(request, stream, admitted, prefill_only, hold_lease_s, time.monotonic(), start_by))
        await self._until_admitted(request.request_id, admitted)
        async for output in self.outputs(request, stream):
            yield output

    async def admit_for_decode(self, request: GenerationRequest, remote_possible: bool, min_remote_tokens: int,
                               lease_s: float) -> tuple[DecodeVerdict, Stream]:
        """Decode side, one hop to the engine thread: blocks reserved for a remote prefill when
        `remote_possible` and at least `min_remote_tokens` of the prompt are not cached here
        and blocks are free; else the request is queued for a local prefill. The queue gets
        the request's outputs either way (read them with `outputs`)."""
        await self.prepare_guide(request)
        loop = asyncio.get_running_loop()
        stream = Stream(loop, asyncio.Queue(), request.sampling.n)
        verdict = loop.create_future()
        self._send(AdmitForDecode(request, stream, verdict, remote_possible, min_remote_tokens, lease_s,
                                   time.monotonic()))
        return await self._until_admitted(request.request_id, verdict), stream

    async def prepare_guide(self, request: GenerationRequest) -> None:
        """Compile the request's guide on a thread of its own, before the engine thread admits
        it (which then finds it compiled): a new schema does not hold up every step."""
        if request.sampling.guide is not None:
            guide, engine = request.sampling.guide, self._engine
            await asyncio.to_thread(lambda: engine.guide_compiler().prepare(guide))  # the first builds the compiler

    async def outputs(self, request: GenerationRequest, stream: Stream) -> AsyncIterator[RequestOutput]:
        """The admitted request's outputs until each completion has finished; a consumer that
        stops early aborts the request. With an `OUTPUT_SINK` in the caller's context, the
        outputs after the first that finish nothing go there instead (`_put_all`)."""
        finished: set[int] = set()
        sink = OUTPUT_SINK.get()
        try:
            while len(finished) < request.sampling.n:
                output = await stream.outputs.get()
                stream.direct = sink  # from the second on: the first is the reader's
                if output.is_finished:
                    finished.add(output.index)
                yield output
        finally:
            if len(finished) < request.sampling.n:
                await self.abort(request.request_id)

    async def complete_remote(self, request_id: RequestId, first_token: int, logprob=None, skipped=()) -> None:
        """Decode side: the prompt's KV has landed (but for the window slices `skipped`, kvcache's
        SkippedSlices); its outputs go to the request's stream."""
        await self._query(Op.COMPLETE_REMOTE, request_id, first_token, logprob, skipped)

    async def fail_remote(self, request_id: RequestId, recompute: bool, reason: str) -> None:
        """Decode side: the transfer failed (blocks quarantined); recompute here or end with an error."""
        await self._query(Op.FAIL_REMOTE, request_id, recompute, reason)

    async def release_held(self, request_id: RequestId) -> None:
        """Prefill side: the peer has the prompt's KV (or never will): free its held blocks."""
        await self._query(Op.RELEASE_HELD, request_id)

    async def add_lora(self, checkpoint: LoraCheckpoint, timeout_s: float | None = None) -> None:
        await self._query(Op.ADD_LORA, checkpoint, timeout_s=timeout_s)

    async def remove_lora(self, lora_id: int, timeout_s: float | None = None) -> None:
        await self._query(Op.REMOVE_LORA, lora_id, timeout_s=timeout_s)

    async def ping(self, timeout_s: float) -> None:
        """Returns once the engine thread takes a command (TimeoutError after `timeout_s`)."""
        await self._query(Op.PING, timeout_s=timeout_s)

    async def kv_snapshot(self, timeout_s: float) -> tuple[int, list[tuple[BlockHash, Tier]]]:
        """The seq of the first KV event not reflected, and every cached block with its best tier."""
        return await self._query(Op.KV_SNAPSHOT, timeout_s=timeout_s)

    async def spill_host_tier(self, timeout_s: float) -> int:
        """At a graceful stop: write the host tier's keepable blocks to the disk tier; how many."""
        return await self._query(Op.SPILL_HOST_TIER, timeout_s=timeout_s)

    async def _until_admitted(self, request_id: RequestId, admitted: asyncio.Future):
        try:
            return await asyncio.wait_for(admitted, self._admit_timeout_s)
        except asyncio.TimeoutError:
            await self.abort(request_id)
            raise WorkerTimeoutError(f"request {request_id!r} not admitted within {self._admit_timeout_s}s")

    async def abort(self, request_id: RequestId) -> None:
        self._send(Abort(request_id))

    async def check_integrity(self) -> KvIntegrity:
        return await self._query(Op.CHECK_INTEGRITY)

    async def _query(self, op: Op, *args, timeout_s: float | None = None):
        """`op(*args)` on the engine thread between steps; its result or typed error comes back here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(Query(op, args, loop, done))
        return await asyncio.wait_for(done, timeout_s or self._admit_timeout_s)

    # ---- the engine thread -------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self._engine.has_work:
                self._cores.before_step(partial(self._drain_inbox, until_admission=True))
                if self._engine.has_work:  # the commands taken meanwhile may have ended it all
                    self._step()
            self._deliver(self._engine.remote.reap_expired())
            self._publish_kv_events()
            self._publish_step_stats()
            self._stats = engine_stats(self._engine)  # before idling, so load reports are never a turn stale
            self._queues = queue_view(self._engine)
            if not self._engine.has_work:
                self._cores.idle()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
        self._cores.close()

    def _drain_inbox(self, until_admission: bool = False) -> None:
        while (command := self._inbox.take(until_admission)) is not None:
            match command:
                case Admit():
                    self._admit(command)
                case AdmitForDecode():
                    self._admit_for_decode(command)
                case Query():
                    self._answer(command)
                case Abort(request_id):
                    self._deliver(self._engine.abort(request_id))
                    self._streams.pop(request_id, None)

    def _admit(self, command: Admit) -> None:
        try:
            self._engine.add_request(command.request, command.prefill_only, command.hold_lease_s, command.arrival_s,
                                     command.start_by)
        except Exception as exc:  # a typed error for the caller, raised in its own loop
            command.stream.loop.call_soon_threadsafe(_set_exception, command.admitted, exc)
            return
        self._streams[command.request.request_id] = command.stream
        command.stream.loop.call_soon_threadsafe(_set_value, command.admitted, None)

    def _admit_for_decode(self, command: AdmitForDecode) -> None:
        request = command.request
        try:
            claim, local_reason = self._engine.remote.admit(
                request, command.min_remote_tokens if command.remote_possible else None, command.lease_s,
                command.arrival_s)
        except Exception as exc:  # a typed error for the caller, raised in its own loop
            command.stream.loop.call_soon_threadsafe(_set_exception, command.verdict, exc)
            return
        self._streams[request.request_id] = command.stream
        command.stream.loop.call_soon_threadsafe(_set_value, command.verdict, DecodeVerdict(claim, local_reason))

    def _answer(self, query: Query) -> None:
        try:
            result = self._operations[query.op](*query.args)
        except Exception as exc:
            query.loop.call_soon_threadsafe(_set_exception, query.done, exc)
            return
        if isinstance(result, list) and all(isinstance(r, RequestOutput) for r in result):
            self._deliver(result)
        query.loop.call_soon_threadsafe(_set_value, query.done, result)

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
        """Hand a step's outputs to their streams: one wake-up of each event loop for all of
        them (a wake-up is a write to the loop's pipe; one per output cost 1.6 % of the engine
        thread at 64 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream, output))
            stream.num_finished += output.is_finished
            if stream.num_finished >= stream.num_completions:
                del self._streams[output.request_id]
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)

    def _publish_kv_events(self) -> None:
        events = self._engine.kv.drain_events()
        if events:
            for listener in self._kv_event_listeners:
                listener(events)

    def _publish_step_stats(self) -> None:
        stats = self._engine.take_step_stats()
        if stats:
            for listener in self._step_stats_listeners:
                listener(stats)


def _put_all(deliveries: list[tuple[Stream, RequestOutput]]) -> None:
    """On the request's loop: each output to its reader, or straight to its sink (in order: only
    while the reader has taken all before it, and never one that finishes a completion)."""
    for stream, output in deliveries:
        if stream.direct is None or output.is_finished or not stream.outputs.empty() or not stream.direct(output):
            stream.outputs.put_nowait(output)


def _set_value(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
