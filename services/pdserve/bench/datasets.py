"""What the benchmark sends: conversations of one or more turns, built from a seed.

Every dataset is a list of `Conversation`s; single-turn datasets have one turn each.
Token counts are those of the served model's tokenizer. The same spec, tokenizer and
seed always build the same list.
"""
import math
from dataclasses import dataclass

import numpy as np

from pdserve.bench.copy_text import CopyPrompts
from pdserve.bench.prompts import RandomText, TextTokenizer
from pdserve.bench.sharegpt import load_sharegpt
from pdserve.common.errors import ConfigError

DATASET_NAMES = ("random", "shared-prefix", "multi-turn", "sharegpt", "copy")
DATASET_ALIASES = {"prefix_repetition": "shared-prefix"}  # vLLM's name for the same workload
WARMUP_STREAM = 2  # warm-up text is drawn from its own stream of the run's seed


@dataclass(frozen=True, slots=True)
class Turn:
    text: str  # the user's message (or completion prompt) of this turn
    num_tokens: int
    max_tokens: int  # requested output length


@dataclass(frozen=True, slots=True)
class Conversation:
    """Turns sent one after another, each resending the history so far.

    `system` is a shared prefix: a system message on chat, prepended text on completions.
    """

    turns: tuple[Turn, ...]
    system: str = ""
    system_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str = "random"
    num_prompts: int = 1000
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    num_prefixes: int = 10
    prefix_len: int = 256
    suffix_len: int = 256
    prefix_output_len: int = 128
    num_turns: int = 3
    turn_input_len: int = 128
    turn_output_len: int = 64
    sharegpt_output_len: int | None = None
    copy_input_len: int = 512
    copy_output_len: int = 128


def check_spec(spec: DatasetSpec) -> None:
    """Raise ConfigError naming the first flag whose value cannot build a dataset."""
    if spec.name not in DATASET_NAMES:
        raise ConfigError("--dataset-name", spec.name, f"choose from {', '.join(DATASET_NAMES)}")
    if spec.num_prompts < 1:
        raise ConfigError("--num-prompts", spec.num_prompts, "must be at least 1")
    if spec.name == "sharegpt" and not spec.path:
        raise ConfigError("--dataset-path", spec.path, "the sharegpt dataset needs a JSON file")
    if spec.name == "shared-prefix" and (spec.num_prefixes < 1 or spec.num_prompts % spec.num_prefixes):
        raise ConfigError("--prefix-repetition-num-prefixes", spec.num_prefixes,
                          f"must be >= 1 and divide --num-prompts={spec.num_prompts}")
    if spec.num_turns < 1:
        raise ConfigError("--multi-turn-num-turns", spec.num_turns, "must be at least 1")
    _check_lengths(spec)


def _check_lengths(spec: DatasetSpec) -> None:
    if not 0.0 <= spec.random_range_ratio < 1.0:
        raise ConfigError("--random-range-ratio", spec.random_range_ratio, "must be in [0, 1)")
    lengths = {
        "--random-input-len": spec.random_input_len, "--random-output-len": spec.random_output_len,
        "--random-prefix-len": spec.random_prefix_len, "--prefix-repetition-prefix-len": spec.prefix_len,
        "--prefix-repetition-suffix-len": spec.suffix_len, "--multi-turn-input-len": spec.turn_input_len,
        "--copy-input-len": spec.copy_input_len,
    }
    for flag, value in lengths.items():
        if value < 0:
            raise ConfigError(flag, value, "must be >= 0")
    outputs = {"--random-output-len": spec.random_output_len, "--prefix-repetition-output-len":
               spec.prefix_output_len, "--multi-turn-output-len": spec.turn_output_len,
               "--copy-output-len": spec.copy_output_len}
    for flag, value in outputs.items():
        if value < 1:
            raise ConfigError(flag, value, "must be at least 1")


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, size: int) -> list[int]:
    """Integers uniform in [floor(mean*(1-ratio)), ceil(mean*(1+ratio))]."""
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return rng.integers(low, high + 1, size=size).tolist()


