"""Torch-free KV cache bookkeeping: block keys, pool, priority eviction, tiers, events.

The public surface is `KvCacheManager` with `KvCacheConfig`, `CacheRequest` and the event types.
"""
from pdserve.kvcache.block import Tier
from pdserve.kvcache.block_key import HASH_ALGORITHM, BlockHashChain, hash_block_tokens, hash_request_blocks
from pdserve.kvcache.config import KvCacheConfig
from pdserve.kvcache.events import AllCleared, BlockRemoved, BlockStored, BlockUpdated, KvEvent
from pdserve.kvcache.manager import ClaimResult, IntegrityError, KvCacheManager, PrefixAnalysis
from pdserve.kvcache.request import CacheRequest

__all__ = [
    "HASH_ALGORITHM", "AllCleared", "BlockHashChain", "BlockRemoved", "BlockStored", "BlockUpdated", "CacheRequest",
    "ClaimResult", "IntegrityError", "KvCacheConfig", "KvCacheManager", "KvEvent", "PrefixAnalysis",
    "Tier", "hash_block_tokens", "hash_request_blocks",
]
