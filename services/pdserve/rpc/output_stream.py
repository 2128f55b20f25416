"""Many requests' outputs on one gRPC stream: the worker's end (`OutputHub`) and the router's
(`OutputDemux`).

On its own `Generate` stream each request's tokens are one message per token: at 64 running
requests a decode step is 64 writes, each with its completion and its wake-ups of the worker's
event loop, which holds the interpreter lock the engine thread needs to start the next step, and
64 messages for the router to read. Instead a router opens one `StreamOutputs` call per worker
and names it in each `GenerateRequest.output_stream`; the worker puts each output on that stream,
whose writer sends all that is ready as one `OutputBatch` (a step's outputs reach the event loop
together, so a step is one message). `Generate` keeps the rest of its contract: its status is
the request's result, its deadline bounds it, and cancelling it aborts the request.

The two calls are separate HTTP/2 streams: `Generate` can end before the stream brings the
request's last outputs, so the router's end waits for those (at most `LATE_OUTPUTS_S`).

What is ready goes out in messages of at most `MAX_BATCH_BYTES` (gRPC refuses a message over
its receive limit, and one refused message would end the stream of every request on it): two
7,000-token `echo` answers with 20 logprobs each are ~5 MiB together. One output larger than
that goes alone, and the router's channel takes messages up to `MAX_MESSAGE_BYTES`.
"""
import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId
from pdserve.common.request import RequestOutput
from pdserve.rpc import convert
from pdserve.rpc.gen import request_pb2 as rpb
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc

log = logging.getLogger(__name__)

LATE_OUTPUTS_S = 10.0  # from a request's `Generate` ending to its last outputs on the stream
MAX_BATCH_BYTES = 3 << 20  # one OutputBatch, under gRPC's default 4 MiB receive limit
MAX_MESSAGE_BYTES = 64 << 20  # what the router receives: one output alone (a long prompt's logprobs)