def _random(spec: DatasetSpec, texts: RandomText) -> list[Conversation]:
    """Optional shared prefix of `random_prefix_len` tokens, then a random body."""
    input_lens = _uniform_lengths(texts.rng, spec.random_input_len, spec.random_range_ratio, spec.num_prompts)
    output_lens = _uniform_lengths(texts.rng, spec.random_output_len, spec.random_range_ratio, spec.num_prompts)
    prefix = texts.text(spec.random_prefix_len)
    conversations = []
    for input_len, output_len in zip(input_lens, output_lens):
        body = texts.text(input_len, head=prefix)
        turn = Turn(prefix + body, spec.random_prefix_len + input_len, max(1, output_len))
        conversations.append(Conversation((turn,)))
    return conversations


def _shared_prefix(spec: DatasetSpec, texts: RandomText) -> list[Conversation]:
    """`num_prefixes` system prompts x (num_prompts / num_prefixes) questions each, shuffled."""
    conversations = []
    for _ in range(spec.num_prefixes):
        prefix = texts.text(spec.prefix_len)
        for _ in range(spec.num_prompts // spec.num_prefixes):
            question = texts.text(spec.suffix_len, head=prefix)
            turn = Turn(question, spec.suffix_len, spec.prefix_output_len)
            conversations.append(Conversation((turn,), prefix, spec.prefix_len))
    order = texts.rng.permutation(len(conversations)).tolist()
    return [conversations[i] for i in order]


def _multi_turn(spec: DatasetSpec, texts: RandomText) -> list[Conversation]:
    """Conversations of `num_turns` user messages; the answers come from the server."""
    return [
        Conversation(tuple(
            Turn(texts.text(spec.turn_input_len), spec.turn_input_len, spec.turn_output_len)
            for _ in range(spec.num_turns)
        ))
        for _ in range(spec.num_prompts)
    ]


def _sharegpt(spec: DatasetSpec, texts: RandomText) -> list[Conversation]:
    pairs = load_sharegpt(spec.path, texts.num_tokens, spec.num_prompts, spec.sharegpt_output_len, texts.rng)
    return [Conversation((Turn(prompt, prompt_len, output_len),)) for prompt, prompt_len, output_len in pairs]


def _copy(spec: DatasetSpec, texts: RandomText) -> list[Conversation]:
    """A passage of prose each, to be repeated: outputs that repeat spans of their prompts."""
    prompts = CopyPrompts(texts)
    return [Conversation((Turn(prompts.prompt(spec.copy_input_len), spec.copy_input_len, spec.copy_output_len),))
            for _ in range(spec.num_prompts)]


_BUILDERS = {"random": _random, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn, "sharegpt": _sharegpt,
             "copy": _copy}


def build_dataset(spec: DatasetSpec, tokenizer: TextTokenizer, seed: int) -> list[Conversation]:
    """Build `spec.num_prompts` conversations; raises ConfigError naming the bad flag."""
    check_spec(spec)
    texts = RandomText(tokenizer, np.random.default_rng(seed))
    return _BUILDERS[spec.name](spec, texts)


def canonical_dataset_name(name: str) -> str:
    return DATASET_ALIASES.get(name, name)


def warmup_conversations(
    conversations: list[Conversation], num_warmups: int, tokenizer: TextTokenizer, seed: int
) -> list[Conversation]:
    """Single-turn random requests shaped like the first turns of `conversations` (cycled),
    with fresh text so that warm-up leaves nothing in a prefix cache the run could reuse."""
    texts = RandomText(tokenizer, np.random.default_rng([seed, WARMUP_STREAM]))
    warmups = []
    for i in range(num_warmups):
        source = conversations[i % len(conversations)]
        first = source.turns[0]
        num_tokens = source.system_tokens + first.num_tokens
        warmups.append(Conversation((Turn(texts.text(num_tokens), num_tokens, first.max_tokens),)))
    return warmups
