"""Which of the manager's blocks hold a head's K/V, and for which tokens: a prefix hit reuses it.

A head's K/V at position p is a function of the tokens 0..p+1 alone, and of the LoRA adapter the
target ran them under: the target's hidden state at p and the token after it. So a full block
whose every slot the head wrote serves any sequence with the same tokens through the first token
of the next block: that is the key recorded for it (successor-aware; vLLM drops the last block
of every hit instead, recomputing it for the head). A block the head writes into again loses its
record; one whose target K/V changes without the head (a peer's transfer, a copy back from a
lower tier) keeps a record the new tokens do not match, which is then never read.

    block i's key = hash(digest of tokens 0 .. (i+1)*tpb - 1 and the LoRA id, token (i+1)*tpb)
"""
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockDigests:
    """One sequence's certain tokens from position 0, and rolling digests over them block by
    block (`digests[i]` covers blocks 0..i)."""

    lora_id: int | None
    tokens: list[int]
    digests: list[int] = field(default_factory=list)

    def key(self, block: int, tokens_per_block: int) -> int:
        """Block `block`'s key: its tokens and all before, and the token after it (which must be known)."""
        while len(self.digests) <= block:
            i = len(self.digests)
            parent = self.digests[-1] if self.digests else hash(("lora", self.lora_id))
            self.digests.append(hash((parent, tuple(self.tokens[i * tokens_per_block:(i + 1) * tokens_per_block]))))
        return hash((self.digests[block], self.tokens[(block + 1) * tokens_per_block]))


class HeadBlocks:
    """The key of the tokens each block's head K/V was written for (module docstring)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._keys: dict[int, int] = {}  # block id -> key

    def forget(self, block_ids: Iterable[int]) -> None:
        """The head wrote into these blocks: what they held is gone."""
        for block_id in block_ids:
            self._keys.pop(block_id, None)

    def record(self, digests: BlockDigests, table: Seq[int], first_block: int, end_block: int) -> None:
        """Blocks first_block..end_block-1 of `table` hold K/V the head wrote whole for these tokens."""
        for i in range(first_block, end_block):
            self._keys[table[i]] = digests.key(i, self.tokens_per_block)

    def holds(self, digests: BlockDigests, table: Seq[int], num_blocks: int) -> bool:
        """Whether the first `num_blocks` blocks of `table` all hold head K/V for these tokens."""
        return all(self._keys.get(table[i]) == digests.key(i, self.tokens_per_block) for i in range(num_blocks))
