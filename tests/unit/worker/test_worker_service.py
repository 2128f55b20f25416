"""The worker's gRPC service and the router's client of it, over loopback, with a fake engine."""
import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from fake_engine import INFO, STATS, FakeEngine, expected_outputs, make_request

from pdserve.common.errors import (
    ConfigError,
    DuplicateRequestError,
    EngineWedgedError,
    InvalidRequestError,
    OverloadedError,
    WorkerTimeoutError,
    WorkerUnavailableError,
)
from pdserve.common.ids import DeploymentId, WorkerId
from pdserve.common.ports import free_ports
from pdserve.common.stats import WorkerInfo
from pdserve.rpc import convert
from pdserve.rpc.gen import worker_pb2 as wpb
from pdserve.rpc.gen import worker_pb2_grpc
from pdserve.rpc.worker_client import GrpcBackend
from pdserve.worker.server import WorkerServer

WAIT_S = 10.0  # bound on every wait; the fake engine answers at once


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


@asynccontextmanager
async def serving(engine: FakeEngine, deployment_id: DeploymentId | None = None, worker_id: WorkerId | None = None,
                  **timeouts: float) -> AsyncIterator[tuple[WorkerServer, GrpcBackend]]:
    server = WorkerServer(engine, "127.0.0.1", 0, deployment_id=deployment_id, worker_id=worker_id)
    port = await server.start()
    backend = GrpcBackend(f"127.0.0.1:{port}", **timeouts)
    try:
        yield server, backend
    finally:
        await backend.close()
        await server.stop(0)


def test_generate_streams_every_output_and_aborts_nothing() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        request = make_request(max_tokens=4)
        async with serving(engine) as (_, backend):
            outputs = [out async for out in backend.generate(request)]
        assert outputs == expected_outputs(request)
        assert (engine.aborted, engine.prefill_workers, engine.prefill_worker_ids) == ([], [None], [None])

    run(scenario())


def test_prefill_worker_and_its_id_reach_the_engine() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        async with serving(engine) as (_, backend):
            [out async for out in backend.generate(make_request("a"), prefill_worker="10.0.0.7:50051")]
            [out async for out in backend.generate(make_request("b"), "10.0.0.7:50051", WorkerId("prefill-0/pod-a"))]
        assert engine.prefill_workers == ["10.0.0.7:50051", "10.0.0.7:50051"]
        assert engine.prefill_worker_ids == [None, "prefill-0/pod-a"]

    run(scenario())


def test_cancelling_the_raw_call_aborts_the_request() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=1)
        async with serving(engine) as (server, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Generate(
                    convert.request_to_proto(make_request("cancel-me")), timeout=WAIT_S)
                first = await call.read()
                await asyncio.wait_for(engine.hanging.wait(), WAIT_S)
                call.cancel()
                await asyncio.wait_for(engine.abort_seen.wait(), WAIT_S)
        assert convert.output_from_proto(first).token_ids == (100,)
        assert engine.aborted == ["cancel-me"]

    run(scenario())


def test_closing_the_backend_iterator_aborts_the_request() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=2)
        async with serving(engine) as (_, backend):
            stream = backend.generate(make_request("closed"))
            assert [(await anext(stream)).text, (await anext(stream)).text] == ["t0", "t1"]
            await stream.aclose()
            await asyncio.wait_for(engine.abort_seen.wait(), WAIT_S)
        assert engine.aborted == ["closed"]

    run(scenario())


def test_cancelling_the_consuming_task_aborts_the_request() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=0)
        async with serving(engine) as (_, backend):
            task = asyncio.create_task(anext(backend.generate(make_request("task"))))
            await asyncio.wait_for(engine.hanging.wait(), WAIT_S)
            task.cancel()
            await asyncio.wait_for(engine.abort_seen.wait(), WAIT_S)
            with pytest.raises(asyncio.CancelledError):
                await task
        assert engine.aborted == ["task"]

    run(scenario())


def test_generate_past_its_deadline_times_out_and_aborts() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=0)
        async with serving(engine, generate_timeout_s=0.2) as (_, backend):
            with pytest.raises(WorkerTimeoutError) as caught:
                [out async for out in backend.generate(make_request("slow"))]
            await asyncio.wait_for(engine.abort_seen.wait(), WAIT_S)
        assert caught.value.timeout_s == 0.2
        assert engine.aborted == ["slow"]

    run(scenario())


