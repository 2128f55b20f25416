"""What a worker reads off its engine after each loop turn, on the engine thread: the figures
its load reports and metrics give (`engine_stats`) and its queues' make-up (`queue_view`)."""
from dataclasses import dataclass

from pdserve.common.stats import EngineStats
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.kvcache import Tier


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the worker's metrics read beyond `EngineStats` (which the router's load polls carry):
    requests whose prompt's KV is still on its way from a peer (vLLM counts them as waiting), and
    the LoRA adapters of running and of waiting requests."""

    num_awaiting_kv: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


def engine_stats(engine: LLMEngine) -> EngineStats:
    kv, scheduler = engine.kv, engine.scheduler
    bytes_per_block = _bytes_per_block(engine) if kv.host else 0  # a disk tier has a host tier above it
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks, num_used_blocks=kv.num_used_blocks,
        num_prefill_tokens_queued=scheduler.num_prefill_tokens_queued,
        prefix_cache_queried_tokens=kv.num_query_tokens, prefix_cache_hit_tokens=kv.num_hit_tokens,
        num_preemptions=scheduler.num_preemptions,
        num_host_blocks=kv.host.num_slots if kv.host else 0,
        num_host_cached_blocks=len(kv.host.entries) if kv.host else 0,
        num_offloaded_blocks=kv.tiers.num_offloaded, num_onboarded_blocks=kv.tiers.num_onboarded,
        num_disk_blocks=kv.disk.num_slots if kv.disk else 0,
        num_disk_cached_blocks=len(kv.disk.entries) if kv.disk else 0,
        num_spilled_blocks=kv.tiers.num_spilled, num_loaded_blocks=kv.tiers.num_loaded,
        num_corrupt_disk_blocks=kv.tiers.num_corrupt,
        num_host_cached_bytes=len(kv.host.entries) * bytes_per_block if kv.host else 0,
        num_disk_cached_bytes=len(kv.disk.entries) * bytes_per_block if kv.disk else 0,
        prefix_cache_host_hit_tokens=kv.tiers.hit_tokens[Tier.HOST],
        prefix_cache_disk_hit_tokens=kv.tiers.hit_tokens[Tier.DISK],
        num_dropped_by_priority=kv.pool.num_dropped_by_priority,
    )


def queue_view(engine: LLMEngine) -> QueueView:
    scheduler = engine.scheduler
    return QueueView(engine.handoffs.num_awaiting_kv, _adapters(scheduler.running), _adapters(scheduler.waiting))


def _bytes_per_block(engine: LLMEngine) -> int:
    block = engine.runner.kv_tensor[0]
    return block.numel() * block.element_size()


def _adapters(seqs) -> tuple[str, ...]:
    return tuple(sorted({str(s.request.lora_id) for s in seqs if s.request.lora_id is not None}))
