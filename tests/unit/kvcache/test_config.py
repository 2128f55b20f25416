import pytest

from pdserve.common.errors import ConfigError
from pdserve.kvcache import KvCacheConfig


@pytest.mark.parametrize("tpb", [0, 3, 12, -4])
def test_tokens_per_block_must_be_power_of_two(tpb):
    with pytest.raises(ConfigError, match=rf"tokens_per_block={tpb}: must be a positive power of two"):
        KvCacheConfig(tokens_per_block=tpb)


@pytest.mark.parametrize("field,value", [
    ("free_memory_fraction", 0.0), ("free_memory_fraction", 1.5), ("max_tokens", 0), ("max_total_bytes", -1),
    ("host_cache_size", -1), ("secondary_offload_min_priority", 101), ("event_buffer_max_size", -1),
    ("eviction_policy", "fifo"),
])
def test_invalid_fields_name_field_and_value(field, value):
    with pytest.raises(ConfigError) as info:
        KvCacheConfig(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}={value!r}")


def test_num_blocks_is_the_smallest_limit():
    cfg = KvCacheConfig(max_tokens=1024, max_total_bytes=10_000, tokens_per_block=16, free_memory_fraction=0.5)
    assert cfg.num_blocks(bytes_per_block=100) == 64  # max_tokens: 1024 / 16
    assert cfg.num_blocks(bytes_per_block=1000) == 10  # max_total_bytes: 10_000 / 1000
    assert cfg.num_blocks(bytes_per_block=100, available_bytes=4000) == 20  # 0.5 * 4000 / 100


def test_num_blocks_needs_a_limit_and_at_least_one_block():
    with pytest.raises(ConfigError, match="max_tokens"):
        KvCacheConfig().num_blocks(bytes_per_block=100)
    with pytest.raises(ConfigError, match="capacity holds 0 blocks"):
        KvCacheConfig(max_tokens=8, tokens_per_block=16).num_blocks(bytes_per_block=100)


def test_config_carries_offload_fields():
    cfg = KvCacheConfig(host_cache_size=1 << 30, secondary_offload_min_priority=50)
    assert (cfg.host_cache_size, cfg.secondary_offload_min_priority) == (1 << 30, 50)
