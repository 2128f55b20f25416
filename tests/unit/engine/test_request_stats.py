"""The engine's request figures on a hand-driven clock: what each phase took, and which worker
of a disaggregated pair records what (each request counted once over both)."""
from pdserve.common.ids import RequestId
from pdserve.engine.core.request_stats import FinishedSeq, PrefillDone
from tests.unit.engine.test_handoff import _copy_kv
from tests.unit.engine.test_llm_engine import make_engine, request

PROMPT = list(range(10, 31))  # 21 tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def clocked(**kw):
    engine, clock = make_engine(**kw), Clock()
    engine._clock = clock
    return engine, clock


def step_at(engine, clock: Clock, t: float) -> list:
    clock.now = t
    return engine.step()


def test_a_chunked_prefill_and_its_decode_are_timed_from_arrival_on_the_engines_clock() -> None:
    engine, clock = clocked(budget=12)
    clock.now = 1.0
    engine.add_request(request("r", PROMPT, max_tokens=3))
    step_at(engine, clock, 3.0)  # first 12 prompt tokens
    step_at(engine, clock, 4.0)  # the other 9, and the first token
    step_at(engine, clock, 6.0)
    outputs = step_at(engine, clock, 10.0)
    assert outputs[-1].finish_reason == "length"
    stats = engine.take_step_stats()
    assert stats.prefills == [PrefillDone(queue_s=2.0, prefill_s=1.0, num_prompt_tokens=21)]
    assert stats.ttfts_s == [3.0] and stats.inter_token_s == [2.0, 4.0] and stats.num_generation_tokens == 3
    assert stats.step_tokens == [12, 9, 1, 1]  # each step's tokens: two prompt chunks, two decode tokens
    assert stats.finished == [FinishedSeq("length", e2e_s=9.0, inference_s=7.0, decode_s=6.0,
                                          num_prompt_tokens=21, num_generation_tokens=3)]
    assert not engine.take_step_stats()  # taken: the next batch starts empty


def test_an_explicit_arrival_counts_the_wait_before_the_engine_took_the_request() -> None:
    engine, clock = clocked()
    clock.now = 5.0
    engine.add_request(request("r", PROMPT, max_tokens=1), arrival_s=2.0)
    step_at(engine, clock, 5.0)
    stats = engine.take_step_stats()
    assert stats.prefills == [PrefillDone(3.0, 0.0, 21)] and stats.ttfts_s == [3.0]
    assert stats.finished[0].e2e_s == 3.0


def test_an_abort_while_queued_is_counted_with_only_its_end_to_end_time() -> None:
    engine, clock = clocked()
    engine.add_request(request("r", PROMPT))
    clock.now = 2.5
    engine.abort(RequestId("r"))
    stats = engine.take_step_stats()
    assert stats.finished == [FinishedSeq("abort", 2.5, None, None, 21, 0)]
    assert stats.prefills == [] and stats.ttfts_s == []


def test_n_completions_count_as_n_requests_as_vllms_child_requests_do() -> None:
    engine, clock = clocked()
    engine.add_request(request("r", PROMPT, max_tokens=2, n=3))
    step_at(engine, clock, 1.0)
    step_at(engine, clock, 2.0)
    stats = engine.take_step_stats()
    assert stats.ttfts_s == [1.0] * 3 and stats.inter_token_s == [1.0] * 3
    assert [f.finish_reason for f in stats.finished] == ["length"] * 3
    assert stats.prefills == [PrefillDone(1.0, 0.0, 21)] * 3


def test_disaggregated_the_prefill_worker_records_the_prefill_and_the_decode_worker_the_request() -> None:
    p, p_clock = clocked()
    d, d_clock = clocked()
    req = request("r", PROMPT, max_tokens=3)
    d_clock.now = 1.0
    claim = d.remote.reserve(req, lease_s=50.0)
    p_clock.now = 2.0
    p.add_request(req, prefill_only=True, hold_lease_s=50.0)
    (first,) = step_at(p, p_clock, 4.0)
    _copy_kv(p, d, p.remote.held_block_ids(req.request_id), claim.block_ids)
    p.remote.release_held(req.request_id)
    d_clock.now = 5.0
    d.remote.complete(req.request_id, first.token_ids[0])
    step_at(d, d_clock, 6.0)
    step_at(d, d_clock, 8.0)
    prefill, decode = p.take_step_stats(), d.take_step_stats()
    assert prefill.prefills == [PrefillDone(2.0, 0.0, 21)]
    assert (prefill.ttfts_s, prefill.finished, prefill.num_generation_tokens) == ([], [], 0)
    assert decode.prefills == []
    assert decode.ttfts_s == [4.0] and decode.inter_token_s == [1.0, 2.0] and decode.num_generation_tokens == 3
    assert decode.finished == [FinishedSeq("length", 7.0, 7.0, 3.0, 21, 3)]


def test_a_failed_transfer_recomputed_locally_is_prefilled_and_timed_on_the_decode_worker() -> None:
    d, clock = clocked()
    d.remote.reserve(request("r", PROMPT, max_tokens=1), lease_s=50.0)
    clock.now = 3.0
    d.remote.fail(RequestId("r"), recompute=True, reason="peer vanished")
    step_at(d, clock, 4.0)
    stats = d.take_step_stats()
    assert stats.prefills == [PrefillDone(4.0, 0.0, 21)] and stats.ttfts_s == [4.0]
