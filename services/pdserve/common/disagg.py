"""What a decode worker asks of a prefill worker, and what it gets back (no protobuf here)."""
from dataclasses import dataclass

from pdserve.common.ids import BlockId, WorkerId
from pdserve.common.request import GenerationRequest, TokenLogprob


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """Compute `request`'s prompt and write its blocks `first_block..` into `dest_block_ids`.

        # prompt blocks | 0 .. first_block: decode already holds | first_block ..: moved |
    """

    request: GenerationRequest
    decode_worker_id: WorkerId
    first_block: int
    dest_block_ids: tuple[BlockId, ...]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    logprob: TokenLogprob | None
    num_cached_tokens: int  # prompt tokens the prefill worker reused from its own cache
    num_blocks: int  # blocks written to the decode worker
    num_bytes: int
