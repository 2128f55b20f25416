"""`KvCacheConfig`: the KV cache's knobs, named after TensorRT-LLM's KvCacheConfig."""
from dataclasses import dataclass

from pdserve.common.errors import ConfigError

EVICTION_POLICIES = ("priority", "lru")


@dataclass(frozen=True, slots=True)
class KvCacheConfig:
    """Capacity, block and offload settings. Validated on construction.

    Capacity is the smallest of the limits that are set: `max_tokens`, `max_total_bytes`, and
    `free_memory_fraction` of the memory the caller reports as available.
    """

    max_tokens: int | None = None
    max_total_bytes: int | None = None
    free_memory_fraction: float = 0.9
    tokens_per_block: int = 16
    enable_block_reuse: bool = True
    host_cache_size: int = 0  # bytes of host DRAM for offloaded blocks; 0 = no host tier
    secondary_offload_min_priority: int = 35  # only blocks at or above this priority move down
    event_buffer_max_size: int = 10_000  # 0 disables events
    eviction_policy: str = "priority"  # "priority" (retention priority, then LRU) or "lru"

    def __post_init__(self) -> None:
        tpb = self.tokens_per_block
        if not isinstance(tpb, int) or tpb < 1 or tpb & (tpb - 1):
            raise ConfigError("tokens_per_block", tpb, "must be a positive power of two")
        _check_optional_positive("max_tokens", self.max_tokens)
        _check_optional_positive("max_total_bytes", self.max_total_bytes)
        if not 0.0 < self.free_memory_fraction <= 1.0:
            raise ConfigError("free_memory_fraction", self.free_memory_fraction, "must be in (0, 1]")
        if self.host_cache_size < 0:
            raise ConfigError("host_cache_size", self.host_cache_size, "must be >= 0")
        if not 0 <= self.secondary_offload_min_priority <= 100:
            raise ConfigError(
                "secondary_offload_min_priority", self.secondary_offload_min_priority, "must be in 0..100"
            )
        if self.event_buffer_max_size < 0:
            raise ConfigError("event_buffer_max_size", self.event_buffer_max_size, "must be >= 0")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError("eviction_policy", self.eviction_policy, f"must be one of {EVICTION_POLICIES}")

    def num_blocks(self, bytes_per_block: int, available_bytes: int | None = None) -> int:
        """Blocks that fit under every limit that is set; at least one limit must be known."""
        if bytes_per_block <= 0:
            raise ConfigError("bytes_per_block", bytes_per_block, "must be > 0")
        limits = []
        if self.max_tokens is not None:
            limits.append(self.max_tokens // self.tokens_per_block)
        if self.max_total_bytes is not None:
            limits.append(self.max_total_bytes // bytes_per_block)
        if available_bytes is not None:
            limits.append(int(available_bytes * self.free_memory_fraction) // bytes_per_block)
        if not limits:
            raise ConfigError("max_tokens", None, "set max_tokens or max_total_bytes, or pass available memory")
        num = min(limits)
        if num < 1:
            raise ConfigError("max_tokens", self.max_tokens, f"capacity holds {num} blocks; need at least 1")
        return num


def _check_optional_positive(field: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise ConfigError(field, value, "must be a positive integer or unset")
