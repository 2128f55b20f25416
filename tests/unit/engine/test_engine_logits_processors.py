"""The engine hands each sequence's tokens to the logits processors (exact outputs on the
token-store stand-in model, whose greedy next token is `next_token(context)`)."""
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from tests.unit.engine.token_store_runner import VOCAB, CharTokenizer, TokenStoreRunner, next_token, reference

PROMPT = [5, 6, 7]


def run(*requests: GenerationRequest) -> dict[str, tuple[list[int], str, str]]:
    """Per request id: (tokens, text, finish reason)."""
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=4), 64)
    engine = LLMEngine(TokenStoreRunner(64, 4), kv, CharTokenizer(), SchedulerConfig(8, 256, 128))
    for r in requests:
        engine.add_request(r)
    results: dict[str, tuple[list[int], str, str]] = {r.request_id: ([], "", "") for r in requests}
    for _ in range(500):
        if not engine.has_work:
            break
        for out in engine.step():
            tokens, text, _ = results[out.request_id]
            results[out.request_id] = (tokens + list(out.token_ids), text + out.text, out.finish_reason or "")
    assert not engine.has_work and kv.num_used_blocks == 0
    return results


def greedy(rid: str, max_tokens: int = 8, **kw: object) -> GenerationRequest:
    return GenerationRequest(RequestId(rid), tuple(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def test_min_tokens_holds_back_a_stop_token_id_and_ignores_stop_strings_in_its_first_tokens():
    first = reference(PROMPT, 1, eos=None)[0]
    char = CharTokenizer().decode([first])
    got = run(greedy("plain", stop_token_ids=(first,)), greedy("held", stop_token_ids=(first,), min_tokens=3),
              greedy("cut", stop=(char,)), greedy("string", stop=(char,), min_tokens=1))
    assert got["plain"] == ([first], "", "stop")  # a stop token id shows only with include_stop_str_in_output
    tokens, _, _ = got["held"]
    assert first not in tokens[:3] and len(tokens) >= 3
    assert got["cut"] == ([first], "", "stop")
    assert got["string"][0][0] == first and got["string"][1].startswith(char)  # not looked for in token 1


def test_logit_bias_and_bad_words_change_greedy_tokens_every_step():
    ref = reference(PROMPT, 6, eos=None)
    forced = (ref[0] + 1) % VOCAB
    got = run(greedy("bias", max_tokens=6, logit_bias=((forced, 100.0),), ignore_eos=True),
              greedy("banned", max_tokens=6, bad_words=((ref[0],),), ignore_eos=True))
    assert got["bias"][0] == [forced] * 6
    banned = got["banned"][0]
    assert ref[0] not in banned and banned != ref


def test_frequency_penalty_reads_the_sequences_own_output():
    """A token a row generated is penalised by exactly its count: the penalised rerun equals a
    greedy walk that subtracts 2 × count from the stand-in's logits (+10 winner, -10 others)."""
    got = run(greedy("pen", max_tokens=10, frequency_penalty=2.0, ignore_eos=True))["pen"][0]
    context, expected = list(PROMPT), []
    for _ in range(10):
        logits = [-10.0] * VOCAB
        logits[next_token(context)] = 10.0
        scores = [v - 2.0 * expected.count(t) for t, v in enumerate(logits)]
        expected.append(max(range(VOCAB), key=lambda t: (scores[t], -t)))
        context.append(expected[-1])
    assert got == expected


def test_processor_params_outside_the_vocabulary_are_refused_at_admission():
    kv = KvCacheManager(KvCacheConfig(tokens_per_block=4), 16)
    engine = LLMEngine(TokenStoreRunner(16, 4), kv, CharTokenizer(), SchedulerConfig(8, 256, 128))
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request(greedy("x", logit_bias=((VOCAB, 1.0),)))
    assert caught.value.param == "logit_bias" and not engine.has_work
