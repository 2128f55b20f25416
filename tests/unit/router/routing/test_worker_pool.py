"""The worker pool: registration checks at start, health (down after N failures, back when it
answers, re-checked), and load counting dispatches the worker has not reported yet."""
import asyncio
import logging

import pytest

from pdserve.common.errors import ConfigError, WorkerUnavailableError
from pdserve.common.ids import DeploymentId, WorkerId
from pdserve.common.stats import WorkerRole
from pdserve.router.routing.cost import WorkerLoad
from pdserve.router.routing.registration import check_all, cluster_info
from tests.unit.router.routing.cluster_fakes import FakeClock, FakeWorker, RecordingListener, info, make_pool, stats

A, B, C = WorkerId("a:1"), WorkerId("b:2"), WorkerId("c:3")


def started(workers: dict[str, FakeWorker], **kw):
    pool = make_pool(workers, **kw)
    pool.listener = RecordingListener()
    asyncio.run(pool.start())
    return pool


@pytest.mark.parametrize("other, message", [
    (info(model="other"), "worker b:2 model_name='other': differs from worker a:1's 'toy'"),
    (info(tpb=16), "worker b:2 tokens_per_block=16: differs from worker a:1's 4"),
    (info(algorithm="sha256-v2"), "worker b:2 block_hash_algorithm='sha256-v2': this router computes block keys "
                                  "with 'sha256-v1'"),
])
def test_a_worker_that_disagrees_is_an_error_at_start_naming_it_and_the_field(other, message) -> None:
    pool = make_pool({A: FakeWorker(A, info()), B: FakeWorker(B, other)})
    with pytest.raises(ConfigError) as err:
        asyncio.run(pool.start())
    assert str(err.value) == message


def test_start_needs_a_decode_capable_worker() -> None:
    down = FakeWorker(B, info(WorkerRole.DECODE))
    down.is_down = True
    pool = make_pool({A: FakeWorker(A, info(WorkerRole.PREFILL)), B: down})
    with pytest.raises(WorkerUnavailableError, match="a:1,b:2 unavailable: no decode or aggregated worker answered"):
        asyncio.run(pool.start())


def test_a_worker_silent_at_start_joins_once_it_answers() -> None:
    late = FakeWorker(B, info(WorkerRole.DECODE))
    late.is_down = True
    pool = started({A: FakeWorker(A, info()), B: late})
    assert pool.listener.events == [("up", A)]
    late.is_down = False
    asyncio.run(pool.poll(pool.handles[B]))
    assert pool.listener.events == [("up", A), ("up", B)]
    assert [h.address for h in pool.up({WorkerRole.DECODE})] == [B]


def test_failed_polls_take_a_worker_out_and_an_answer_brings_it_back() -> None:
    worker = FakeWorker(A, info())
    pool = started({A: worker}, threshold=2)
    worker.is_down = True
    asyncio.run(pool.poll(pool.handles[A]))
    assert pool.handles[A].is_up  # one failure is not enough
    asyncio.run(pool.poll(pool.handles[A]))
    assert not pool.handles[A].is_up
    worker.is_down = False
    asyncio.run(pool.poll(pool.handles[A]))
    assert pool.listener.events == [("up", A), ("down", A), ("up", A)]


def test_a_worker_back_with_other_settings_stays_out() -> None:
    a, b = FakeWorker(A, info()), FakeWorker(B, info())
    pool = started({A: a, B: b})
    pool.mark_down(B, "stream broke")
    b.model_info = info(tpb=8)  # restarted with another block size
    asyncio.run(pool.poll(pool.handles[B]))
    assert not pool.handles[B].is_up
    assert pool.handles[B].refusal == "worker b:2 tokens_per_block=8: differs from worker a:1's 4"


OURS, THEIRS = DeploymentId("serve-ours"), DeploymentId("serve-theirs")