class OutputQueue:
    """The worker's end of one `StreamOutputs` call: outputs wait here for its writer."""

    def __init__(self) -> None:
        self._ready: list[RequestOutput] = []
        self._wake = asyncio.Event()
        self.is_closed = False

    def put(self, output: RequestOutput) -> None:
        if self.is_closed:
            raise WorkerUnavailableError("router", "its output stream closed")
        self._ready.append(output)
        self._wake.set()

    def offer(self, output: RequestOutput) -> bool:
        """`put`, False instead of an error once the stream has closed (an `OUTPUT_SINK`)."""
        if self.is_closed:
            return False
        self.put(output)
        return True

    def close(self) -> None:
        self.is_closed = True
        self._wake.set()

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Everything put since the last batch, as soon as there is some; ends once closed."""
        while not self.is_closed:
            await self._wake.wait()
            self._wake.clear()
            if self._ready and not self.is_closed:
                batch, self._ready = self._ready, []
                yield batch


def output_messages(batch: list[RequestOutput]) -> Iterator[wpb.OutputBatch]:
    """`batch` in order, as messages of at most MAX_BATCH_BYTES (an output larger alone in one)."""
    protos: list[rpb.RequestOutput] = []
    size = 0
    for output in batch:
        proto = convert.output_to_proto(output)
        num_bytes = proto.ByteSize() + 8  # the field's tag and length
        if protos and size + num_bytes > MAX_BATCH_BYTES:
            yield wpb.OutputBatch(outputs=protos)
            protos, size = [], 0
        protos.append(proto)
        size += num_bytes
    if protos:
        yield wpb.OutputBatch(outputs=protos)


class OutputHub:
    """A worker's open output streams, by the id their router gave them."""

    def __init__(self) -> None:
        self._queues: dict[str, OutputQueue] = {}
        self._num_putting = 0  # requests putting their outputs on a stream now
        self._idle = asyncio.Event()
        self._idle.set()

    def get(self, stream_id: str) -> OutputQueue | None:
        return self._queues.get(stream_id)

    @contextlib.contextmanager
    def putting(self) -> Iterator[None]:
        """Held while a request puts its outputs on a stream (see `close_when_idle`)."""
        self._num_putting += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_putting -= 1
            if not self._num_putting:
                self._idle.set()

    async def serve(self, stream_id: str, context: grpc.aio.ServicerContext) -> None:
        """Run one `StreamOutputs` call until the worker closes the hub or the caller goes."""
        queue = OutputQueue()
        replaced = self._queues.get(stream_id)
        if replaced is not None:
            replaced.close()
        self._queues[stream_id] = queue
        try:
            await context.write(wpb.OutputBatch())  # open: the caller may name it now
            async for batch in queue.batches():
                for message in output_messages(batch):
                    await context.write(message)
        finally:
            queue.close()  # a request still putting outputs here fails, and the worker aborts it
            if self._queues.get(stream_id) is queue:
                del self._queues[stream_id]

    async def close_when_idle(self, timeout_s: float) -> None:
        """End every stream once no request puts outputs on one, or after `timeout_s` (the
        worker is stopping: the streams never end by themselves)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        for queue in self._queues.values():
            queue.close()


class _CallEnded:
    """A request's `Generate` call ended: OK (error None) or with `error`."""

    def __init__(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error


class OutputDemux:
    """The router's end of one `StreamOutputs` call: each output to its request's queue."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.stream_id = uuid.uuid4().hex
        self._queues: dict[RequestId, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.is_closed = False

    async def open(self, stub: worker_pb2_grpc.WorkerStub, timeout_s: float) -> None:
        """Start the call and wait (at most `timeout_s`) for the worker to confirm it."""
        call = stub.StreamOutputs(wpb.StreamOutputsRequest(stream_id=self.stream_id))
        try:
            await asyncio.wait_for(call.read(), timeout_s)
        except BaseException:
            call.cancel()
            self.is_closed = True
            raise
        self._reader = asyncio.create_task(self._read(call), name=f"outputs-{self.address}")

    def register(self, request_id: RequestId) -> asyncio.Queue | None:
        """The queue `request_id`'s outputs will come to (register before sending its `Generate`);
        None if the id has one already: outputs on this stream could not be told apart."""
        if request_id in self._queues:
            return None
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def outputs(self, request_id: RequestId, queue: asyncio.Queue, call: grpc.aio.UnaryStreamCall,
                      num_completions: int) -> AsyncIterator[RequestOutput]:
        """`request_id`'s outputs until each completion has finished. Raises the call's
        AioRpcError if it fails, WorkerUnavailableError if the stream ends first or the last
        outputs do not follow the call's end within `LATE_OUTPUTS_S`."""
        watcher = asyncio.create_task(_put_outcome(call, queue))
        finished: set[int] = set()
        timeout_s: float | None = None  # until the call has ended
        try:
            while len(finished) < num_completions:
                try:  # no wait_for until the call has ended: it costs a task switch per output
                    item = await (queue.get() if timeout_s is None else asyncio.wait_for(queue.get(), timeout_s))
                except TimeoutError:
                    raise WorkerUnavailableError(self.address, "a request's last outputs never came") from None
                if isinstance(item, RequestOutput):
                    if item.is_finished:
                        finished.add(item.index)
                    yield item
                elif isinstance(item, _CallEnded):
                    if item.error is not None:
                        raise item.error
                    timeout_s = LATE_OUTPUTS_S
                else:
                    raise item
            if not watcher.done():  # the OK status is on its way: a cancel now would abort a finished request
                await asyncio.wait({watcher}, timeout=LATE_OUTPUTS_S)
        finally:
            watcher.cancel()
            self.forget(request_id)

    def forget(self, request_id: RequestId) -> None:
        """Drop `request_id`'s queue: its outputs still coming are dropped."""
        self._queues.pop(request_id, None)

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> None:
        reason = "its output stream ended"
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:  # read() opened it: no `async for`
                for message in batch.outputs:
                    queue = self._queues.get(RequestId(message.request_id))
                    if queue is not None:  # else its request ended early on this side
                        queue.put_nowait(convert.output_from_proto(message))
        except grpc.aio.AioRpcError as exc:
            reason = f"its output stream failed: {exc.code().name}"
        finally:
            self.is_closed = True
            call.cancel()
            for queue in self._queues.values():
                queue.put_nowait(WorkerUnavailableError(self.address, reason))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


async def _put_outcome(call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue) -> None:
    """Put how `call` (a `Generate` naming an output stream, so it sends no outputs) ended."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(_CallEnded(exc))
        return
    queue.put_nowait(_CallEnded(None))
