"""The native CPU kernels of every ISA level this CPU runs against plain torch references: paged
attention (grouped-query heads, cached prefixes, sliding windows, scattered block tables) in
float32 and bfloat16, and the runner on them (one packed copy of the weights, a prompt's bits
however it is split, the thread count a step follows). Products: test_native_products.py."""
import copy
import gc
from functools import partial
from pathlib import Path

import pytest
import torch

from pdserve.engine.model.runner import ModelRunner

from model_builders import TOKENS_PER_BLOCK, chunk, load_runner, prompt, run
from native_levels import LEVELS_HERE, level_module
from test_native_products import matmul_model


@pytest.fixture(scope="module", params=LEVELS_HERE)
def native(request):
    return level_module(request.param)


@pytest.fixture
def tile_kernel(native, request):
    """bf16 prompt tiles on AMX tile products ("amx"; skipped where the level or the CPU has
    none) or kept off them ("no-amx": the level's other kernel)."""
    amx = request.param == "amx"
    if native.use_amx_attention(amx) != amx:
        native.use_amx_attention(True)
        pytest.skip(f"no AMX tiles for attention at level {native.LEVEL} on this CPU")
    yield request.param
    native.use_amx_attention(True)


BOTH_TILE_KERNELS = [(torch.float32, 1e-5, "no-amx"), (torch.bfloat16, 2e-2, "amx"), (torch.bfloat16, 2e-2, "no-amx")]


