"""KV handoff between a prefill-only engine and a decode engine (token-store stand-in, copied KV)."""
import pytest

from pdserve.common.errors import DuplicateRequestError, TransferError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from tests.unit.engine.test_llm_engine import make_engine, reference, request, run


def _prefill(p_engine, req):
    p_engine.add_request(req, prefill_only=True, hold_lease_s=5.0)
    outs = []
    while p_engine.has_work:
        outs += p_engine.step()
    assert len(outs) == 1 and outs[0].finish_reason == "length"
    assert list(outs[0].held_block_ids) == p_engine.remote.held_block_ids(req.request_id)  # the output names them
    return outs[0].token_ids[0]


def _copy_kv(src_engine, dst_engine, src_ids, dst_ids):
    dst_engine.runner.store[list(dst_ids)] = src_engine.runner.store[list(src_ids)]


def _decode(d_engine, rid):
    tokens = []
    while d_engine.has_work:
        for out in d_engine.step():
            tokens += out.token_ids
    return tokens


def _disaggregated(p, d, req) -> list[int]:
    """`req`'s tokens prefilled on `p`, its KV copied into `d`'s reserved blocks, decoded on `d`."""
    rid = req.request_id
    claim = d.remote.reserve(req, lease_s=5.0)
    first = _prefill(p, req)
    src = p.remote.held_block_ids(rid)
    start = claim.num_cached_tokens // 4
    _copy_kv(p, d, src[start:], claim.block_ids[start:])
    p.remote.release_held(rid)
    outs = d.remote.complete(rid, first)
    return list(outs[0].token_ids) + _decode(d, rid)


def test_prefill_then_decode_equals_aggregated():
    prompt = list(range(10, 31))
    p, d = make_engine(), make_engine()
    assert _disaggregated(p, d, request("r", prompt, max_tokens=8)) == reference(prompt, 8)
    assert p.kv.num_used_blocks == 0 and d.kv.num_used_blocks == 0
    p.kv.check_integrity()
    d.kv.check_integrity()


@pytest.mark.parametrize("seed", [0, 11, 12345])
def test_seeded_sampling_gives_the_same_tokens_disaggregated_and_aggregated(seed):
    prompt = list(range(10, 31))
    req = GenerationRequest(RequestId("r"), tuple(prompt), SamplingParams(max_tokens=8, temperature=20.0, seed=seed))
    aggregated, _ = run(make_engine(), [req])
    assert aggregated[("r", 0)] != reference(prompt, 8)  # a hot temperature: sampling, not greedy
    assert _disaggregated(make_engine(), make_engine(), req) == aggregated[("r", 0)]


