"""Where one request goes: a decode worker and, when one is up, a prefill worker.

    prefill worker p  = policy over role-prefill workers, cost_p = prefill_cost(p)
    decode worker d   = policy over role-decode and role-both workers, with
                        cost_d = decode_cost(d) + cost_p   (role decode, p computes the prompt)
                        cost_d = prefill_cost(d)           (role both, no prefill worker up,
                                                            or d prefills because p's queue is deep)
A role-both worker prefills its own prompts, so it is never sent a prefill worker. A decode
worker computes the prompt itself (Dynamo's conditional disaggregation) while p has at least
`local_prefill_queue_tokens` prompt tokens queued and d at most that many, this prompt's
included: during a burst both kinds of worker prefill, with a bounded stall for d's streams;
requests that come one at a time still go to p.
Overlaps come from the prefix index, loads from the pool. A session id pins a session to the
workers its last request used, while they remain candidates.
"""
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import BlockHash, WorkerId
from pdserve.common.stats import WorkerRole
from pdserve.router.routing.cost import (CostWeights, WorkerLoad, decode_costs, new_blocks_each, num_prompt_blocks,
                                         prefill_costs)
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
    local_prefill_queue_tokens: int = 2048  # 0: a decode worker never prefills for a queue


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
    is_local_for_queue: bool = False  # a prefill worker was up, its queue too deep: prefilled on decode

    def describe(self) -> str:
        """`decode=<addr>;decode_overlap=<blocks>[;prefill=<addr>;prefill_overlap=<blocks>];prompt_blocks=<n>`,
        then `;prefilled_by=<addr|local>` once the decode worker has said where the prompt was computed."""
        parts = [f"decode={self.decode.worker}", f"decode_overlap={self.decode.overlap.num_blocks}"]
        if self.prefill is not None:
            parts += [f"prefill={self.prefill.worker}", f"prefill_overlap={self.prefill.overlap.num_blocks}"]
        elif self.is_local_for_queue:
            parts.append("prefill=local_for_queue")
        parts.append(f"prompt_blocks={self.num_prompt_blocks}")
        if self.prefilled_by:
            parts.append(f"prefilled_by={self.prefilled_by}")
        return ";".join(parts)


_ROUTED_ROLES = (*DECODE_ROLES, WorkerRole.PREFILL)
_role = attrgetter("info.role")  # of a worker in rotation (registered); in C, unlike the property
CostsOf = Callable[[Sequence[WorkerHandle], list[Overlap], list[WorkerLoad]], list[float]]


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
        decoders, prefillers = self._up(exclude)
        if not decoders:
            why = self._pool.why_out()
            raise WorkerUnavailableError("decode", "no decode or aggregated worker is up" + (f" ({why})" if why else ""))
        blocks = num_prompt_blocks(num_prompt_tokens, self._tpb)
        overlaps = self._index.overlaps(block_hashes, [h.address for h in decoders + prefillers])
        sticky = self._sessions.get(session_id) if session_id else None
        prefill = None
        if prefillers:
            prefill = self._pick(self._prefill_policy, prefillers, overlaps, partial(self._local_costs, blocks),
                                 sticky.prefill if sticky else None)
        decode = self._pick(self._decode_policy, decoders, overlaps, partial(self._decode_costs, blocks, prefill),
                            sticky.decode if sticky else None)
        for_queue = False
        if prefill is not None:
            handle = self._pool.handles[decode.worker]
            if self._prefills_here(blocks, prefill, [handle], [decode.overlap], [self._pool.load(handle)])[0]:
                for_queue = handle.role is WorkerRole.DECODE  # a role-both worker prefills its own prompts
                prefill = None
        if session_id:
            self._sessions.remember(session_id, decode.worker, prefill.worker if prefill else None)
        return RouteDecision(decode, prefill, blocks, not prefillers and self._pool.has_prefill_workers,
                             is_local_for_queue=for_queue)

    def _up(self, exclude: Collection[WorkerId]) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """The decode-capable and the prefill workers in rotation, in one pass over the pool. The
        roles are a tuple: membership in a set would hash an enum member in Python, per worker."""
        decoders, prefillers = [], []
        for handle in self._pool.up(_ROUTED_ROLES, exclude):
            (prefillers if _role(handle) is WorkerRole.PREFILL else decoders).append(handle)
        return decoders, prefillers

    def _local_costs(self, blocks: int, handles: Sequence[WorkerHandle], overlaps: list[Overlap],
                     loads: list[WorkerLoad]) -> list[float]:
        return prefill_costs(blocks, overlaps, loads, self._tpb, self._config.weights)

    def _decode_costs(self, blocks: int, prefill: Leg | None, handles: Sequence[WorkerHandle],
                      overlaps: list[Overlap], loads: list[WorkerLoad]) -> list[float]:
        if prefill is None:
            return self._local_costs(blocks, handles, overlaps, loads)
        remote = [c + prefill.cost for c in decode_costs(blocks, overlaps, loads, self._config.weights)]
        is_local = self._prefills_here(blocks, prefill, handles, overlaps, loads)
        if not any(is_local):
            return remote
        local = self._local_costs(blocks, handles, overlaps, loads)
        return [lc if b else rc for b, lc, rc in zip(is_local, local, remote, strict=True)]

    def _prefills_here(self, blocks: int, prefill: Leg, handles: Sequence[WorkerHandle], overlaps: list[Overlap],
                       loads: list[WorkerLoad]) -> list[bool]:
        """Per decode candidate: does it compute the prompt itself rather than `prefill`? A
        role-both worker always; a decode worker while the prefill worker has at least `limit`
        prompt tokens queued and it has at most `limit`, this prompt's included (so the stall
        its running streams see stays bounded)."""
        is_local = [_role(h) is WorkerRole.BOTH for h in handles]
        limit, weights = self._config.local_prefill_queue_tokens, self._config.weights
        queued = self._pool.load(self._pool.handles[prefill.worker]).num_prefill_tokens
        if not limit or queued < limit:
            return is_local
        local_waits = [load.num_prefill_tokens + new * self._tpb
                       for new, load in zip(new_blocks_each(blocks, overlaps, weights), loads, strict=True)]
        return [b or wait <= limit for b, wait in zip(is_local, local_waits, strict=True)]

    def _pick(self, policy: Policy, handles: Sequence[WorkerHandle], overlaps: dict[WorkerId, Overlap],
              costs_of: CostsOf, sticky: WorkerId | None) -> Leg:
        """The session's worker if it is a candidate, else the policy's choice. Every worker of a
        role is priced in one call; nothing per worker is built beyond its candidate."""
        loads = [self._pool.load(h) for h in handles]
        costs = costs_of(handles, [overlaps[h.address] for h in handles], loads)
        candidates = [Candidate(h.address, cost, load.num_requests, load.num_active_blocks)
                      for h, cost, load in zip(handles, costs, loads, strict=True)]
        chosen = next((c for c in candidates if c.worker == sticky), None) if sticky else None
        chosen = chosen or policy.choose(candidates)
        return Leg(chosen.worker, overlaps[chosen.worker], chosen.cost)
