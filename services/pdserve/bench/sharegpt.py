"""ShareGPT-format conversations from a JSON file, filtered the way `vllm bench serve` does.

The file is a JSON list of `{"conversations": [{"from": ..., "value": ...}, ...]}`. The
first message is the prompt; the second's token count is the requested output length
unless a fixed output length is given. Pairs outside the usual bounds are skipped.
"""
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.common.errors import ConfigError

MIN_TOKENS = 4  # prompts and outputs shorter than this are skipped
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


def _read_entries(path: str) -> list:
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("--dataset-path", path, f"cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("--dataset-path", path, f"not a JSON file: {exc}") from None
    if not isinstance(entries, list):
        raise ConfigError("--dataset-path", path, "expected a JSON list of conversations")
    return entries


def _first_exchange(entry: object) -> tuple[str, str] | None:
    """(prompt, reference answer) of one entry, or None when it has fewer than two messages."""
    if not isinstance(entry, dict):
        return None
    messages = entry.get("conversations") or []
    if len(messages) < 2 or not all(isinstance(m, dict) for m in messages[:2]):
        return None
    prompt, answer = messages[0].get("value"), messages[1].get("value")
    if not isinstance(prompt, str) or not isinstance(answer, str):
        return None
    return prompt, answer


def _is_valid(prompt_len: int, output_len: int, is_output_fixed: bool) -> bool:
    if prompt_len < MIN_TOKENS or (not is_output_fixed and output_len < MIN_TOKENS):
        return False
    return prompt_len <= MAX_PROMPT_TOKENS and prompt_len + output_len <= MAX_TOTAL_TOKENS


def load_sharegpt(
    path: str,
    count_tokens: Callable[[str], int],
    num_prompts: int,
    fixed_output_len: int | None,
    rng: np.random.Generator,
) -> list[tuple[str, int, int]]:
    """`num_prompts` (prompt, prompt tokens, output tokens), in an order shuffled by `rng`.

    Raises ConfigError when the file is unreadable or has too few usable conversations.
    """
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ConfigError("--sharegpt-output-len", fixed_output_len, "must be at least 1")
    entries = _read_entries(path)
    chosen = []
    for index in rng.permutation(len(entries)).tolist():
        if len(chosen) == num_prompts:
            break
        exchange = _first_exchange(entries[index])
        if exchange is None:
            continue
        prompt, answer = exchange
        prompt_len = count_tokens(prompt)
        output_len = fixed_output_len or count_tokens(answer)
        if _is_valid(prompt_len, output_len, fixed_output_len is not None):
            chosen.append((prompt, prompt_len, output_len))
    if len(chosen) < num_prompts:
        raise ConfigError("--dataset-path", path,
                          f"only {len(chosen)} usable conversations, --num-prompts={num_prompts}")
    return chosen
