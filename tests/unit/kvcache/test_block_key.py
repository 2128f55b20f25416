import subprocess
import sys

from pdserve.common.request import MultimodalSpan
from pdserve.kvcache import hash_request_blocks
from pdserve.kvcache.block_key import hash_block_tokens, short_hash

TOKENS = list(range(100, 116))  # four blocks of four


def test_digest_is_sha256_and_chained():
    hashes = hash_request_blocks(TOKENS, 4)
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    assert hashes[1] == hash_block_tokens(hashes[0], TOKENS[4:8])
    assert len(set(hashes)) == 4


def test_only_full_blocks_get_keys():
    assert len(hash_request_blocks(TOKENS[:15], 4)) == 3


def test_digest_is_stable_across_processes():
    code = "from pdserve.kvcache import hash_request_blocks; print(hash_request_blocks(list(range(100,116)), 4)[-1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == hash_request_blocks(TOKENS, 4)[-1].hex()


def test_lora_salt_and_image_each_change_every_block():
    base = hash_request_blocks(TOKENS, 4)
    image = [MultimodalSpan(b"img-a", 0, 2)]
    for variant in (
        hash_request_blocks(TOKENS, 4, lora_id=7),
        hash_request_blocks(TOKENS, 4, cache_salt="tenant-b"),
        hash_request_blocks(TOKENS, 4, multimodal=image),
    ):
        assert all(a != b for a, b in zip(base, variant))


def test_image_only_affects_blocks_it_overlaps_and_their_descendants():
    base = hash_request_blocks(TOKENS, 4)
    with_image = hash_request_blocks(TOKENS, 4, multimodal=[MultimodalSpan(b"img", 6, 3)])  # tokens 6..8
    assert with_image[0] == base[0]
    assert with_image[1] != base[1] and with_image[2] != base[2] and with_image[3] != base[3]


def test_different_image_content_same_tokens_differs():
    a = hash_request_blocks(TOKENS, 4, multimodal=[MultimodalSpan(b"cat", 0, 4)])
    b = hash_request_blocks(TOKENS, 4, multimodal=[MultimodalSpan(b"dog", 0, 4)])
    assert a[0] != b[0]


def test_salt_enters_the_first_block_only():
    salted = hash_request_blocks(TOKENS, 4, cache_salt="s")
    assert salted[1] == hash_block_tokens(salted[0], TOKENS[4:8])


def test_short_hash_is_64_bits():
    h = hash_request_blocks(TOKENS, 4)[0]
    assert short_hash(h) == int.from_bytes(h[:8], "little") and short_hash(h) < 2**64


def test_a_chain_hashes_each_block_once_as_its_tokens_grow(monkeypatch):
    from pdserve.kvcache import block_key
    by4, by8 = hash_request_blocks(TOKENS, 4, cache_salt="salt"), hash_request_blocks(TOKENS, 8, cache_salt="salt")
    hashed = []
    real = block_key.hash_block_tokens
    monkeypatch.setattr(block_key, "hash_block_tokens", lambda parent, tokens, *a: hashed.append(tokens) or real(parent, tokens, *a))
    chain = block_key.BlockHashChain()
    assert chain.of(TOKENS[:10], 4, None, (), "salt") == by4[:2]
    assert chain.of(TOKENS[:10], 4, None, (), "salt") == by4[:2]
    assert chain.of(TOKENS, 4, None, (), "salt") == by4
    assert hashed == [TOKENS[0:4], TOKENS[4:8], TOKENS[8:12], TOKENS[12:16]]
    assert chain.of(TOKENS, 8, None, (), "salt") == by8  # another block size starts over
