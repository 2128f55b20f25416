"""The KV tensor's layout and row arithmetic, and the per-step attention plan, with exact values."""
import pytest
import torch

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine.model import decode_attention
from pdserve.engine.model.attention import plan_attention
from pdserve.engine.model.batch import ForwardBatch
from pdserve.engine.model.kv_tensor import (PagedKvCache, allocate_kv_tensor, bytes_per_block, kv_storage_dtype,
                                      num_blocks_for_budget)
from pdserve.engine.loading.model_config import ModelConfig

from model_builders import chunk

CONFIG = ModelConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
})  # per block of 4 tokens: 2 layers * (K, V) * 4 tokens * 2 heads * 16 dims = 512 elements
TPB = 4


def make_cache(num_blocks: int = 8, dtype=torch.float32) -> PagedKvCache:
    return PagedKvCache(allocate_kv_tensor(CONFIG, num_blocks, TPB, dtype), torch.float32)


@pytest.mark.parametrize("dtype, size", [(torch.float32, 2048), (torch.bfloat16, 1024), (torch.float8_e4m3fn, 512)])
def test_bytes_per_block(dtype, size):
    assert bytes_per_block(CONFIG, TPB, dtype) == size
    assert allocate_kv_tensor(CONFIG, 3, TPB, dtype)[1].numel() * dtype.itemsize == size


def test_tensor_is_block_major_and_each_block_contiguous():
    tensor = allocate_kv_tensor(CONFIG, 5, TPB, torch.float32)
    assert tensor.shape == (5, 2, 2, TPB, 2, 16)
    assert tensor[3].is_contiguous()
    assert tensor[3].data_ptr() - tensor.data_ptr() == 3 * 2048


def test_budget_sizing_and_refusals():
    assert num_blocks_for_budget(CONFIG, TPB, torch.float32, 10_000) == 4
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        num_blocks_for_budget(CONFIG, TPB, torch.float32, 2047)
    with pytest.raises(ConfigError, match="tokens_per_block"):
        bytes_per_block(CONFIG, 3, torch.float32)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        kv_storage_dtype("int8", torch.float32)
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn


def test_plan_rows_positions_and_decode_mask():
    cache = make_cache()
    batch = ForwardBatch((chunk("a", [11, 12, 13], 2, [7, 1]), chunk("b", [14], 5, [4, 0])))
    plan = plan_attention(batch, cache, sliding_window=None)
    # token row = block * (2 layers * 2 kinds * 4 slots) + offset
    assert plan.token_rows.tolist() == [7 * 16 + 2, 7 * 16 + 3, 1 * 16 + 0, 0 * 16 + 1]
    assert plan.positions.tolist() == [2, 3, 4, 5]
    [prefill] = plan.chunks
    assert (prefill.tokens, prefill.context_len, prefill.block_rows.tolist()) == (slice(0, 3), 5, [28, 4])
    assert prefill.mask.tolist() == [[True, True, True, False, False],
                                     [True, True, True, True, False],
                                     [True, True, True, True, True]]
    assert plan.decode.token_index.tolist() == [3]
    [group] = plan.decode.groups
    assert group.seqs == slice(0, 1)
    assert group.block_rows.tolist() == [16, 0]  # block row = block * 2 layers * 2 kinds
    assert (group.bias == 0).flatten().tolist() == [True] * 6 + [False] * 2


def test_plan_window_and_fresh_prefill():
    cache = make_cache()
    batch = ForwardBatch((chunk("a", [1, 2, 3], 0, [0]), chunk("b", [4], 6, [1, 2]), chunk("c", [5], 1, [3])))
    plan = plan_attention(batch, cache, sliding_window=3)
    [fresh] = plan.chunks
    assert fresh.block_rows is None  # nothing cached: attends to its own K/V
    assert fresh.mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert plan.decode.token_index.tolist() == [3, 4]
    assert (plan.decode.groups[0].bias == 0).view(2, 8).tolist() == [[False] * 4 + [True] * 3 + [False],
                                                               [True, True] + [False] * 6]
    assert plan_attention(batch, cache, sliding_window=None).chunks[0].mask is None