def test_only_missing_blocks_move_when_decode_holds_the_prefix():
    prompt = list(range(10, 31))
    d = make_engine()
    d.add_request(request("warm", prompt[:17], max_tokens=1))
    _decode(d, "warm")
    claim = d.remote.reserve(request("r", prompt), lease_s=5.0)
    assert claim.num_cached_tokens == 16  # 4 of the prompt's 6 blocks are already on the decode side
    assert len(claim.block_ids[claim.num_cached_tokens // 4:]) == 2


def test_failed_transfer_quarantines_its_blocks_until_the_lease_ends_and_publishes_nothing():
    clock = [0.0]
    d = make_engine()
    d._clock = lambda: clock[0]
    req = request("r", list(range(10, 31)))
    reserved = d.remote.reserve(req, lease_s=5.0).block_ids
    outs = d.remote.fail(RequestId("r"), recompute=False, reason="peer vanished")
    assert [o.finish_reason for o in outs] == ["error"] and outs[0].error == "peer vanished"
    # A late write may still land: the blocks stay out of use, and out of the cache.
    assert d.kv.block_ids(RequestId("r")) == list(reserved) and d.handoffs.num_quarantined == 1
    d.add_request(request("other", list(range(40, 60))))
    d.step()
    assert not set(reserved) & set(d.kv.block_ids(RequestId("other")))
    _decode(d, "other")
    cached_before = len(d.kv.pool.cached)
    clock[0] = 4.9
    d.remote.reap_expired()
    assert d.handoffs.num_quarantined == 1
    clock[0] = 5.0
    d.remote.reap_expired()
    assert d.handoffs.num_quarantined == 0 and not d.kv.has_request(RequestId("r"))
    assert len(d.kv.pool.cached) == cached_before
    d.kv.check_integrity()


def test_failed_transfer_can_recompute_locally():
    d = make_engine()
    prompt = list(range(10, 31))
    d.remote.reserve(request("r", prompt), lease_s=5.0)
    assert d.remote.fail(RequestId("r"), recompute=True, reason="x") == []
    assert _decode(d, "r") == reference(prompt, 8)


def test_lease_frees_blocks_of_a_peer_that_never_comes_back():
    clock = [0.0]
    p, d = make_engine(), make_engine()
    p._clock = d._clock = lambda: clock[0]
    req = request("r", list(range(10, 31)))
    d.remote.reserve(req, lease_s=2.0)
    _prefill(p, req)
    assert p.kv.num_used_blocks > 0 and d.kv.num_used_blocks > 0
    clock[0] = 10.0
    assert p.remote.reap_expired() == []
    outs = d.remote.reap_expired()
    assert [o.finish_reason for o in outs] == ["error"]
    assert p.kv.num_used_blocks == 0 and d.kv.num_used_blocks == 0
    assert (p.handoffs.num_lease_expiries, d.handoffs.num_lease_expiries) == (1, 1)


def test_the_held_blocks_of_an_expired_hold_are_a_transfer_error_not_a_key_error():
    clock = [0.0]
    p = make_engine()
    p._clock = lambda: clock[0]
    _prefill(p, request("r", list(range(10, 31))))  # held for 5 s
    clock[0] = 10.0
    p.remote.reap_expired()
    with pytest.raises(TransferError, match="'r' is no longer held"):
        p.remote.held_block_ids(RequestId("r"))
    with pytest.raises(TransferError, match="'never' is no longer held"):
        p.remote.held_block_ids(RequestId("never"))


def test_abort_while_waiting_for_kv_frees_on_both_sides():
    clock = [0.0]
    p, d = make_engine(), make_engine()
    d._clock = lambda: clock[0]
    req = request("r", list(range(10, 31)))
    d.remote.reserve(req, lease_s=5.0)
    _prefill(p, req)
    assert [o.finish_reason for o in d.abort(RequestId("r"))] == ["abort"]
    assert d.kv.num_used_blocks > 0  # a write may still land: reserved until the outcome is known
    assert d.remote.fail(RequestId("r"), recompute=True, reason="aborted") == []
    p.abort(RequestId("r"))
    assert p.kv.num_used_blocks == 0 and d.kv.num_used_blocks > 0  # quarantined: the write failed
    clock[0] = 5.0
    d.remote.reap_expired()
    assert d.kv.num_used_blocks == 0
    assert len(d.handoffs) == 0 and len(p.handoffs) == 0
    assert not d.has_work
    p.kv.check_integrity()
    d.kv.check_integrity()


def test_an_id_held_for_a_peer_is_refused_alone():
    p = make_engine()
    _prefill(p, request("r", list(range(10, 31))))
    held = p.remote.held_block_ids(RequestId("r"))
    other = list(range(40, 60))
    p.add_request(request("other", other))
    with pytest.raises(DuplicateRequestError, match="'r' is in use"):
        p.add_request(request("r", [1, 2, 3]))
    assert _decode(p, "other") == reference(other, 8)
    assert p.remote.held_block_ids(RequestId("r")) == held
    p.remote.release_held(RequestId("r"))
    assert p.kv.num_used_blocks == 0
    p.kv.check_integrity()
    p.add_request(request("r", [1, 2, 3]))  # the id is free again once its blocks are


def test_an_id_whose_remote_prefill_was_aborted_is_refused_until_its_blocks_are_settled():
    clock = [0.0]
    d = make_engine()
    d._clock = lambda: clock[0]
    d.remote.reserve(request("r", list(range(10, 31))), lease_s=2.0)
    d.abort(RequestId("r"))  # a write may still land: the blocks stay reserved
    other = list(range(40, 60))
    d.add_request(request("other", other))
    with pytest.raises(DuplicateRequestError):
        d.add_request(request("r", [1, 2, 3]))
    with pytest.raises(DuplicateRequestError):
        d.remote.reserve(request("r", [1, 2, 3]), lease_s=2.0)
    assert _decode(d, "other") == reference(other, 8)
    d.remote.fail(RequestId("r"), recompute=False, reason="aborted")  # the transfer's outcome comes in
    clock[0] = 10.0  # past the lease: no write can land any more
    d.remote.reap_expired()
    assert d.kv.num_used_blocks == 0 and not d.kv.has_request(RequestId("r"))
    d.kv.check_integrity()
    d.add_request(request("r", [1, 2, 3]))


def test_only_sequences_whose_kv_has_not_landed_await_it():
    """vLLM counts them as waiting; a prefill worker's held blocks are not."""
    p, d = make_engine(), make_engine()
    req = request("r", list(range(10, 31)))
    claim = d.remote.reserve(req, lease_s=5.0)
    first = _prefill(p, req)
    assert (d.handoffs.num_awaiting_kv, p.handoffs.num_awaiting_kv, len(p.handoffs)) == (1, 0, 1)
    _copy_kv(p, d, p.remote.held_block_ids(req.request_id), claim.block_ids)
    d.remote.complete(req.request_id, first)
    assert d.handoffs.num_awaiting_kv == 0


def test_a_prefill_still_queued_at_its_start_by_time_ends_unstarted_and_computes_nothing():
    clock = [0.0]
    p = make_engine()
    p._clock = lambda: clock[0]
    p.add_request(request("late", list(range(10, 31))), prefill_only=True, hold_lease_s=5.0, start_by=1.0)
    p.add_request(request("free", list(range(40, 61))), prefill_only=True, hold_lease_s=5.0)  # no bound
    assert p.remote.reap_expired() == []  # not yet
    clock[0] = 1.0
    (out,) = p.remote.reap_expired()
    assert (out.request_id, out.finish_reason) == ("late", "error")
    assert out.error == "not started within its queue bound (waited 1.0 s)"
    assert [s.request.request_id for s in p.scheduler.waiting] == ["free"]
    assert p.kv.num_used_blocks == 0
    p.kv.check_integrity()


def test_a_prefill_that_started_before_its_start_by_time_is_not_ended_by_it():
    clock = [0.0]
    p = make_engine()
    p._clock = lambda: clock[0]
    p.add_request(request("r", list(range(10, 31))), prefill_only=True, hold_lease_s=5.0, start_by=1.0)
    outs = p.step()  # the whole prompt in one step: held for the peer
    clock[0] = 2.0
    assert p.remote.reap_expired() == [] and len(p.remote.held_block_ids(RequestId("r"))) == len(outs[0].held_block_ids)
