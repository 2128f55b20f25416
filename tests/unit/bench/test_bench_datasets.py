"""Datasets built with the default model's real tokenizer: exact token counts, seeds."""
import json

import numpy as np
import pytest

from pdserve.bench.datasets import DatasetSpec, build_dataset, warmup_conversations
from pdserve.bench.prompts import RandomText
from pdserve.common.errors import ConfigError


def num_tokens(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("count", [1, 7, 64, 300])
def test_random_text_encodes_to_exactly_the_requested_count(tokenizer, count):
    texts = RandomText(tokenizer, np.random.default_rng(count))
    assert num_tokens(tokenizer, texts.text(count)) == count


def test_random_text_has_no_special_tokens_or_broken_characters(tokenizer):
    text = RandomText(tokenizer, np.random.default_rng(0)).text(3000)
    ids = tokenizer.encode(text, add_special_tokens=False)
    special = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    assert [i for i in ids if i in special] == []
    assert ("\ufffd" in text, "<|" in text) == (False, False)


def test_random_text_counts_the_seam_with_its_head(tokenizer):
    texts = RandomText(tokenizer, np.random.default_rng(0))
    head = texts.text(40)
    tail = texts.text(25, head=head)
    assert num_tokens(tokenizer, head + tail) == 65


def test_random_prompts_have_exact_lengths_and_a_shared_prefix(tokenizer):
    spec = DatasetSpec(name="random", num_prompts=6, random_input_len=40, random_output_len=8,
                       random_prefix_len=16, random_range_ratio=0.5)
    conversations = build_dataset(spec, tokenizer, seed=1)
    turns = [c.turns[0] for c in conversations]
    assert [len(c.turns) for c in conversations] == [1] * 6
    assert [num_tokens(tokenizer, t.text) for t in turns] == [t.num_tokens for t in turns]
    assert all(36 <= t.num_tokens <= 76 for t in turns)  # 16 + [20, 60]
    assert all(4 <= t.max_tokens <= 12 for t in turns)
    prefix = tokenizer.decode(tokenizer.encode(turns[0].text, add_special_tokens=False)[:16])
    assert all(t.text.startswith(prefix) for t in turns)


def test_same_seed_same_dataset_other_seed_differs(tokenizer):
    spec = DatasetSpec(name="random", num_prompts=3, random_input_len=20, random_output_len=4)
    assert build_dataset(spec, tokenizer, seed=5) == build_dataset(spec, tokenizer, seed=5)
    assert build_dataset(spec, tokenizer, seed=5) != build_dataset(spec, tokenizer, seed=6)


def test_shared_prefix_is_n_prefixes_times_m_questions(tokenizer):
    spec = DatasetSpec(name="shared-prefix", num_prompts=6, num_prefixes=2, prefix_len=30,
                       suffix_len=10, prefix_output_len=5)
    conversations = build_dataset(spec, tokenizer, seed=0)
    by_prefix = {}
    for c in conversations:
        by_prefix.setdefault(c.system, []).append(c.turns[0])
    assert sorted(len(questions) for questions in by_prefix.values()) == [3, 3]
    assert [num_tokens(tokenizer, p) for p in by_prefix] == [30, 30]
    for prefix, questions in by_prefix.items():
        assert [num_tokens(tokenizer, prefix + q.text) for q in questions] == [40, 40, 40]
        assert [(q.num_tokens, q.max_tokens) for q in questions] == [(10, 5)] * 3
    assert all(c.system_tokens == 30 for c in conversations)


def test_multi_turn_conversations_have_every_turn(tokenizer):
    spec = DatasetSpec(name="multi-turn", num_prompts=2, num_turns=3, turn_input_len=12, turn_output_len=6)
    conversations = build_dataset(spec, tokenizer, seed=0)
    assert [len(c.turns) for c in conversations] == [3, 3]
    turns = [t for c in conversations for t in c.turns]
    assert [(num_tokens(tokenizer, t.text), t.num_tokens, t.max_tokens) for t in turns] == [(12, 12, 6)] * 6


def write_sharegpt(path, rows):
    path.write_text(json.dumps([{"id": str(i), "conversations": row} for i, row in enumerate(rows)]))


def exchange(prompt, answer):
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]


