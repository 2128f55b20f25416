"""n-gram lookup: the longest recurring suffix within the window, its latest earlier occurrence,
token-aligned matches only, and nothing when no suffix recurs."""
import random

import pytest

from pdserve.engine.spec.ngram import NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    lookup = NgramProposer(1, 3)
    assert lookup.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert lookup.propose([7, 1, 2, 8, 1, 2, 9, 0, 1, 2], 2) == [9, 0]  # the latest of two occurrences
    assert lookup.propose([5, 3, 4, 6, 1, 2, 3, 4], 2) == [6, 1]  # "3 4" recurs, "2 3 4" does not


def test_nothing_when_no_suffix_recurs_or_nothing_is_asked() -> None:
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5], 3) == []
    assert NgramProposer(1, 4).propose([1, 2, 1], 0) == []
    assert NgramProposer(1, 2).propose([1], 3) == []


def test_a_match_across_token_boundaries_is_not_a_match() -> None:
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: the bytes of [1, 0] occur inside [256, 0, ...]
    # at an offset of one byte, which must not count.
    assert NgramProposer(2, 2).propose([256, 0, 0, 5, 1, 0], 2) == []
    assert NgramProposer(2, 2).propose([256, 0, 0, 5, 1, 0, 7, 256, 0], 2) == [0, 5]


@pytest.mark.parametrize("seed", range(20))
def test_equals_a_plain_search(seed) -> None:
    rng = random.Random(seed)
    tokens = [rng.choice([0, 1, 2, 256, 65536, 70000]) for _ in range(rng.randint(2, 60))]
    low = rng.randint(1, 3)
    high = rng.randint(low, 5)
    assert NgramProposer(low, high).propose(tokens, 4) == brute_force(tokens, 4, low, high)