def test_a_worker_of_another_deployment_is_refused_with_a_log_line_and_the_others_serve(
        caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = FakeWorker(A, info(), deployment_id=OURS), FakeWorker(B, info(), deployment_id=THEIRS)
    with caplog.at_level(logging.INFO, logger="pdserve.router.routing.worker_pool"):
        pool = started({A: ours, B: theirs}, deployment_id=OURS)
    assert pool.listener.events == [("up", A)]
    refusal = "worker b:2 deployment_id='serve-theirs': this router admits only workers of deployment 'serve-ours'"
    assert pool.handles[B].refusal == refusal
    assert f"worker b:2 refused: {refusal}" in caplog.messages
    assert "worker a:1 (both, deployment serve-ours) in rotation" in caplog.messages
    asyncio.run(pool.poll(pool.handles[B]))  # still answering, still refused, not logged again
    assert [h.address for h in pool.up({WorkerRole.BOTH})] == [A]
    assert caplog.messages.count(f"worker b:2 refused: {refusal}") == 1


def test_a_worker_without_a_deployment_id_is_refused_by_a_router_with_one() -> None:
    pool = started({A: FakeWorker(A, info(), deployment_id=OURS), B: FakeWorker(B, info())}, deployment_id=OURS)
    assert pool.handles[B].refusal == ("worker b:2 deployment_id='': this router admits only workers of "
                                       "deployment 'serve-ours'")


def test_start_with_only_foreign_workers_fails_saying_why() -> None:
    pool = make_pool({A: FakeWorker(A, info(), deployment_id=THEIRS)}, wait_s=60.0, deployment_id=OURS)
    with pytest.raises(WorkerUnavailableError) as err:
        asyncio.run(pool.start())  # at once: a refused worker is not waited for
    assert err.value.reason == ("no decode or aggregated worker answered within 60 s; refused worker a:1 "
                                "deployment_id='serve-theirs': this router admits only workers of deployment "
                                "'serve-ours'")


def test_a_router_without_a_deployment_id_admits_any_and_logs_the_id_it_saw(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.router.routing.worker_pool"):
        pool = started({A: FakeWorker(A, info(), deployment_id=THEIRS), B: FakeWorker(B, info())})
    assert pool.listener.events == [("up", A), ("up", B)]
    assert [m for m in caplog.messages if "in rotation" in m] == [
        "worker a:1 (both, deployment serve-theirs) in rotation", "worker b:2 (both, deployment none) in rotation"]


def test_a_restarted_worker_of_another_deployment_stays_out() -> None:
    b = FakeWorker(B, info(), deployment_id=OURS)
    pool = started({A: FakeWorker(A, info(), deployment_id=OURS), B: b}, deployment_id=OURS)
    pool.mark_down(B, "stream broke")
    b.deployment_id = THEIRS  # another launch took the port
    asyncio.run(pool.poll(pool.handles[B]))
    assert not pool.handles[B].is_up
    assert pool.handles[B].refusal is not None and "deployment_id='serve-theirs'" in pool.handles[B].refusal


def test_probe_takes_an_unreachable_worker_out_at_once() -> None:
    worker = FakeWorker(A, info())
    pool = started({A: worker, B: FakeWorker(B, info())}, threshold=5)
    worker.is_down = True
    assert asyncio.run(pool.probe(A)) is False
    assert pool.listener.events == [("up", A), ("up", B), ("down", A)]


def test_load_corrects_the_last_report_with_dispatches_made_and_ended_since() -> None:
    clock = FakeClock()
    worker = FakeWorker(A, info(), stats(running=2, waiting=1, used=10, queued=40))
    pool = started({A: worker}, clock=clock)
    handle = pool.handles[A]
    before = pool.dispatch(handle, num_prefill_tokens=16, num_blocks=4)
    clock.now = 101.0
    asyncio.run(pool.poll(handle))  # its report holds `before`
    clock.now = 102.0
    after = pool.dispatch(handle, num_prefill_tokens=8, num_blocks=3)
    assert pool.load(handle) == WorkerLoad(num_requests=4, num_active_blocks=13, num_prefill_tokens=48)
    pool.prefill_done(handle, after)
    assert pool.load(handle) == WorkerLoad(4, 13, 40)
    pool.prefill_done(handle, before)  # the report's 40 queued tokens held its 16
    assert pool.load(handle) == WorkerLoad(4, 13, 24)
    pool.finish(handle, after)
    pool.finish(handle, before)
    pool.finish(handle, before)  # twice changes nothing
    assert pool.load(handle) == WorkerLoad(2, 6, 24)
    clock.now = 103.0
    asyncio.run(pool.poll(handle))  # a report asked after the ends replaces every correction
    assert pool.load(handle) == WorkerLoad(3, 10, 40)


def test_a_report_asked_before_a_request_ended_but_arriving_after_is_still_corrected() -> None:
    clock = FakeClock()
    worker = FakeWorker(A, info(), stats(running=1, used=11))
    pool = started({A: worker}, clock=clock)
    handle = pool.handles[A]
    clock.now = 101.0
    entry = pool.dispatch(handle, num_prefill_tokens=0, num_blocks=11)
    clock.now = 102.0
    asked_at = clock.now  # the query leaves while the request runs ...
    clock.now = 103.0
    pool.finish(handle, entry)  # ... the request ends ...
    handle.book.record_report(worker.report, asked_at)  # ... and then the report arrives
    assert pool.load(handle) == WorkerLoad(0, 0, 0)


def test_corrections_never_take_a_figure_below_zero() -> None:
    clock = FakeClock()
    pool = started({A: FakeWorker(A, info(), stats(running=1, used=2))}, clock=clock)
    handle = pool.handles[A]
    early = pool.dispatch(handle, num_prefill_tokens=50, num_blocks=9)  # estimated 9 blocks
    clock.now = 101.0
    asyncio.run(pool.poll(handle))  # the worker reports 2
    pool.finish(handle, early)
    assert pool.load(handle) == WorkerLoad(0, 0, 0)


def test_cluster_info_serves_the_shortest_context() -> None:
    infos = {B: info(WorkerRole.DECODE, max_len=64), A: info(WorkerRole.PREFILL, max_len=128)}
    check_all(infos, "sha256-v1")
    assert cluster_info(infos) == info(WorkerRole.BOTH, max_len=64)
