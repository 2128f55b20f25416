"""The `copy` dataset: prompts asking to repeat a passage of prose, built with the real tokenizer."""
import re

import pytest

from pdserve.bench import copy_text
from pdserve.bench.copy_text import CopyPrompts
from pdserve.bench.datasets import DatasetSpec, build_dataset
from pdserve.bench.options import parse_config
from pdserve.common.errors import ConfigError

WORD_LISTS = ("NAMES", "PEOPLE", "THINGS", "THING_ADJECTIVES", "PLACES", "PLACE_ADJECTIVES", "VERBS", "PREPOSITIONS",
              "TIMES", "ADVERBS", "ERRANDS", "SAYINGS")
GLUE = {"the", "was", "and", "to", "walked", "gave", "so", "when", "came", "back", "from", "gone", "told", "that"}


def num_tokens(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def copy_spec(**fields):
    return DatasetSpec(**{"name": "copy", "num_prompts": 4, "copy_input_len": 200, "copy_output_len": 64, **fields})


def passage_of(text):
    """The passage between the instruction's parts, after checking the prompt ends with its first words."""
    assert text.startswith(CopyPrompts.HEAD)
    passage, lead = text[len(CopyPrompts.HEAD):].split(CopyPrompts.TAIL)
    assert lead == " ".join(passage.split()[:3])
    return passage


def vocabulary():
    words = {word.lower() for name in WORD_LISTS for phrase in getattr(copy_text, name) for word in phrase.split()}
    return words | GLUE


@pytest.mark.parametrize("input_len", [30, 31, 100, 200, 1500])
def test_prompts_encode_to_exactly_the_input_len(tokenizer, input_len):
    conversations = build_dataset(copy_spec(copy_input_len=input_len), tokenizer, seed=input_len)
    turns = [c.turns[0] for c in conversations]
    assert [len(c.turns) for c in conversations] == [1] * 4
    assert [num_tokens(tokenizer, t.text) for t in turns] == [input_len] * 4
    assert [(t.num_tokens, t.max_tokens) for t in turns] == [(input_len, 64)] * 4


def test_the_passage_is_prose_filling_all_but_the_instruction(tokenizer):
    instruction = num_tokens(tokenizer, CopyPrompts.HEAD) + num_tokens(tokenizer, CopyPrompts.TAIL)
    known = vocabulary()
    for conversation in build_dataset(copy_spec(copy_input_len=300), tokenizer, seed=0):
        passage = passage_of(conversation.turns[0].text)
        lead = " ".join(passage.split()[:3])
        assert num_tokens(tokenizer, passage) == 300 - instruction - num_tokens(tokenizer, lead)
        words = re.findall(r"[A-Za-z]+", passage)[:-1]  # the last may be cut inside a word
        assert len(words) > 150 and [w for w in words if w.lower() not in known] == []
        assert len(set(words)) > 50


def test_every_prompt_has_its_own_passage(tokenizer):
    passages = [passage_of(c.turns[0].text) for c in build_dataset(copy_spec(num_prompts=8), tokenizer, seed=0)]
    assert len({p[:80] for p in passages}) == 8  # no shared prefix a cache could serve


def test_same_seed_same_prompts_other_seed_differs(tokenizer):
    assert build_dataset(copy_spec(), tokenizer, seed=5) == build_dataset(copy_spec(), tokenizer, seed=5)
    assert build_dataset(copy_spec(), tokenizer, seed=5) != build_dataset(copy_spec(), tokenizer, seed=6)


@pytest.mark.parametrize("spec, field", [
    (copy_spec(copy_input_len=24), "--copy-input-len"),  # the instruction, and fewer tokens than 3 words
    (copy_spec(copy_input_len=-1), "--copy-input-len"),
    (copy_spec(copy_output_len=0), "--copy-output-len"),
])
def test_bad_lengths_name_the_flag(tokenizer, spec, field):
    with pytest.raises(ConfigError) as info:
        build_dataset(spec, tokenizer, seed=0)
    assert info.value.field == field


def test_flags_reach_the_spec():
    config = parse_config(["--dataset-name", "copy", "--copy-input-len", "300", "--copy-output-len", "96"])
    assert (config.dataset.name, config.dataset.copy_input_len, config.dataset.copy_output_len) == ("copy", 300, 96)
