"""Block keys: a SHA-256 digest of a full block's identity, chained through its prefix.

digest = SHA-256(parent digest | token ids | LoRA id | multimodal (hash, offset) pairs overlapping
the block | cache salt on the first block). The encoding is length-prefixed and little-endian, so a
digest is stable across processes and machines. Two requests that differ in LoRA id, image content or
salt never share a block, even with identical tokens.
"""
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.ids import BlockHash
from pdserve.common.request import MultimodalSpan

HASH_ALGORITHM = "sha256-v1"
_NO_PARENT = b""


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    lora_id: int | None = None,
    multimodal: Sequence[tuple[bytes, int]] = (),
    cache_salt: str | None = None,
) -> BlockHash:
    """Digest of one block. `multimodal` pairs hold offsets relative to the block's first token."""
    h = hashlib.sha256()
    _put(h, parent if parent is not None else _NO_PARENT)
    _put(h, struct.pack(f"<{len(token_ids)}I", *token_ids))
    _put(h, b"" if lora_id is None else struct.pack("<q", lora_id))
    _put(h, b"".join(_pack_mm(content, offset) for content, offset in multimodal))
    _put(h, b"" if cache_salt is None else cache_salt.encode("utf-8"))
    return BlockHash(h.digest())


def hash_request_blocks(
    token_ids: Sequence[int],
    tokens_per_block: int,
    lora_id: int | None = None,
    multimodal: Sequence[MultimodalSpan] = (),
    cache_salt: str | None = None,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Digests of the full blocks from `start_block` on; `parent` is block `start_block - 1`'s digest."""
    hashes: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // tokens_per_block):
        begin = i * tokens_per_block
        end = begin + tokens_per_block
        pairs = [(m.content_hash, m.offset - begin) for m in multimodal if m.offset < end and m.offset + m.length > begin]
        salt = cache_salt if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[begin:end], lora_id, pairs, salt)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockHashChain:
    """One sequence's block digests, kept as its token list grows: however often the sequence is
    analyzed, claimed or checked, each full block is hashed once. Only for a token list that is
    only ever appended to, with the same LoRA id, multimodal spans and salt on every call."""

    tokens_per_block: int = 0
    hashes: list[BlockHash] = field(default_factory=list)

    @classmethod
    def from_keys(cls, keys: Sequence[BlockHash], token_ids: Sequence[int], tokens_per_block: int,
                  lora_id: int | None, multimodal: Sequence[MultimodalSpan], cache_salt: str | None) -> "BlockHashChain":
        """A chain that starts with `keys`, another process's digests of `token_ids`' first full
        blocks (the router's), when the first of them is this block's digest here: it covers the
        block size, the first tokens, the adapter, the images and the salt, so keys made for
        another request or under another block size are dropped (the blocks are hashed here),
        never taken for a hit. Hashes the first block only."""
        num_full = len(token_ids) // tokens_per_block
        if not keys or len(keys) > num_full:
            return cls()
        first = hash_request_blocks(token_ids[:tokens_per_block], tokens_per_block, lora_id, multimodal, cache_salt)
        if first[0] != keys[0]:
            return cls(tokens_per_block, first)  # hashed already: keep it
        return cls(tokens_per_block, list(keys))

    def prefix(self, num_tokens: int) -> "BlockHashChain":
        """A new chain with the digests of the first `num_tokens` tokens' full blocks (a fork's)."""
        if not self.tokens_per_block:
            return BlockHashChain()
        return BlockHashChain(self.tokens_per_block, self.hashes[:num_tokens // self.tokens_per_block])

    def of(self, token_ids: Sequence[int], tokens_per_block: int, lora_id: int | None,
           multimodal: Sequence[MultimodalSpan], cache_salt: str | None) -> list[BlockHash]:
        """The digests of `token_ids`' full blocks (a new list), hashing only the blocks not seen yet."""
        if tokens_per_block != self.tokens_per_block:
            self.tokens_per_block, self.hashes = tokens_per_block, []
        num_full = len(token_ids) // tokens_per_block
        if len(self.hashes) < num_full:
            parent = self.hashes[-1] if self.hashes else None
            self.hashes += hash_request_blocks(token_ids, tokens_per_block, lora_id, multimodal, cache_salt,
                                               len(self.hashes), parent)
        return self.hashes[:num_full]


def short_hash(block_hash: BlockHash) -> int:
    """A 64-bit name for a block in events and logs (the digest's first 8 bytes)."""
    return int.from_bytes(block_hash[:8], "little")


def _put(h: "hashlib._Hash", data: bytes) -> None:
    h.update(struct.pack("<I", len(data)))
    h.update(data)


def _pack_mm(content_hash: bytes, offset: int) -> bytes:
    return struct.pack("<I", len(content_hash)) + content_hash + struct.pack("<q", offset)
