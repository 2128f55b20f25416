"""What the engine thread does for each `Op` of its inbox (`engine_inbox.py`): the closed set of
queries a worker's parts may make of its engine, each run between steps."""
from collections.abc import Callable

from pdserve.common.ids import BlockHash
from pdserve.common.stats import KvIntegrity
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.kvcache import IntegrityError, Tier
from pdserve.worker.engine_inbox import Op


def operations(engine: LLMEngine) -> dict[Op, Callable]:
    remote = engine.remote
    return {
        Op.PING: lambda: None, Op.COMPLETE_REMOTE: remote.complete, Op.FAIL_REMOTE: remote.fail,
        Op.RELEASE_HELD: remote.release_held, Op.ADD_LORA: engine.add_lora, Op.REMOVE_LORA: engine.remove_lora,
        Op.CHECK_INTEGRITY: lambda: check_integrity(engine), Op.KV_SNAPSHOT: lambda: kv_snapshot(engine),
        Op.SPILL_HOST_TIER: lambda: spill_host_tier(engine),
    }


def check_integrity(engine: LLMEngine) -> KvIntegrity:
    kv = engine.kv
    held = len(engine.handoffs) + engine.handoffs.num_quarantined  # waiting on a transfer's outcome
    try:
        kv.check_integrity()
    except IntegrityError as exc:
        return KvIntegrity(False, str(exc), held, kv.num_used_blocks)
    return KvIntegrity(True, "", held, kv.num_used_blocks)


def kv_snapshot(engine: LLMEngine) -> tuple[int, list[tuple[BlockHash, Tier]]]:
    """The seq of the first KV event not reflected, and every cached block with its best tier."""
    return engine.kv.events.next_seq, engine.kv.cached_blocks_by_tier()


def spill_host_tier(engine: LLMEngine) -> int:
    """Write the host tier's keepable blocks to the disk tier; how many."""
    moves = engine.kv.spill_host_tier()
    if moves:
        engine.tier_store.apply(moves)
    return len(moves)
