"""The AVX-512 levels' products on oneDNN's packed bf16 weights: `blocked_linear` reading them in
place for steps of a few rows, and the check that oneDNN laid them out as it reads."""
import pytest
import torch

from pdserve.engine.model.native_forward import pack

from native_levels import ONEDNN_LEVELS, level_module
from test_native_products import SHAPES, matmul_model

pytestmark = pytest.mark.skipif(not ONEDNN_LEVELS, reason="no level this CPU runs multiplies bf16 on oneDNN's "
                                "packing (the AVX-512 levels; the AVX2 level's panels: test_native_products.py)")


@pytest.fixture(scope="module", params=ONEDNN_LEVELS)
def onednn_native(request):
    return level_module(request.param)


def packed_for_blocked_kernel(native, w: torch.Tensor) -> torch.Tensor:
    """`pack(w)`, skipping the test where oneDNN lays it out otherwise than `blocked_linear` reads
    (its layout is oneDNN's choice per CPU: AMX CPUs pack in blocks of 32 columns)."""
    packed = pack(w)
    if not native.blocked_layout(packed, w):
        pytest.skip("oneDNN packs bf16 weights in another layout on this CPU: blocked_linear stays off")
    return packed


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, True)])
def test_blocked_products_equal_float_reference_rounded_once(onednn_native, m, n, k, with_bias, with_residual):
    """`blocked_linear` on oneDNN's packed bytes, for the steps of a few rows it takes."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16())
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    residual = torch.randn(m, n, generator=g).bfloat16() if with_residual else None
    probe = torch.randn(128, 64).bfloat16()
    packed_for_blocked_kernel(onednn_native, probe)
    y = matmul_model(onednn_native, True, 128).linear(x, pack(w), bias, residual)
    expected = x.float() @ w.float().T + (bias.float() if with_bias else 0) + (residual.float() if with_residual else 0)
    torch.testing.assert_close(y.float(), expected.bfloat16().float(), atol=1e-2, rtol=1e-2)


def test_blocked_layout_check_tells_the_packed_matrix_apart(onednn_native):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 96, generator=g).bfloat16()
    packed = packed_for_blocked_kernel(onednn_native, w)
    other = w.clone()
    other[70, 95] += 1  # one element of a row the check reads only at its ends
    assert not onednn_native.blocked_layout(packed, other)
    assert not onednn_native.blocked_layout(w, w)  # a plain tensor is not a packed one
    assert not onednn_native.blocked_layout(pack(w[:96]), w[:96])  # 96 columns: not whole 64-column blocks


def test_blocked_rows_do_not_depend_on_the_rest_of_the_step(onednn_native):
    """Each output is one sum over K in order: a row's bits are the same alone or beside others,
    and within a bf16 step of oneDNN's result for the same rows."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(23, 576, generator=g).bfloat16(), torch.randn(320, 576, generator=g).bfloat16()
    residual = torch.randn(23, 320, generator=g).bfloat16()
    packed = packed_for_blocked_kernel(onednn_native, w)
    blocked = matmul_model(onednn_native, True, 128)
    together = blocked.linear(x, packed, None, residual)
    for first, count in ((0, 1), (5, 6), (11, 12)):
        alone = blocked.linear(x[first:first + count], packed, None, residual[first:first + count])
        assert torch.equal(alone, together[first:first + count])
    onednn = matmul_model(onednn_native, True, 0).linear(x, packed, None, residual).float()
    ulp = torch.finfo(torch.bfloat16).eps * onednn.abs().clamp_min(1e-30)
    assert ((together.float() - onednn).abs() <= ulp).all()
