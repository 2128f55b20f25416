"""Guided sampling over random logits with the bundled model's real tokenizer: whatever the
logits, every finished output is in the guide's language."""
import json
import threading
import re

import jsonschema
import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.guides import choice_guide, json_schema_guide
from pdserve.common.request import Guide, GuideKind, SamplingParams
from pdserve.engine.model.guided import GuideCompiler
from pdserve.engine.model.sampler import Sampler, SamplingRow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
MAX_STEPS = 80


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer) -> GuideCompiler:
    return GuideCompiler(smollm_tokenizer.to_json(), smollm_tokenizer.vocab_size, smollm_tokenizer.eos_token_ids)


def generate(compiler, tokenizer, guide: Guide, num_rows: int, params: SamplingParams, seed: int = 0) -> list[str]:
    """`num_rows` outputs sampled in one batch from random logits under `guide`, each until its
    guide is complete (the test fails if one is not within MAX_STEPS)."""
    torch.manual_seed(seed)
    sampler = Sampler(seed=seed)
    guides = [compiler.matcher(guide) for _ in range(num_rows)]
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    live = list(range(num_rows))
    for _ in range(MAX_STEPS):
        if not live:
            break
        logits = torch.randn(len(live), tokenizer.vocab_size) * 4  # (L, V)
        sampled = sampler.sample(logits, [SamplingRow(params, None, guides[i]) for i in live])
        for i, token in zip(live, sampled):
            guides[i].accept(token.token_id)
            assert guides[i].error is None
            tokens[i].append(token.token_id)
        live = [i for i in live if not guides[i].is_finished]
    assert not live, f"{len(live)} outputs unfinished after {MAX_STEPS} tokens"
    return [tokenizer.decode(t) for t in tokens]


def test_a_hundred_sampled_outputs_all_validate_against_the_schema(compiler, smollm_tokenizer):
    texts = generate(compiler, smollm_tokenizer, json_schema_guide(SCHEMA), 100, SamplingParams(temperature=1.0))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 50  # sampling, not one forced string


def test_greedy_guided_regex_and_choice(compiler, smollm_tokenizer):
    greedy = SamplingParams(temperature=0.0)
    for text in generate(compiler, smollm_tokenizer, Guide(GuideKind.REGEX, r"[a-z]{2,5}-[0-9]{3}"), 8, greedy):
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text)
    choices = ["red", "green", "deep blue", "ünïcode \"quoted\""]
    texts = generate(compiler, smollm_tokenizer, choice_guide(choices), 40, SamplingParams(temperature=1.0))
    assert set(texts) <= set(choices)
    assert len(set(texts)) > 1


def test_unguided_rows_in_a_guided_batch_keep_their_argmax(compiler):
    torch.manual_seed(1)
    logits = torch.randn(3, compiler._tokenizer.vocab_size)
    guide = compiler.matcher(Guide(GuideKind.REGEX, "x+"))
    greedy = SamplingParams(temperature=0.0)
    before = logits.clone()
    tokens = Sampler().sample(logits, [SamplingRow(greedy), SamplingRow(greedy, None, guide), SamplingRow(greedy)])
    assert [tokens[0].token_id, tokens[2].token_id] == [int(logits[0].argmax()), int(logits[2].argmax())]
    assert torch.equal(logits, before)  # the mask never writes into the model's logits


@pytest.mark.parametrize("guide", [
    Guide(GuideKind.REGEX, "(unclosed"), Guide(GuideKind.JSON_SCHEMA, '{"type": "no-such-type"}'),
    Guide(GuideKind.LARK, "start: missing_rule"),
])
def test_a_guide_that_does_not_compile_is_an_invalid_request(compiler, guide):
    with pytest.raises(InvalidRequestError):
        compiler.matcher(guide)


def test_a_refused_token_leaves_one_line_naming_it(compiler, smollm_tokenizer):
    guide = compiler.matcher(choice_guide(["cat"]))
    (dog,) = smollm_tokenizer.encode("dog", add_special_tokens=False)
    message = guide.advance(dog)
    assert message is not None and "\n" not in message
    assert message.startswith(f"the output's guide refused token {dog} (")
    assert compiler.matcher(choice_guide(["dog"])).advance(dog) is None


def test_a_vanishing_top_p_still_keeps_the_guide_s_only_token(compiler, smollm_tokenizer):
    """top_p=5e-324 is 0 in float32; the nucleus must still hold the best (here: the only
    allowed) token, EOS after a guide that is complete at once."""
    guide = compiler.matcher(Guide(GuideKind.LARK, 'start: ""'))
    logits = torch.randn(1, smollm_tokenizer.vocab_size)
    (token,) = Sampler(seed=0).sample(logits, [SamplingRow(SamplingParams(top_p=5e-324), None, guide)])
    assert token.token_id in smollm_tokenizer.eos_token_ids


def test_a_guide_prepared_on_another_thread_is_not_compiled_again_where_it_is_used(compiler, monkeypatch) -> None:
    """The worker compiles a request's guide off the engine thread (`prepare`); the engine thread's
    `matcher` then only copies it. A guide that does not compile is refused by `prepare`."""
    from pdserve.engine.model import guided

    built: list[str] = []
    real = guided.LLMatcher

    def counting(*args, **kwargs):
        built.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(guided, "LLMatcher", counting)
    guide = json_schema_guide({**SCHEMA, "title": "prepared off the engine thread"})
    preparer = threading.Thread(target=compiler.prepare, args=(guide,), name="preparer")
    preparer.start()
    preparer.join()
    first, second = compiler.matcher(guide), compiler.matcher(guide)
    assert built == ["preparer"] and first is not second
    with pytest.raises(InvalidRequestError, match="invalid guide"):
        compiler.prepare(Guide(GuideKind.REGEX, "(unclosed"))


class _EngineStandIn:
    """What `LLMEngine._guide_matcher` reads of its engine: the guide compiler."""

    def __init__(self, compiler: GuideCompiler) -> None:
        self.compiler = compiler

    def guide_compiler(self) -> GuideCompiler:
        return self.compiler


def test_a_migrated_request_resumes_its_guide_where_its_output_stands(compiler, smollm_tokenizer) -> None:
    from pdserve.common.ids import RequestId
    from pdserve.common.request import GenerationRequest
    from pdserve.engine.core.llm_engine import LLMEngine

    guide = Guide(GuideKind.REGEX, "(abc)+x")
    done = smollm_tokenizer.encode("abcabc", add_special_tokens=False)
    prompt = tuple(smollm_tokenizer.encode("Say it:", add_special_tokens=False))

    def matcher(output_so_far: list[int]):
        params = SamplingParams(max_tokens=4, guide=guide, guide_done_tokens=len(output_so_far))
        request = GenerationRequest(RequestId("r-migrated-0"), prompt + tuple(output_so_far), params)
        return LLMEngine._guide_matcher(_EngineStandIn(compiler), request)

    resumed, fresh = matcher(done), compiler.matcher(guide)
    x = smollm_tokenizer.encode("x", add_special_tokens=False)[0]
    assert resumed.advance(x) is None and resumed.is_finished  # "abcabc" then "x": the whole guide
    assert fresh.advance(x) is not None  # from the start, "x" is refused: the prefix mattered
    with pytest.raises(InvalidRequestError, match="do not follow the guide"):
        matcher(smollm_tokenizer.encode("zzz", add_special_tokens=False))
