"""Where a request goes: prefix overlap against load, prefill/decode pairing, fallback, sessions."""
import asyncio
import random

import pytest

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.stats import WorkerRole
from pdserve.kvcache import BlockStored, Tier, hash_request_blocks
from pdserve.router.routing.planner import Leg, Planner, RouteDecision, RoutingConfig
from pdserve.router.routing.prefix_index import Overlap, PrefixIndex
from tests.unit.router.routing.cluster_fakes import TPB, FakeWorker, info, make_pool, stats

PROMPT = list(range(200, 241))  # 41 tokens: 11 blocks, 10 full ones before the last token
KEYS = hash_request_blocks(PROMPT[:40], TPB)


def cluster(roles: dict[str, WorkerRole], reports: dict[str, object] | None = None, policy: str = "kv_aware",
            local_prefill_queue_tokens: int = 1024):
    workers = {a: FakeWorker(a, info(role), (reports or {}).get(a)) for a, role in roles.items()}
    pool = make_pool(workers)
    asyncio.run(pool.start())
    index = PrefixIndex()
    for address in workers:
        index.load_snapshot(WorkerId(address), [], 0)
    config = RoutingConfig(policy=policy, local_prefill_queue_tokens=local_prefill_queue_tokens)
    return Planner(pool, index, config, TPB, random.Random(3)), index, pool


def hold(index: PrefixIndex, worker: str, num_blocks: int, tier: Tier = Tier.DEVICE) -> None:
    index.apply(WorkerId(worker), [BlockStored(0, tuple(KEYS[:num_blocks]), None, tier, 35, None)])


def test_the_worker_holding_the_prefix_wins_and_the_decision_names_it() -> None:
    planner, index, _ = cluster({"a:1": WorkerRole.BOTH, "b:2": WorkerRole.BOTH})
    hold(index, "b:2", 8)
    decision = planner.plan(KEYS, len(PROMPT))
    assert decision == RouteDecision(Leg(WorkerId("b:2"), Overlap(num_device=8), 3.0), None, 11, False)
    assert decision.describe() == "decode=b:2;decode_overlap=8;prompt_blocks=11"


def test_load_outweighs_a_small_overlap() -> None:
    planner, index, _ = cluster({"a:1": WorkerRole.BOTH, "b:2": WorkerRole.BOTH}, {"b:2": stats(running=3, used=20)})
    hold(index, "b:2", 2)
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.decode.worker, decision.decode.cost) == ("a:1", 11.0)  # b:2 would cost 9 + 20


def test_prefill_and_decode_workers_are_chosen_each_on_its_own_cache() -> None:
    planner, index, _ = cluster({"p1:1": WorkerRole.PREFILL, "p2:2": WorkerRole.PREFILL,
                                 "d1:3": WorkerRole.DECODE, "d2:4": WorkerRole.DECODE})
    hold(index, "p2:2", 10)
    hold(index, "d1:3", 4, Tier.HOST)
    decision = planner.plan(KEYS, len(PROMPT))
    assert decision.prefill == Leg(WorkerId("p2:2"), Overlap(num_device=10), 1.0)
    assert decision.decode == Leg(WorkerId("d1:3"), Overlap(num_host=4), 11 - 3 + 1.0)
    assert decision.describe() == "decode=d1:3;decode_overlap=4;prefill=p2:2;prefill_overlap=10;prompt_blocks=11"


def test_no_prefill_worker_up_means_local_prefill_counted_as_a_fallback() -> None:
    planner, _, pool = cluster({"p1:1": WorkerRole.PREFILL, "d1:3": WorkerRole.DECODE})
    pool.mark_down(WorkerId("p1:1"), "gone")
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.decode.worker, decision.prefill, decision.is_decode_only_fallback) == ("d1:3", None, True)


def test_an_aggregated_worker_is_never_sent_a_prefill_worker() -> None:
    planner, index, _ = cluster({"p1:1": WorkerRole.PREFILL, "b:2": WorkerRole.BOTH, "d:3": WorkerRole.DECODE},
                                {"d:3": stats(used=50)})
    hold(index, "b:2", 10)
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.decode.worker, decision.decode.cost, decision.prefill) == ("b:2", 1.0, None)


