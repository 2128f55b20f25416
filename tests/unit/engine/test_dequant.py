"""dequantize against gguf.quants: bit-identical values for every type, in float32 and bfloat16."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GgmlType

from pdserve.common.errors import ConfigError
from pdserve.engine.loading.dequant import CHUNK_BLOCKS, dequantize, num_bytes

ROWS, COLS = 3 * CHUNK_BLOCKS // 8 + 5, 256  # spans several chunks and ends in a partial one


def stored(values: np.ndarray, kind: GgmlType) -> torch.Tensor:
    """The bytes llama.cpp would store for `values` as `kind`, as a flat uint8 tensor."""
    if kind == GgmlType.F32:
        data = values
    elif kind == GgmlType.F16:
        data = values.astype(np.float16)
    else:
        data = gguf.quants.quantize(values, kind)
    return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy())


@pytest.mark.parametrize("kind", [GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q8_0, GgmlType.Q5_0,
                                  GgmlType.BF16, GgmlType.F16, GgmlType.F32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_equal_gguf_quants_then_a_cast(kind, dtype):
    values = np.random.default_rng(int(kind)).standard_normal((ROWS, COLS)).astype(np.float32) * 3
    raw = stored(values, kind)
    assert raw.numel() == num_bytes(kind, (COLS, ROWS))
    reference = gguf.quants.dequantize(raw.numpy().reshape(ROWS, -1), kind)  # (ROWS, COLS) float32
    out = dequantize(raw, kind, (COLS, ROWS), dtype)
    assert (out.shape, out.dtype) == ((ROWS, COLS), dtype)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(reference)).to(dtype))


def test_raw_bytes_are_only_read():
    raw = stored(np.ones((2, 64), dtype=np.float32), GgmlType.Q4_1)
    before = raw.clone()
    dequantize(raw, GgmlType.Q4_1, (64, 2), torch.bfloat16)[0, 0] = 7
    assert torch.equal(raw, before)


def test_sizes_and_their_errors():
    assert num_bytes(GgmlType.Q4_1, (64, 3)) == 3 * 2 * 20
    assert num_bytes(GgmlType.F32, (5,)) == 20
    with pytest.raises(ConfigError) as err:
        num_bytes(GgmlType.Q8_0, (48, 2))
    assert (err.value.field, err.value.value) == ("tensor", (48, 2))
    with pytest.raises(ConfigError) as err:
        num_bytes(999, (32,))
    assert (err.value.field, err.value.value) == ("tensor type", 999)


def test_types_without_a_dequantization_are_config_errors():
    with pytest.raises(ConfigError) as err:
        dequantize(torch.zeros(8, dtype=torch.uint8), GgmlType.I32, (2,), torch.float32)
    assert (err.value.field, err.value.value) == ("tensor type", "I32")
