"""Builders for KV cache manager tests."""
from collections.abc import Sequence

import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import PriorityRange
from pdserve.kvcache import CacheRequest, KvCacheConfig, KvCacheManager


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_manager(num_blocks: int = 8, tokens_per_block: int = 4, clock: FakeClock | None = None,
                 num_host_blocks: int = 0, num_disk_blocks: int = 0, disk_verifier=None, **config) -> KvCacheManager:
    cfg = KvCacheConfig(tokens_per_block=tokens_per_block, **config)
    return KvCacheManager(cfg, num_blocks, clock=clock or FakeClock(), num_host_blocks=num_host_blocks,
                          num_disk_blocks=num_disk_blocks, disk_verifier=disk_verifier)


def make_request(request_id: str, tokens: Sequence[int], *, priorities: Sequence[tuple] = (), **kw) -> CacheRequest:
    ranges = tuple(PriorityRange(*p) for p in priorities)
    return CacheRequest(RequestId(request_id), list(tokens), priorities=ranges, **kw)


def run_to_completion(manager: KvCacheManager, request: CacheRequest) -> None:
    """Admit, compute the whole prompt, and free: leaves the prompt's full blocks cached."""
    claim = manager.add_sequence(request)
    manager.mark_computed(request.request_id, len(request.token_ids) - claim.num_cached_tokens)
    manager.free(request.request_id)
    manager.check_integrity()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
