"""The native kernels' matrix products at every ISA level this CPU runs, against float references:
bf16 weights in the form the level multiplies them (panels at AVX2, oneDNN's packing at AVX-512;
`blocked_linear` on that packing: test_native_onednn_products.py), with bias, residual and ragged
shapes."""
import pytest
import torch

from native_levels import LEVELS_HERE, bf16_matrix, level_module


@pytest.fixture(scope="module", params=LEVELS_HERE)
def native(request):
    return level_module(request.param)


def matmul_model(native, packed: bool, blocked_rows: int = 0):
    """A weightless model for its `linear`; with `blocked_rows` only where oneDNN packs in the
    layout `blocked_linear` reads (the model trusts the check `NativeForward` makes at load)."""
    e = torch.zeros(4, 64, dtype=torch.bfloat16)
    return native.NativeModel(e, torch.ones(64, dtype=torch.bfloat16), e, layers=[], ropes=[], num_heads=1,
                              num_kv_heads=1, head_dim=64, eps=1e-5, attention_scale=0.125, embed_scale=None,
                              packed=packed, blocked_rows=blocked_rows)


SHAPES = [(1, 64, 576), (3, 37, 100), (5, 16, 32), (16, 9, 1536), (70, 130, 31), (7, 192, 1536), (13, 960, 576),
          (130, 128, 64)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, False), (True, True)])
def test_bf16_products_equal_float_reference_rounded_once(native, m, n, k, with_bias, with_residual):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16())
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    residual = torch.randn(m, n, generator=g).bfloat16() if with_residual else None
    matrix, columns = bf16_matrix(native, w)
    y = matmul_model(native, columns is None).linear(x, matrix, bias, residual, columns)
    expected = x.float() @ w.float().T + (bias.float() if with_bias else 0) + (residual.float() if with_residual else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), expected.bfloat16().float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_panel_products_are_one_float_sum_per_output_in_order(native, dtype):
    """Each output of the panel kernel is sum_k x[k] w[k] in float (one rounding per step: a
    fused multiply-add), in order of k, then + bias, then + residual, rounded once to the dtype:
    exactly that loop, checked element for element (in float64, exact for bf16 products)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 40, generator=g).to(dtype), torch.randn(21, 40, generator=g).to(dtype)
    bias, residual = torch.randn(21, generator=g).to(dtype), torch.randn(7, 21, generator=g).to(dtype)
    y = matmul_model(native, False).linear(x, native.to_panels(w), bias, residual, 21)
    products = x.double()[:, None, :] * w.double()[None, :, :]  # (7, 21, 40)
    sums = torch.zeros(7, 21)
    for k in range(40):
        sums = (sums.double() + products[:, :, k]).float()  # fma: the exact product, one rounding
    assert torch.equal(y, ((sums + bias.float()) + residual.float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_panel_rows_do_not_depend_on_the_rest_of_the_step(native, dtype):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(23, 576, generator=g).to(dtype), torch.randn(333, 576, generator=g).to(dtype)
    residual = torch.randn(23, 333, generator=g).to(dtype)
    model, panels = matmul_model(native, False), native.to_panels(w)
    together = model.linear(x, panels, None, residual, 333)
    for first, count in ((0, 1), (5, 6), (11, 12)):
        alone = model.linear(x[first:first + count], panels, None, residual[first:first + count], 333)
        assert torch.equal(alone, together[first:first + count])


def test_panels_of_the_wrong_width_are_refused(native):
    panels = native.to_panels(torch.randn(40, 64).bfloat16())  # 3 panels: 33 .. 48 columns
    model, x = matmul_model(native, False), torch.randn(2, 64).bfloat16()
    for columns in (32, 49):
        with pytest.raises(RuntimeError, match="panels of 48 columns for a matrix of"):
            model.linear(x, panels, None, None, columns)
    with pytest.raises(RuntimeError, match="rows of the panels' K inputs, in their dtype"):
        model.linear(torch.randn(2, 63).bfloat16(), panels, None, None, 40)
    with pytest.raises(RuntimeError, match="rows of the panels' K inputs, in their dtype"):
        model.linear(torch.randn(2, 64), panels, None, None, 40)


def test_plain_weights_go_to_torch_and_agree(native):
    x, w = torch.randn(20, 64), torch.randn(48, 64)
    assert torch.equal(matmul_model(native, False).linear(x, w, None, None), torch.nn.functional.linear(x, w))
