"""What the KV cache manager answers and keeps per sequence: a prefix analysis, a claim's
result, and the record of a claimed sequence (`manager.py`)."""
from dataclasses import dataclass

from pdserve.common.ids import BlockHash, BlockId, RequestId
from pdserve.common.request import DEFAULT_RETENTION_PRIORITY
from pdserve.kvcache.block import KvBlock
from pdserve.kvcache.request import CacheRequest


@dataclass(frozen=True, slots=True)
class PrefixAnalysis:
    """Everything the scheduler needs about one pending request, from one walk of the cache."""

    num_cached_blocks: int
    num_cached_tokens: int
    num_cached_by_tier: tuple[int, ...]  # indexed by Tier
    num_onboard_blocks: int  # cached blocks in a lower tier: each needs a device block and a copy
    num_new_blocks: int  # blocks the claim must still allocate (onboarded ones included)
    num_available_blocks: int  # free or evictable, not counting this request's matches
    fits: bool


@dataclass(frozen=True, slots=True)
class ClaimResult:
    request_id: RequestId
    block_ids: tuple[BlockId, ...]
    num_cached_tokens: int


@dataclass(slots=True)
class ClaimedSequence:
    """A claimed sequence. Its tokens and block digests are its request's (`token_ids`,
    `hash_chain`): the list its owner keeps, never a copy, so each is held and hashed once."""
    request: CacheRequest
    blocks: list[KvBlock]
    num_computed_tokens: int
    num_published: int = 0  # blocks [0, num_published) are settled in the cache (or never will be)
    num_claimed_tokens: int = 0  # the tokens it was claimed with; blocks past them hold generated ones

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids  # a list: `_admit` makes it one

    @property
    def hashes(self) -> list[BlockHash]:
        """The digests of the full blocks hashed so far (see `publishing.py`)."""
        return self.request.hash_chain.hashes

    def block_priority(self, i: int, tokens_per_block: int) -> tuple[int, float | None]:
        """Block `i`'s retention priority and its duration (None: for good): the highest explicit
        one over its claimed tokens, else the default; a block of generated tokens, the decode one."""
        begin = i * tokens_per_block
        if begin < self.num_claimed_tokens:
            explicit = self.request.block_priority(begin, begin + tokens_per_block)
            return explicit if explicit is not None else (DEFAULT_RETENTION_PRIORITY, None)
        return self.request.decode_priority, self.request.decode_duration_s
