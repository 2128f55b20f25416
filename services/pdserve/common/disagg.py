"""What a decode worker asks of a prefill worker, and what it gets back (no protobuf here)."""
from dataclasses import dataclass, field

from pdserve.common.ids import BlockId, WorkerId
from pdserve.common.request import GenerationRequest, TokenLogprob


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """Compute `request`'s prompt and write its blocks `first_block..` into `dest_block_ids`.

        # prompt blocks | 0 .. first_block: decode already holds | first_block ..: moved |

    Times are Unix seconds, so both sides read them alike; the decode worker's lease on the
    blocks outlasts `deadline` (by its grace, which also covers the hosts' clock skew).
    """

    request: GenerationRequest
    decode_worker_id: WorkerId
    first_block: int
    dest_block_ids: tuple[BlockId, ...]
    deadline: float  # no byte may land after it: no write starts, and one under way fails, then
    start_by: float = 0.0  # the prefill is refused unless it starts by then (0: by the deadline)
    nonce: bytes = b""  # fresh per order: a second order with the same nonce is refused
    grant: bytes = b""  # the decode worker's HMAC over the fields above (worker/kv/write_grants.py)

    @property
    def latest_start(self) -> float:
        return self.start_by or self.deadline


@dataclass(frozen=True, slots=True)
class Hello:
    """One side of a KV handshake: who we are, our transport metadata, our deployment, and (from
    a decode worker) the key its write grants are signed with."""

    worker_id: WorkerId
    metadata: bytes
    deployment_id: str = ""
    order_key: bytes = field(default=b"", repr=False)
    lora_ids: frozenset[int] = frozenset()  # the LoRA adapters this side holds now


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    logprob: TokenLogprob | None
    num_cached_tokens: int  # prompt tokens the prefill worker reused from its own cache
    num_blocks: int  # blocks handed to the decode worker (some may lack window layers' slices)
    num_bytes: int  # bytes written