def reference_attention(q, kv, layer, segments, tables, num_heads, window):
    """Naive float32 attention of each segment's queries over its keys, read via its table."""
    _, _, _, tpb, kvh, hd = kv.shape
    out = torch.zeros(q.shape[0], num_heads * hd)
    for s, (q_start, q_len, start, _) in enumerate(segments.tolist()):
        ctx = start + q_len
        blocks = tables[s, :-(-ctx // tpb)].long()
        k = kv[blocks, layer, 0].reshape(-1, kvh, hd)[:ctx].float().repeat_interleave(num_heads // kvh, 1)
        v = kv[blocks, layer, 1].reshape(-1, kvh, hd)[:ctx].float().repeat_interleave(num_heads // kvh, 1)
        for i in range(q_len):
            pos, qi = start + i, q[q_start + i, :num_heads * hd].float().view(num_heads, hd)
            lo = max(0, pos - window + 1) if window else 0
            scores = torch.einsum("hd,shd->hs", qi, k[lo:pos + 1]) * hd ** -0.5
            out[q_start + i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo:pos + 1]).reshape(-1)
    return out


@pytest.mark.parametrize("dtype, tol, tile_kernel", BOTH_TILE_KERNELS, indirect=["tile_kernel"])
@pytest.mark.parametrize("num_heads, kvh, hd", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 96), (4, 2, 256)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("tpb", [4, 32])
def test_paged_attention_equals_reference(native, dtype, tol, tile_kernel, num_heads, kvh, hd, window, tpb):
    g = torch.Generator().manual_seed(num_heads + hd + window)
    layers = 2
    kv = torch.randn(40, layers, 2, tpb, kvh, hd, generator=g).to(dtype)
    # decode token at 17 | chunk of 6 over a 9-token prefix | fresh prompt of 21 | decode at 0 |
    # a prompt's last token behind 22 cached ones | 3 left of a prompt after 5
    segments = torch.tensor([[0, 1, 17, 0], [1, 6, 9, 1], [7, 21, 0, 1], [28, 1, 0, 0], [29, 1, 22, 1],
                             [30, 3, 5, 1]], dtype=torch.int32)
    tables = torch.randperm(40, generator=g)[:36].view(6, 6).to(torch.int32)
    q = torch.randn(33, (num_heads + 2 * kvh) * hd, generator=g).to(dtype)  # q heads first, as in qkv rows
    out = native.attention(q, kv, 1, segments, tables, num_heads, hd ** -0.5, window)
    expected = reference_attention(q, kv, 1, segments, tables, num_heads, window)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads, kvh, hd", [(7, 1, 64), (10, 2, 64), (12, 2, 32), (6, 3, 256), (15, 3, 96)])
def test_decode_rows_of_any_group_size_equal_reference(native, dtype, tol, num_heads, kvh, hd):
    """Decode tokens go through a block a KV head's query heads at a time, in runs of up to four
    (fewer for wide heads) and a remainder: groups of 7, 5, 6, 2 and 5 heads, over 1 to 40 keys."""
    g = torch.Generator().manual_seed(num_heads * hd)
    tpb = 16
    kv = torch.randn(12, 1, 2, tpb, kvh, hd, generator=g).to(dtype)
    segments = torch.tensor([[0, 1, 0, 0], [1, 1, 15, 0], [2, 1, 16, 0], [3, 1, 39, 0]], dtype=torch.int32)
    tables = torch.randperm(12, generator=g)[:12].view(4, 3).to(torch.int32)
    q = torch.randn(4, (num_heads + 2 * kvh) * hd, generator=g).to(dtype)
    out = native.attention(q, kv, 0, segments, tables, num_heads, hd ** -0.5, 0)
    expected = reference_attention(q, kv, 0, segments, tables, num_heads, 0)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol, tile_kernel", BOTH_TILE_KERNELS, indirect=["tile_kernel"])
def test_long_chunks_over_a_prefix_span_several_tiles(native, dtype, tol, tile_kernel):
    """150 new tokens over a 37-token prefix, and 130 fresh ones: more than one query tile each."""
    g = torch.Generator().manual_seed(7)
    kvh, hd, num_heads, tpb = 2, 64, 6, 16
    kv = torch.randn(40, 1, 2, tpb, kvh, hd, generator=g).to(dtype)
    segments = torch.tensor([[0, 150, 37, 1], [150, 130, 0, 1]], dtype=torch.int32)
    tables = torch.randperm(40, generator=g)[:26].view(2, 13).to(torch.int32)
    q = torch.randn(280, num_heads * hd, generator=g).to(dtype)
    out = native.attention(q, kv, 0, segments, tables, num_heads, hd ** -0.5, 0)
    expected = reference_attention(q, kv, 0, segments, tables, num_heads, 0)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("tile_kernel", ["amx", "no-amx"], indirect=True)
@pytest.mark.parametrize("window", [0, 40])
def test_bf16_rows_are_the_same_bits_however_the_prompt_is_split(native, window, tile_kernel):
    """A 300-token prompt spans three 128-key softmax blocks; behind a 40-token window most rows
    see none of a block their tile visits. Whole, or as chunks of 150 + 150 and 7 + 293 over
    their cached part, every row agrees with the reference and comes out the same bits."""
    g = torch.Generator().manual_seed(11)
    kvh, hd, num_heads, tpb = 3, 64, 9, 16
    kv = torch.randn(20, 1, 2, tpb, kvh, hd, generator=g).bfloat16()
    tables = torch.randperm(20, generator=g)[:19].view(1, 19).to(torch.int32)
    q = torch.randn(300, num_heads * hd, generator=g).bfloat16()

    def attend(sizes: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for size in sizes:
            segments = torch.tensor([[0, size, start, 1]], dtype=torch.int32)
            outs.append(native.attention(q[start:start + size], kv, 0, segments, tables, num_heads, hd ** -0.5, window))
            start += size
        return torch.cat(outs)

    whole = attend([300])
    segments = torch.tensor([[0, 300, 0, 1]], dtype=torch.int32)
    expected = reference_attention(q, kv, 0, segments, tables, num_heads, window)
    torch.testing.assert_close(whole.float(), expected, atol=2e-2, rtol=2e-2)
    for sizes in ([150, 150], [7, 293]):
        assert torch.equal(attend(sizes), whole), sizes


def maps() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_bf16_runner_holds_one_packed_copy_of_its_matrices(checkpoints, tmp_path, level):
    """The native kernels take the bf16 matrices packed (oneDNN's layout, or panels at AVX2);
    the model's plain copies are let go, what stays owns its memory (not the checkpoint's file
    map), and the model's torch forward refuses instead of running on missing weights."""
    copy.deepcopy(checkpoints["llama"].hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    load = partial(ModelRunner.load, tmp_path, dtype="bfloat16", device="cpu", num_blocks=64,
                   tokens_per_block=TOKENS_PER_BLOCK)
    weights_file = str(tmp_path / "model.safetensors")
    plain = load(kernels="torch")  # tensors read as they are stored stay views of the file's map
    assert weights_file in maps()
    del plain
    gc.collect()
    assert weights_file not in maps()
    runner = load(kernels=level)
    model = runner.model
    assert model.matrices_dropped and all(layer.qkv is None and layer.mlp.down is None for layer in model.layers)
    assert weights_file not in maps()  # what stays (embedding, norms) was copied out of it
    ids = prompt(9, seed=2)
    [logits] = run(runner, chunk("r", ids, 0, [0, 1, 2], all_logits=True))
    torch.testing.assert_close(logits, checkpoints["llama"].hf_logits(ids), atol=0.1, rtol=0.05)
    with pytest.raises(RuntimeError, match="handed to the native kernels"):
        model.forward(torch.tensor(ids), None, runner.kv, torch.tensor([0]))


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_bf16_prompt_comes_out_the_same_bits_whole_chunked_or_behind_a_cache(checkpoints, tmp_path, level):
    """Every prompt row's arithmetic is its own (AVX-512: every prompt token through the tile
    kernel however few a chunk leaves; AVX2: one path for every row), so a 130-token prompt's
    last logits, and the next decode step's, are the same bits computed whole (a tile of 128 and
    one of 2), as 127 + 3, 129 + 1 or 64 + 64 + 2, or as its last token behind 129 cached."""
    copy.deepcopy(checkpoints["llama"].hf_model).to(torch.bfloat16).save_pretrained(tmp_path)
    runner = ModelRunner.load(tmp_path, dtype="bfloat16", device="cpu", num_blocks=64,
                              tokens_per_block=TOKENS_PER_BLOCK, kernels=level)
    ids, blocks = prompt(130, seed=3), list(range(33))

    def complete(sizes: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        for size in sizes:
            [last] = run(runner, chunk("r", ids[start:start + size], start, blocks, is_prompt=True))
            start += size
        [after] = run(runner, chunk("r", [int(last.argmax())], start, blocks))
        return last, after

    whole = complete([130])
    for sizes in ([127, 3], [129, 1], [64, 64, 2]):
        assert all(torch.equal(a, b) for a, b in zip(complete(sizes), whole, strict=True)), sizes
    complete([130])
    assert all(torch.equal(a, b) for a, b in zip(complete([1], start=129), whole, strict=True))


def test_segments_of_the_wrong_shape_are_refused(native):
    kv = torch.zeros(4, 1, 2, 4, 1, 32)
    with pytest.raises(RuntimeError, match="segments must be contiguous"):
        native.attention(torch.zeros(1, 32), kv, 0, torch.tensor([[0, 1, 0]], dtype=torch.int32),
                         torch.zeros(1, 1, dtype=torch.int32), 1, 1.0, 0)


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_float32_runner_keeps_plain_matrices_except_in_the_avx2_levels_panels(checkpoints, level):
    model = load_runner(checkpoints["llama"], kernels=level).model
    if level == "avx2":
        assert model.matrices_dropped and model.layers[0].qkv is None
        return
    assert not model.matrices_dropped and model.layers[0].qkv is not None


def test_a_step_follows_the_thread_count_it_is_given_layer_by_layer(checkpoints, native):
    """`follow_threads`: each layer starts on the count in the buffer (another thread may raise
    it mid-step); the logits do not depend on it."""
    import array
    runner = load_runner(checkpoints["llama"], kernels=native.LEVEL)
    step = chunk("r", prompt(40, seed=5), 0, list(range(11)), is_prompt=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        [alone] = run(runner, step)
        count = array.array("i", [1])
        runner.native.follow_threads(count)
        [followed] = run(runner, step)
        assert torch.get_num_threads() == 1
        count[0] = 2
        run(runner, step)
        assert torch.get_num_threads() == 2
        torch.testing.assert_close(followed, alone)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="one-element int32 tensor"):
        matmul_model(native, False).follow_threads(torch.zeros(2, dtype=torch.int32))