def test_engine_refusal_arrives_as_the_same_typed_error() -> None:
    async def scenario() -> None:
        engine = FakeEngine(fail_with=InvalidRequestError("prompt is too long", "prompt"))
        async with serving(engine) as (_, backend):
            with pytest.raises(InvalidRequestError) as caught:
                [out async for out in backend.generate(make_request("long"))]
        assert (str(caught.value), caught.value.param) == ("prompt is too long", "prompt")
        assert engine.aborted == ["long"]

    run(scenario())


def test_duplicate_request_id_is_refused_without_aborting_the_holder() -> None:
    async def scenario() -> None:
        engine = FakeEngine(fail_with=DuplicateRequestError("req-1 is already running"))
        async with serving(engine) as (_, backend):
            with pytest.raises(DuplicateRequestError, match="req-1 is already running"):
                [out async for out in backend.generate(make_request("req-1"))]
        assert engine.aborted == []

    run(scenario())


@pytest.mark.parametrize("refusal", [OverloadedError("1 requests are waiting"), EngineWedgedError("engine wedged")])
def test_a_request_refused_before_admission_is_unavailable_and_aborts_nothing(refusal: Exception) -> None:
    async def scenario() -> None:
        engine = FakeEngine(fail_with=refusal)
        async with serving(engine) as (_, backend):
            with pytest.raises(WorkerUnavailableError, match=str(refusal)):
                [out async for out in backend.generate(make_request("req-1"))]
        assert engine.aborted == []

    run(scenario())


def test_stopping_the_server_cancels_running_calls_and_aborts_them() -> None:
    async def scenario() -> None:
        engine = FakeEngine(hang_after=0)
        server = WorkerServer(engine, "127.0.0.1", 0)
        backend = GrpcBackend(f"127.0.0.1:{await server.start()}")
        task = asyncio.create_task(anext(backend.generate(make_request("in-flight"))))
        await asyncio.wait_for(engine.hanging.wait(), WAIT_S)
        await server.stop(0.1)
        with pytest.raises(WorkerUnavailableError):
            await task
        await backend.close()
        assert engine.aborted == ["in-flight"]

    run(scenario())


def test_abort_stats_info_and_health_round_trip() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        async with serving(engine) as (_, backend):
            await backend.abort(make_request("gone").request_id)
            assert await backend.stats() == STATS
            assert await backend.info() == WorkerInfo(INFO, deployment_id=None)
            assert await backend.is_serving() is True
            engine.stats_error = RuntimeError("device lost")
            assert await backend.is_serving() is False
        assert engine.aborted == ["gone"]

    run(scenario())


def test_a_wedged_engine_is_not_serving_and_its_stats_name_why() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        engine.stats_error = EngineWedgedError("engine wedged: no step for 61 s")
        async with serving(engine) as (server, backend):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                reply = await worker_pb2_grpc.WorkerStub(channel).Health(wpb.HealthRequest(), timeout=WAIT_S)
            assert (reply.status, reply.reason) == (wpb.SERVING_STATUS_NOT_SERVING, "engine wedged: no step for 61 s")
            with pytest.raises(WorkerUnavailableError) as caught:
                await backend.stats()
            assert caught.value.reason == "engine wedged: no step for 61 s"

    run(scenario())


def test_info_names_the_deployment_the_worker_was_started_in_and_its_id() -> None:
    async def scenario() -> None:
        async with serving(FakeEngine(), DeploymentId("serve-1a2b"), WorkerId("prefill-0/pod-a")) as (_, backend):
            assert await backend.info() == WorkerInfo(INFO, DeploymentId("serve-1a2b"), WorkerId("prefill-0/pod-a"))

    run(scenario())


def test_unreachable_worker_raises_worker_unavailable() -> None:
    async def scenario() -> None:
        backend = GrpcBackend(f"127.0.0.1:{free_ports('127.0.0.1', 1)[0]}", rpc_timeout_s=2.0)
        with pytest.raises(WorkerUnavailableError):
            await backend.info()
        with pytest.raises(WorkerUnavailableError):
            [out async for out in backend.generate(make_request())]
        await backend.close()

    run(scenario())


def test_server_refuses_a_port_in_use() -> None:
    async def scenario() -> None:
        first = WorkerServer(FakeEngine(), "127.0.0.1", 0)
        port = await first.start()
        second = WorkerServer(FakeEngine(), "127.0.0.1", port)
        with pytest.raises(ConfigError) as caught:
            await second.start()
        await first.stop(0)
        assert (caught.value.field, caught.value.value) == ("port", f"127.0.0.1:{port}")

    run(scenario())