def test_decode_groups_each_pad_to_their_own_longest_context(monkeypatch):
    monkeypatch.setattr(decode_attention, "GROUP_BYTES", 2 * 2 * 16 * 4 * 9)  # K+V of 9 tokens: 1 sequence
    batch = ForwardBatch((chunk("a", [1], 8, [5, 6, 7]), chunk("b", [2], 1, [3]), chunk("c", [3], 4, [1, 2])))
    plan = plan_attention(batch, make_cache(), sliding_window=None)
    assert plan.decode.token_index is None  # every token is a decode token, in order
    assert [g.seqs for g in plan.decode.groups] == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert [g.block_rows.tolist() for g in plan.decode.groups] == [[20, 24, 28], [12], [4, 8]]
    assert [int((g.bias == 0).sum()) for g in plan.decode.groups] == [9, 2, 5]


def test_write_lands_in_the_slot_and_gather_reads_it_back():
    cache = make_cache()
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)  # (T, kvh, hd)
    rows = torch.tensor([6 * 16 + 1, 2 * 16 + 3])  # (block 6, slot 1), (block 2, slot 3)
    cache.write(1, k, v, rows)
    assert torch.equal(cache.tensor[6, 1, 0, 1], k[0]) and torch.equal(cache.tensor[6, 1, 1, 1], v[0])
    assert torch.equal(cache.tensor[2, 1, 0, 3], k[1]) and torch.equal(cache.tensor[2, 1, 1, 3], v[1])
    assert int(cache.tensor[:, 0].count_nonzero()) == 0  # layer 0 untouched
    gathered_k, gathered_v = (x.flatten(0, 1) for x in cache.gather_blocks(1, torch.tensor([2 * 4, 6 * 4])))
    assert gathered_k.shape == (2 * TPB, 2, 16)
    assert torch.equal(gathered_k[3], k[1]) and torch.equal(gathered_k[5], k[0])
    assert torch.equal(gathered_v[3], v[1]) and torch.equal(gathered_v[5], v[0])


def test_fp8_round_trip_exact_for_representable_values_and_saturating():
    cache = PagedKvCache(allocate_kv_tensor(CONFIG, 4, TPB, torch.float8_e4m3fn), torch.float32, scale=2.0)
    k = torch.tensor([1.0, -3.0, 0.25, 1000.0]).repeat(8).view(1, 2, 16)
    cache.write(0, k, -k, torch.tensor([3 * 16]))
    gathered_k, gathered_v = (cache.values_in_compute_dtype(x, name) * cache.value_scale
                              for x, name in zip(cache.gather_blocks(0, torch.tensor([3 * 4])), "kv"))
    expected = torch.tensor([1.0, -3.0, 0.25, 896.0]).repeat(8).view(2, 16)  # 448 * scale 2 at most
    assert torch.equal(gathered_k[0, 0], expected) and torch.equal(gathered_v[0, 0], -expected)
    with pytest.raises(ConfigError, match="kv_scale"):
        PagedKvCache(cache.tensor, torch.float32, scale=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_blocks_copies_every_layer(dtype):
    cache = make_cache(dtype=dtype)
    cache.tensor.view(torch.uint8)[1] = 7
    cache.tensor.view(torch.uint8)[2] = 9
    cache.copy_blocks([1, 2], [5, 6])
    assert torch.equal(cache.tensor.view(torch.uint8)[5], cache.tensor.view(torch.uint8)[1])
    assert torch.equal(cache.tensor.view(torch.uint8)[6], cache.tensor.view(torch.uint8)[2])
    assert int(cache.tensor.view(torch.uint8)[[0, 3, 4, 7]].count_nonzero()) == 0


@pytest.mark.parametrize("src, dst, param", [([1], [2, 3], "dst_ids"), ([1, 2], [3, 3], "dst_ids"),
                                             ([8], [0], "src_ids"), ([0], [-1], "dst_ids")])
def test_copy_blocks_refuses_bad_ids_and_changes_nothing(src, dst, param):
    cache = make_cache()
    cache.tensor.normal_()
    before = cache.tensor.clone()
    with pytest.raises(InvalidRequestError) as err:
        cache.copy_blocks(src, dst)
    assert err.value.param == param
    assert torch.equal(cache.tensor, before)
