"""`PagedKvCache.zero_layers`: the slices a peer left behind are zeroed, and nothing else."""
import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.kv_tensor import FP8_DTYPE, PagedKvCache, allocate_kv_tensor

CONFIG = ModelConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_only_the_named_layers_of_the_named_blocks_are_zeroed(dtype):
    kv = PagedKvCache(allocate_kv_tensor(CONFIG, 6, 4, dtype), torch.float32)
    if dtype == FP8_DTYPE:
        kv.tensor.view(torch.uint8).fill_(0x7F)  # NaN in float8_e4m3fn
    else:
        kv.tensor.fill_(float("nan"))
    kv.zero_layers([(1, (0,)), (3, (0, 2)), (5, (0,)), (4, (0, 1, 2))])
    values = kv.tensor.float()  # (N, L, 2, tpb, kvh, hd)
    zeroed = {(1, 0), (3, 0), (3, 2), (5, 0), (4, 0), (4, 1), (4, 2)}
    for block in range(6):
        for layer in range(3):
            is_zero, is_nan = (values[block, layer] == 0).all(), values[block, layer].isnan().all()
            assert (is_zero if (block, layer) in zeroed else is_nan), (block, layer)


@pytest.mark.parametrize("slices", [[(6, (0,))], [(-1, (0,))], [(0, (3,))]])
def test_slices_outside_the_tensor_are_refused(slices):
    kv = PagedKvCache(allocate_kv_tensor(CONFIG, 6, 4, torch.float32), torch.float32)
    with pytest.raises(InvalidRequestError):
        kv.zero_layers(slices)