def test_sharegpt_takes_the_first_exchange_and_skips_short_or_broken_ones(tokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    long_prompt = "Explain in detail how a paged key value cache stores tokens."
    long_answer = "It splits the cache into fixed size blocks and keeps a table per sequence."
    write_sharegpt(path, [exchange(long_prompt, long_answer), exchange("Hi", long_answer),
                          [{"from": "human", "value": long_prompt}], exchange(long_answer, long_prompt)])
    spec = DatasetSpec(name="sharegpt", num_prompts=2, path=str(path))
    turns = sorted((c.turns[0] for c in build_dataset(spec, tokenizer, seed=0)), key=lambda t: t.text)
    assert [t.text for t in turns] == sorted([long_prompt, long_answer])
    counts = {long_prompt: num_tokens(tokenizer, long_prompt), long_answer: num_tokens(tokenizer, long_answer)}
    assert [(t.num_tokens, t.max_tokens) for t in turns] == [
        (counts[t.text], counts[long_prompt if t.text == long_answer else long_answer]) for t in turns]
    fixed = DatasetSpec(name="sharegpt", num_prompts=1, path=str(path), sharegpt_output_len=9)
    assert build_dataset(fixed, tokenizer, seed=0)[0].turns[0].max_tokens == 9


def test_sharegpt_with_too_few_conversations_names_the_file(tokenizer, tmp_path):
    path = tmp_path / "small.json"
    write_sharegpt(path, [exchange("Explain how blocks are evicted from a cache.", "Lowest priority first.")])
    with pytest.raises(ConfigError) as info:
        build_dataset(DatasetSpec(name="sharegpt", num_prompts=2, path=str(path)), tokenizer, seed=0)
    assert (info.value.field, info.value.value) == ("--dataset-path", str(path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON file"):
        build_dataset(DatasetSpec(name="sharegpt", num_prompts=1, path=str(tmp_path / "bad.json")), tokenizer, 0)


@pytest.mark.parametrize("spec, field", [
    (DatasetSpec(name="nope"), "--dataset-name"),
    (DatasetSpec(num_prompts=0), "--num-prompts"),
    (DatasetSpec(name="sharegpt"), "--dataset-path"),
    (DatasetSpec(name="shared-prefix", num_prompts=7, num_prefixes=2), "--prefix-repetition-num-prefixes"),
    (DatasetSpec(random_range_ratio=1.0), "--random-range-ratio"),
    (DatasetSpec(random_input_len=-1), "--random-input-len"),
    (DatasetSpec(random_output_len=0), "--random-output-len"),
    (DatasetSpec(name="multi-turn", num_turns=0), "--multi-turn-num-turns"),
])
def test_bad_spec_names_the_flag(tokenizer, spec, field):
    with pytest.raises(ConfigError) as info:
        build_dataset(spec, tokenizer, seed=0)
    assert info.value.field == field


def test_warmups_copy_shapes_with_fresh_text(tokenizer):
    spec = DatasetSpec(name="shared-prefix", num_prompts=2, num_prefixes=1, prefix_len=20, suffix_len=5,
                       prefix_output_len=3)
    conversations = build_dataset(spec, tokenizer, seed=0)
    warmups = warmup_conversations(conversations, 3, tokenizer, seed=0)
    assert [(w.system, w.turns[0].num_tokens, w.turns[0].max_tokens) for w in warmups] == [("", 25, 3)] * 3
    assert [num_tokens(tokenizer, w.turns[0].text) for w in warmups] == [25, 25, 25]
    assert not any(conversations[0].system in w.turns[0].text for w in warmups)
