"""The host tier's bytes: one KV block per slot, in host memory (pinned when the device is CUDA),
and the copies between it and the device KV tensor that the KV cache manager queues."""
from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.common.ids import BlockId
from pdserve.kvcache.lower_tier import MoveKind, TierMove


class TierStore(Protocol):
    """What makes the KV cache manager's moves between tiers (`KvCacheManager.drain_tier_moves`)."""

    def apply(self, moves: Sequence[TierMove]) -> list[BlockId]:
        """Make the moves in order; the device blocks whose copy back failed (their KV is wrong)."""


class HostKvStore:
    """`num_slots` blocks shaped like one block of `kv_tensor` (every layer, K and V)."""

    def __init__(self, kv_tensor: torch.Tensor, num_slots: int) -> None:
        pin = kv_tensor.device.type == "cuda"
        self.kv_tensor = kv_tensor
        self.slots = torch.zeros((num_slots, *kv_tensor.shape[1:]), dtype=kv_tensor.dtype, pin_memory=pin)

    @property
    def num_bytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def apply(self, moves: Sequence[TierMove]) -> list[BlockId]:
        """Make the copies in order (an onboard may read a slot a later offload reuses); memory
        copies do not fail, so no block comes back."""
        with torch.inference_mode():
            for move in moves:
                if move.kind is MoveKind.OFFLOAD:
                    self.slots[move.slot].copy_(self.kv_tensor[move.block_id])
                elif move.kind is MoveKind.ONBOARD:
                    self.kv_tensor[move.block_id].copy_(self.slots[move.slot], non_blocking=True)
                else:
                    raise ValueError(f"{move.kind} is no host-tier move")
        return []
