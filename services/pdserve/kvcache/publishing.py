"""Publishing: a claimed sequence's computed full blocks become findable under their keys, in
order, so a block's parent is always cached before it. A key cached already is shared and our
copy freed, unless the cached block lacks window layers' slices (`windows.py`) and ours is
whole: then ours takes the key, and the other is forgotten (its holders keep it privately, and
their chain ends there: a block whose parent is not cached is never published)."""
from collections.abc import Callable

from pdserve.kvcache.claims import ClaimedSequence
from pdserve.kvcache.pool import BlockPool


def publish_full_blocks(pool: BlockPool, seq: ClaimedSequence, tokens_per_block: int, is_reuse_enabled: bool,
                        expiry: Callable[[float | None], float | None]) -> None:
    """Publish `seq`'s full computed blocks not settled yet; `expiry` turns a retention
    duration into its end on the manager's clock."""
    num_full = seq.num_computed_tokens // tokens_per_block
    if is_reuse_enabled:
        if len(seq.hashes) < num_full:
            seq.request.block_hashes(tokens_per_block)  # the chain hashes the blocks it lacks
        for i in range(seq.num_published, num_full):
            if i > 0 and seq.blocks[i - 1].block_hash is None:  # its parent was forgotten
                break
            _publish_block(pool, seq, i, tokens_per_block, expiry)
    seq.num_published = max(seq.num_published, num_full)


def _publish_block(pool: BlockPool, seq: ClaimedSequence, i: int, tokens_per_block: int,
                   expiry: Callable[[float | None], float | None]) -> None:
    block = seq.blocks[i]
    if block.block_hash is not None:
        return
    existing = pool.lookup(seq.hashes[i])
    if existing is not None and existing.readable_from is not None and block.readable_from is None:
        pool.forget(existing)
        existing = None
    if existing is not None:  # same content already cached: share it, free our copy
        pool.ref(existing)
        seq.blocks[i] = existing
        pool.unref(block)
        return
    parent = seq.blocks[i - 1] if i > 0 else None  # cached: blocks are published in order
    priority, duration_s = seq.block_priority(i, tokens_per_block)
    pool.publish(block, seq.hashes[i], parent, priority, expiry(duration_s), seq.request.lora_id)
