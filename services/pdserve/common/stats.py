"""What a worker reports about itself: its model and KV layout (once), its load (often).

The worker's engine produces these; `rpc/` carries them; the router reads them to check that
it computes the same block keys as the worker and to weigh load when it picks a worker.
"""
import enum
from dataclasses import dataclass

from pdserve.common.ids import DeploymentId, WorkerId


class WorkerRole(enum.StrEnum):
    BOTH = "both"  # aggregated: prefill and decode in one process
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter a worker serves: requests name it as their model; `lora_id`, a digest of
    its files, is the request's `lora_id` and part of every block key computed under it."""

    name: str
    lora_id: int
    path: str


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Fixed for a worker's lifetime but for its LoRA adapters; the router asks at start, and
    learns of adapters loaded later from the loads it forwards.

    `block_hash_algorithm` names the block-key digest and its layout version (e.g.
    "sha256-v1"); a router whose own algorithm differs must refuse the worker, since
    its prefix index would never match the worker's blocks.
    """

    model_name: str
    max_model_len: int
    tokens_per_block: int
    block_hash_algorithm: str
    role: WorkerRole
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    lora_enabled: bool = False  # serves LoRA adapters (--enable-lora)
    max_loras: int = 0  # how many adapters may be loaded at once
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # loaded now; they change at runtime


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's answer to the router's first question: its model, the deployment it was
    started in (None: started without a deployment id), and its id (None: a worker that does
    not say)."""

    model: ModelInfo
    deployment_id: DeploymentId | None
    worker_id: WorkerId | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one worker's load.

    Blocks: `num_used_blocks` are referenced by at least one request; `num_free_blocks`
    can be allocated without preempting anyone (empty blocks plus cached blocks no request
    holds). Prefix-cache and preemption figures are cumulative since the worker started.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_used_blocks: int
    num_prefill_tokens_queued: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_host_blocks: int = 0  # the host tier's capacity (0: no host tier)
    num_host_cached_blocks: int = 0  # blocks held there now
    num_offloaded_blocks: int = 0  # cumulative: device -> host copies
    num_onboarded_blocks: int = 0  # cumulative: host -> device copies (prefix hits in the host tier)
    num_disk_blocks: int = 0  # the disk tier's capacity (0: no disk tier)
    num_disk_cached_blocks: int = 0
    num_spilled_blocks: int = 0  # cumulative: host -> disk writes
    num_loaded_blocks: int = 0  # cumulative: disk -> device reads (prefix hits on disk)
    num_corrupt_disk_blocks: int = 0  # cumulative: block files that failed their check (misses)
    num_host_cached_bytes: int = 0
    num_disk_cached_bytes: int = 0
    prefix_cache_host_hit_tokens: int = 0  # cumulative: the part of prefix_cache_hit_tokens from each tier
    prefix_cache_disk_hit_tokens: int = 0
    num_dropped_by_priority: int = 0  # cumulative: blocks a lower tier would have kept but for their priority

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks in use, 0.0 for a worker with no blocks."""
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens, 0.0 before the first query."""
        if not self.prefix_cache_queried_tokens:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


@dataclass(frozen=True, slots=True)
class KvIntegrity:
    """The KV cache bookkeeping's self-check, with what is still held."""

    ok: bool
    error: str
    num_held_for_peer: int  # requests whose blocks wait on a KV transfer (reserved, held or quarantined)
    num_used_blocks: int
