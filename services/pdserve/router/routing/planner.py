"""Where one request goes: a decode worker and, when one is up, a prefill worker.

    prefill worker p  = policy over role-prefill workers, cost_p = prefill_cost(p)
    decode worker d   = policy over role-decode and role-both workers, with
                        cost_d = decode_cost(d) + cost_p   (role decode, p computes the prompt)
                        cost_d = prefill_cost(d)           (role both, or no prefill worker up)
A role-both worker prefills its own prompts, so it is never sent a prefill worker. Overlaps
come from the prefix index, loads from the pool. A session id pins a session to the workers
its last request used, while they remain candidates.
"""
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import BlockHash, WorkerId
from pdserve.common.stats import WorkerRole
from pdserve.router.routing.cost import CostWeights, WorkerLoad, decode_cost, num_prompt_blocks, prefill_cost
from pdserve.router.routing.policy import Candidate, Policy, make_policy
from pdserve.router.routing.prefix_index import Overlap, PrefixIndex
from pdserve.router.routing.registration import DECODE_ROLES
from pdserve.router.routing.session_affinity import SessionAffinity
from pdserve.router.routing.worker_pool import WorkerHandle, WorkerPool


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: str = "kv_aware"
    temperature: float = 0.0
    weights: CostWeights = CostWeights()
    session_ttl_s: float = 600.0


@dataclass(frozen=True, slots=True)
class Leg:
    worker: WorkerId
    overlap: Overlap
    cost: float


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode: Leg
    prefill: Leg | None  # None: the decode worker prefills the prompt itself
    num_prompt_blocks: int
    is_decode_only_fallback: bool  # prefill workers exist, but none was up
    prefilled_by: str = ""  # what the decode worker's first output reported: an address, or "local"

    def describe(self) -> str:
        """`decode=<addr>;decode_overlap=<blocks>[;prefill=<addr>;prefill_overlap=<blocks>];prompt_blocks=<n>`,
        then `;prefilled_by=<addr|local>` once the decode worker has said where the prompt was computed."""
        parts = [f"decode={self.decode.worker}", f"decode_overlap={self.decode.overlap.num_blocks}"]
        if self.prefill is not None:
            parts += [f"prefill={self.prefill.worker}", f"prefill_overlap={self.prefill.overlap.num_blocks}"]
        parts.append(f"prompt_blocks={self.num_prompt_blocks}")
        if self.prefilled_by:
            parts.append(f"prefilled_by={self.prefilled_by}")
        return ";".join(parts)


CostOf = Callable[[WorkerHandle, Overlap, WorkerLoad], float]


class Planner:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, config: RoutingConfig, tokens_per_block: int,
                 rng: random.Random | None = None) -> None:
        rng = rng or random.Random()
        self._pool = pool
        self._index = index
        self._config = config
        self._tpb = tokens_per_block
        self._prefill_policy = make_policy(config.policy, config.temperature, rng)
        self._decode_policy = make_policy(config.policy, config.temperature, rng)
        self._sessions = SessionAffinity(config.session_ttl_s)

    def plan(self, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
             exclude: Collection[WorkerId] = (), session_id: str | None = None) -> RouteDecision:
        """Raises WorkerUnavailableError when no decode-capable worker outside `exclude` is up."""
        decoders = self._pool.up(DECODE_ROLES, exclude)
        if not decoders:
            why = self._pool.why_out()
            raise WorkerUnavailableError("decode", "no decode or aggregated worker is up" + (f" ({why})" if why else ""))
        prefillers = self._pool.up({WorkerRole.PREFILL}, exclude)
        blocks = num_prompt_blocks(num_prompt_tokens, self._tpb)
        overlaps = self._index.overlaps(block_hashes, [h.address for h in decoders + prefillers])
        sticky = self._sessions.get(session_id) if session_id else None
        prefill = None
        if prefillers:
            prefill = self._pick(self._prefill_policy, prefillers, overlaps, partial(self._local_cost, blocks),
                                 sticky.prefill if sticky else None)
        decode = self._pick(self._decode_policy, decoders, overlaps, partial(self._decode_cost, blocks, prefill),
                            sticky.decode if sticky else None)
        if self._pool.handles[decode.worker].role == WorkerRole.BOTH:
            prefill = None  # it prefills its own prompts
        if session_id:
            self._sessions.remember(session_id, decode.worker, prefill.worker if prefill else None)
        return RouteDecision(decode, prefill, blocks, not prefillers and self._pool.has_prefill_workers)

    def _local_cost(self, blocks: int, handle: WorkerHandle, overlap: Overlap, load: WorkerLoad) -> float:
        return prefill_cost(blocks, overlap, load, self._tpb, self._config.weights)

    def _decode_cost(self, blocks: int, prefill: Leg | None, handle: WorkerHandle, overlap: Overlap,
                     load: WorkerLoad) -> float:
        if prefill is None or handle.role == WorkerRole.BOTH:
            return self._local_cost(blocks, handle, overlap, load)
        return decode_cost(blocks, overlap, load, self._config.weights) + prefill.cost

    def _pick(self, policy: Policy, handles: Sequence[WorkerHandle], overlaps: dict[WorkerId, Overlap],
              cost_of: CostOf, sticky: WorkerId | None) -> Leg:
        """The session's worker if it is a candidate, else the policy's choice."""
        legs = {}
        candidates = []
        for handle in handles:
            load = self._pool.load(handle)
            overlap = overlaps[handle.address]
            leg = legs[handle.address] = Leg(handle.address, overlap, cost_of(handle, overlap, load))
            candidates.append(Candidate(handle.address, leg.cost, load.num_requests, load.num_active_blocks))
        return legs[sticky] if sticky in legs else legs[policy.choose(candidates).worker]
