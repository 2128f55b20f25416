"""One output stream per router and worker: outputs batched on the worker's end, handed to each
request on the router's, and the `Generate` call still the request's result and its abort."""
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from fake_engine import FakeEngine, expected_outputs, make_request

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import RequestId
from pdserve.common.request import RequestOutput, TokenLogprob
from pdserve.rpc import convert, output_stream
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.output_stream import OutputDemux, OutputQueue
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.worker.server import WorkerServer

WAIT_S = 10.0


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


@asynccontextmanager
async def serving(engine: FakeEngine) -> AsyncIterator[tuple[WorkerServer, GrpcBackend]]:
    server = WorkerServer(engine, "127.0.0.1", 0)
    backend = GrpcBackend(f"127.0.0.1:{await server.start()}")
    try:
        yield server, backend
    finally:
        await backend.close()
        await server.stop(0)


def output(rid: str, i: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(RequestId(rid), 0, (i,), f"t{i}", finish_reason=finish)


def test_outputs_put_in_one_loop_turn_leave_as_one_batch() -> None:
    async def scenario() -> list[list[RequestOutput]]:
        queue = OutputQueue()
        batches = queue.batches()
        for i in range(5):
            queue.put(output("a", i))
        first = await anext(batches)
        queue.put(output("b", 9))
        second = await anext(batches)
        queue.close()
        with pytest.raises(WorkerUnavailableError):
            queue.put(output("c", 0))
        return [first, second, [o async for batch in batches for o in batch]]

    first, second, rest = asyncio.run(scenario())
    assert [o.token_ids for o in first] == [(i,) for i in range(5)]
    assert ([o.request_id for o in second], rest) == (["b"], [])


def test_many_requests_share_one_stream_and_each_gets_its_own_outputs() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        requests = [make_request(f"r{i}", max_tokens=3 + i) for i in range(8)]
        async with serving(engine) as (server, backend):
            async def collect(request):
                return [out async for out in backend.generate(request)]

            got = await asyncio.gather(*(collect(r) for r in requests))
            assert got == [expected_outputs(r) for r in requests]
            assert len(server._output_streams._queues) == 1  # one stream for all eight
        assert engine.aborted == []

    run(scenario())


class EndedCall:
    """A `Generate` call that has ended OK (it sends no outputs: they are on the stream)."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self) -> bool:
        return False


def test_the_last_outputs_may_follow_the_call_s_end() -> None:
    async def scenario() -> list[RequestOutput]:
        demux = OutputDemux("w:1")
        queue = demux.register(RequestId("a"))
        assert demux.register(RequestId("a")) is None  # a second one could not be told apart
        outputs = demux.outputs(RequestId("a"), queue, EndedCall(), 1)
        asyncio.get_running_loop().call_later(0.1, queue.put_nowait, output("a", 1, "stop"))
        return [out async for out in outputs]

    assert [o.finish_reason for o in asyncio.run(scenario())] == ["stop"]


def test_a_call_that_ended_without_its_last_outputs_is_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(output_stream, "LATE_OUTPUTS_S", 0.1)

    async def scenario() -> None:
        demux = OutputDemux("w:1")
        queue = demux.register(RequestId("a"))
        with pytest.raises(WorkerUnavailableError, match="a request's last outputs never came"):
            [out async for out in demux.outputs(RequestId("a"), queue, EndedCall(), 1)]
        assert demux.register(RequestId("a")) is not None  # forgotten once it ended

    asyncio.run(scenario())


def test_a_closed_stream_fails_its_requests_the_worker_aborts_them_and_the_next_opens_another() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=1)
        async with serving(engine) as (server, backend):
            outputs = backend.generate(make_request("cut"))
            assert (await anext(outputs)).text == "t0"
            await server._output_streams.close_when_idle(0)  # as a stopping worker does
            with pytest.raises(WorkerUnavailableError, match="its output stream ended"):
                await anext(outputs)
            await asyncio.wait_for(engine.abort_seen.wait(), WAIT_S)
            assert engine.aborted == ["cut"]
            engine.hang_after = None
            request = make_request("next")
            assert [out async for out in backend.generate(request)] == expected_outputs(request)

    run(scenario())


def test_a_stream_the_worker_does_not_know_is_refused_and_the_router_opens_another() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        async with serving(engine) as (server, backend):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                message = convert.request_to_proto(make_request("stray"))
                message.output_stream = "never-opened"
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    [m async for m in worker_pb2_grpc.WorkerStub(channel).Generate(message, timeout=WAIT_S)]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert engine.aborted == []  # refused before anything ran: the id may be another request's
            request = make_request("first")
            assert [out async for out in backend.generate(request)] == expected_outputs(request)
            server._output_streams._queues.clear()  # as a worker restarted under the same address
            with pytest.raises(WorkerUnavailableError, match="does not know our output stream"):
                [out async for out in backend.generate(make_request("lost"))]
            request = make_request("again")
            assert [out async for out in backend.generate(request)] == expected_outputs(request)

    run(scenario())


def test_a_stopping_worker_ends_the_stream_once_its_requests_are_done() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        server = WorkerServer(engine, "127.0.0.1", 0)
        backend = GrpcBackend(f"127.0.0.1:{await server.start()}")
        request = make_request("done")
        assert [out async for out in backend.generate(request)] == expected_outputs(request)
        await server.stop(60)  # past run()'s bound: only a stream ended at once lets it return in time
        await asyncio.sleep(0.2)
        assert backend._output_stream is not None and backend._output_stream.is_closed
        await backend.close()

    run(scenario())


def echo_with_logprobs(rid: str, num_prompt_tokens: int = 7000, top: int = 20) -> RequestOutput:
    """A first output of `echo` with `logprobs: 20` over a long prompt: ~2 MiB on the wire."""
    logprobs = tuple(TokenLogprob(i, -1.5, tuple((i + j, -2.0 - j) for j in range(top)))
                     for i in range(num_prompt_tokens))
    return RequestOutput(RequestId(rid), 0, (1,), "x", finish_reason="length", prompt_logprobs=logprobs,
                         num_prompt_tokens=num_prompt_tokens)


class EchoEngine(FakeEngine):
    """Answers every request with one large echo output, all of them in the same loop turn."""

    async def generate(self, request, prefill_worker=None, prefill_worker_id=None):
        await asyncio.sleep(0.2)  # every request in before any answers: one batch of all
        yield echo_with_logprobs(request.request_id)


def test_long_echoes_with_logprobs_in_one_batch_reach_their_requests() -> None:
    big = [echo_with_logprobs(f"r{i}") for i in range(3)]
    assert sum(convert.output_to_proto(o).ByteSize() for o in big[:2]) > 4_000_000  # ~gRPC's default limit
    messages = list(output_stream.output_messages(big + [output("s", 1)]))
    assert [len(m.outputs) for m in messages] == [1, 1, 2]
    assert all(m.ByteSize() <= output_stream.MAX_BATCH_BYTES for m in messages)

    async def scenario() -> None:
        engine = EchoEngine()
        async with serving(engine) as (_, backend):
            async def collect(rid: str):
                return [out async for out in backend.generate(make_request(rid, max_tokens=1))]

            got = await asyncio.gather(*(collect(f"r{i}") for i in range(3)))
            assert [[len(o.prompt_logprobs) for o in outs] for outs in got] == [[7000]] * 3
        assert engine.aborted == []

    run(scenario())