def test_excluded_workers_are_skipped_and_none_left_is_unavailable() -> None:
    planner, index, _ = cluster({"a:1": WorkerRole.BOTH, "b:2": WorkerRole.BOTH})
    hold(index, "b:2", 8)
    assert planner.plan(KEYS, len(PROMPT), exclude={WorkerId("b:2")}).decode.worker == "a:1"
    with pytest.raises(WorkerUnavailableError, match="no decode or aggregated worker is up"):
        planner.plan(KEYS, len(PROMPT), exclude={WorkerId("a:1"), WorkerId("b:2")})


def test_no_decode_worker_up_is_unavailable_naming_why_each_is_out() -> None:
    planner, _, pool = cluster({"p1:1": WorkerRole.PREFILL, "d1:3": WorkerRole.DECODE})
    pool.mark_down(WorkerId("d1:3"), "worker d1:3 unavailable: draining: shutting down")
    with pytest.raises(WorkerUnavailableError) as caught:
        planner.plan(KEYS, len(PROMPT))
    assert str(caught.value) == ("worker decode unavailable: no decode or aggregated worker is up "
                                 "(d1:3: worker d1:3 unavailable: draining: shutting down)")


def test_a_session_keeps_its_workers_while_they_are_up() -> None:
    planner, index, pool = cluster({"a:1": WorkerRole.BOTH, "b:2": WorkerRole.BOTH}, policy="round_robin")
    first = planner.plan(KEYS, len(PROMPT), session_id="s1").decode.worker
    assert [planner.plan(KEYS, len(PROMPT), session_id="s1").decode.worker for _ in range(3)] == [first] * 3
    assert planner.plan(KEYS, len(PROMPT), session_id="s2").decode.worker != first  # round robin moved on
    pool.mark_down(first, "gone")
    assert planner.plan(KEYS, len(PROMPT), session_id="s1").decode.worker != first


PD = {"p1:1": WorkerRole.PREFILL, "d1:3": WorkerRole.DECODE}


def test_a_deep_prefill_queue_sends_the_prompt_to_the_idle_decode_worker() -> None:
    planner, _, _ = cluster(PD, {"p1:1": stats(waiting=5, queued=2000)})
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.decode.worker, decision.prefill, decision.is_local_for_queue) == ("d1:3", None, True)
    assert decision.decode.cost == 11.0  # priced as its own prefill: 11 new blocks, nothing queued or held
    assert decision.describe() == "decode=d1:3;decode_overlap=0;prefill=local_for_queue;prompt_blocks=11"


@pytest.mark.parametrize("prefill_queue, decode_queue, limit", [
    (1000, 0, 1024),  # the prefill worker's queue is below the limit
    (2000, 990, 1024),  # the decode worker's own queue would pass the limit: 990 + 44 new tokens
    (5000, 0, 0),  # turned off
])
def test_the_prompt_stays_on_the_prefill_worker(prefill_queue, decode_queue, limit) -> None:
    planner, _, _ = cluster(PD, {"p1:1": stats(queued=prefill_queue), "d1:3": stats(queued=decode_queue)},
                            local_prefill_queue_tokens=limit)
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.prefill.worker, decision.is_local_for_queue) == ("p1:1", False)


def test_only_the_tokens_the_decode_worker_lacks_join_its_queue() -> None:
    """981 queued + 44 new passes the limit of 1,024; with 10 of the 11 blocks cached, 981 + 4
    does not."""
    planner, index, _ = cluster(PD, {"p1:1": stats(queued=2000), "d1:3": stats(queued=981)})
    assert planner.plan(KEYS, len(PROMPT)).prefill.worker == "p1:1"
    hold(index, "d1:3", 10)
    decision = planner.plan(KEYS, len(PROMPT))
    assert (decision.prefill, decision.is_local_for_queue, decision.decode.overlap) == (None, True, Overlap(10))
