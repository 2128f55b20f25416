"""`CacheRequest`: what the KV cache manager needs to know about one sequence."""
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.ids import BlockHash, RequestId
from pdserve.common.request import DEFAULT_RETENTION_PRIORITY, MultimodalSpan, PriorityRange
from pdserve.kvcache.block_key import BlockHashChain


@dataclass(slots=True)
class CacheRequest:
    """A sequence's identity for the cache: tokens plus every dimension of its block keys.

    `num_claim_tokens` is how many tokens the claim reserves blocks for (default: the whole prompt).
    `priorities` give retention priorities to prompt token ranges; `decode_priority` applies to blocks
    filled by generated tokens. `reuse_cached_prefix` False computes the whole prompt even where
    it is cached (its logits are wanted: prompt logprobs, as vLLM skips its prefix cache for
    them); the blocks it fills are still published for others. `hash_chain` holds the block
    digests: a request's own by default, or its sequence's (`BlockHashChain`), so that the many
    requests built for one sequence hash each block once. Validate with `validate()` before
    handing it to the manager.
    """

    request_id: RequestId
    token_ids: Sequence[int]
    lora_id: int | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalSpan, ...] = ()
    priorities: tuple[PriorityRange, ...] = ()
    decode_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration_s: float | None = None
    num_claim_tokens: int | None = None
    reuse_cached_prefix: bool = True
    hash_chain: BlockHashChain = field(default_factory=BlockHashChain, repr=False, compare=False)

    def validate(self) -> None:
        if len(self.token_ids) == 0:
            raise InvalidRequestError(f"request {self.request_id!r}: token_ids is empty", "prompt")
        if self.num_claim_tokens is not None and not 0 < self.num_claim_tokens <= len(self.token_ids):
            raise InvalidRequestError(f"num_claim_tokens={self.num_claim_tokens} out of 1..{len(self.token_ids)}", "num_claim_tokens")
        _check_priority("decode_priority", self.decode_priority)
        _check_duration("decode_duration_s", self.decode_duration_s)
        _check_ranges(self.priorities)

    def block_hashes(self, tokens_per_block: int) -> list[BlockHash]:
        """Digests of the full blocks of `token_ids`, each hashed once per request (or per sequence)."""
        return self.hash_chain.of(self.token_ids, tokens_per_block, self.lora_id, self.multimodal, self.cache_salt)

    def block_priority(self, begin: int, end: int) -> tuple[int, float | None] | None:
        """Highest explicit priority among ranges overlapping tokens [begin, end), with its duration."""
        best: PriorityRange | None = None
        for r in self.priorities:
            if r.start < end and r.end > begin and (best is None or r.priority > best.priority):
                best = r
        return None if best is None else (best.priority, best.duration_s)


def _check_priority(field_name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= 100:
        raise InvalidRequestError(f"{field_name}={value!r}: retention priority must be an integer in 0..100", field_name)


MAX_DURATION_S = 30 * 24 * 3600.0  # a retention priority's longest duration: 30 days


def _check_duration(field_name: str, value: float | None) -> None:
    if value is not None and not 0 < value <= MAX_DURATION_S:
        raise InvalidRequestError(f"{field_name}={value!r}: duration must be more than 0 and at most "
                                  f"{MAX_DURATION_S:g} seconds", field_name)


def _check_ranges(ranges: tuple[PriorityRange, ...]) -> None:
    for r in ranges:
        _check_priority("priority", r.priority)
        _check_duration("priority.duration", r.duration_s)
        if not 0 <= r.start < r.end:
            raise InvalidRequestError(f"priority range [{r.start}, {r.end}) is empty or negative", "priority")
    ordered = sorted(ranges, key=lambda r: r.start)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise InvalidRequestError(
                f"priority ranges [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap", "priority"
            )
