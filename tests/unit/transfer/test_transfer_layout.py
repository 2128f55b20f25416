import json
from dataclasses import replace

import pytest
import torch

from pdserve.common.errors import ConfigError, IncompatiblePeerError
from pdserve.transfer.layout import KvLayoutSpec, check_compatible

SMOLLM2 = KvLayoutSpec("SmolLM2-135M-Instruct", "bfloat16", num_layers=30, num_kv_heads=3, head_dim=64,
                       tokens_per_block=16)


def test_bytes_per_block_is_layers_times_k_and_v_times_tokens_heads_dim_and_dtype_size() -> None:
    assert SMOLLM2.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 2 == 368_640
    assert SMOLLM2.block_shape == (30, 2, 16, 3, 64)
    assert replace(SMOLLM2, dtype="float8_e4m3fn").bytes_per_block == 184_320


def test_for_tensor_reads_the_block_major_shape_and_dtype() -> None:
    kv = torch.zeros(5, 2, 2, 4, 3, 8, dtype=torch.float16)  # (N, L, 2, tpb, kvh, hd)
    spec = KvLayoutSpec.for_tensor("m", kv, kv_scale=0.5)
    assert spec == KvLayoutSpec("m", "float16", num_layers=2, num_kv_heads=3, head_dim=8, tokens_per_block=4,
                                kv_scale=0.5)


def test_for_tensor_refuses_a_tensor_that_is_not_block_major() -> None:
    with pytest.raises(ConfigError, match=r"kv_tensor.shape=\(5, 2, 3, 4, 3, 8\)"):
        KvLayoutSpec.for_tensor("m", torch.zeros(5, 2, 3, 4, 3, 8))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("model", "", "model='': must name the model or its fingerprint"),
    ("dtype", "int4", "dtype='int4': supported: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, uint8"),
    ("num_layers", 0, "num_layers=0: must be a positive integer"),
    ("head_dim", 64.0, "head_dim=64.0: must be a positive integer"),
    ("tokens_per_block", True, "tokens_per_block=True: must be a positive integer"),
    ("kv_scale", 0.0, "kv_scale=0.0: must be positive"),
])
def test_invalid_fields_raise_config_error_naming_field_and_value(field: str, value: object,
                                                                  message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        replace(SMOLLM2, **{field: value})
    assert str(raised.value) == message
    assert raised.value.field == field


def test_identical_specs_are_compatible() -> None:
    check_compatible(SMOLLM2, replace(SMOLLM2))


def test_one_mismatch_is_named() -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        check_compatible(SMOLLM2, replace(SMOLLM2, model="SmolLM2-360M"), peer="peer 'd0'")
    assert str(raised.value) == (
        "peer 'd0' has an incompatible KV layout; model: local='SmolLM2-135M-Instruct' remote='SmolLM2-360M'")


def test_every_mismatch_is_named_in_field_order() -> None:
    remote = replace(SMOLLM2, dtype="float16", num_kv_heads=4, kv_scale=2.0, layout="layer-major",
                     protocol_version=2)
    with pytest.raises(IncompatiblePeerError) as raised:
        check_compatible(SMOLLM2, remote)
    assert str(raised.value) == (
        "peer has an incompatible KV layout; "
        "dtype: local='bfloat16' remote='float16'; "
        "num_kv_heads: local=3 remote=4; "
        "kv_scale: local=1.0 remote=2.0; "
        "layout: local='block-major-v1' remote='layer-major'; "
        "protocol_version: local=1 remote=2; "
        "bytes_per_block: local=368640 remote=491520")


def test_dict_round_trip_carries_bytes_per_block() -> None:
    data = SMOLLM2.to_dict()
    assert data["bytes_per_block"] == 368_640
    assert KvLayoutSpec.from_dict(data) == SMOLLM2


def test_from_dict_refuses_missing_fields() -> None:
    data = SMOLLM2.to_dict()
    del data["head_dim"], data["layout"]
    with pytest.raises(IncompatiblePeerError) as raised:
        KvLayoutSpec.from_dict(data)
    assert str(raised.value) == "peer layout spec lacks fields: head_dim, layout"


def test_from_dict_refuses_invalid_values_and_inconsistent_bytes_per_block() -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        KvLayoutSpec.from_dict({**SMOLLM2.to_dict(), "num_layers": -1})
    assert str(raised.value) == "peer layout spec is invalid: num_layers=-1: must be a positive integer"
    with pytest.raises(IncompatiblePeerError) as raised:
        KvLayoutSpec.from_dict({**SMOLLM2.to_dict(), "bytes_per_block": 1})
    assert str(raised.value) == "peer layout spec says bytes_per_block=1 but its fields give 368640"


def test_layer_windows_travel_and_a_peer_with_other_windows_is_refused() -> None:
    windowed = replace(SMOLLM2, layer_windows=(4096,) * 29 + (None,))
    assert KvLayoutSpec.from_dict(json.loads(json.dumps(windowed.to_dict()))) == windowed
    with pytest.raises(IncompatiblePeerError, match="layer_windows"):
        check_compatible(windowed, replace(windowed, layer_windows=(2048,) * 29 + (None,)))
    with pytest.raises(IncompatiblePeerError, match="layer_windows"):
        check_compatible(windowed, SMOLLM2)
    assert windowed.bytes_per_layer * 30 == windowed.bytes_per_block
    assert replace(SMOLLM2, layer_windows=(None,) * 30) == SMOLLM2  # no window layers: told or not, the same


@pytest.mark.parametrize("windows", [(8,), (0,) * 30, (True,) * 30, [None] * 30])
def test_layer_windows_are_empty_or_one_per_layer(windows) -> None:
    with pytest.raises(ConfigError, match="layer_windows"):
        replace(SMOLLM2, layer_windows=windows)
