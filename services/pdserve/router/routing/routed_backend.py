"""`GenerateBackend` over many workers: each request is routed (see `planner.py`), then the
chosen decode worker's stream is relayed, told which prefill worker to use.

Contracts, beyond `GenerateBackend`'s:
- a request is never failed by a worker that is unreachable before it answered: the worker
  is probed (and taken out of rotation if the probe fails too) and the request routed again,
  each decode worker at most once;
- a request whose decode worker becomes unreachable mid-stream is migrated (`migration.py`):
  continued on another decode worker from the tokens already streamed, up to the policy's limit;
- every dispatch counts on its workers' load until the request ends (its prefill part until
  the first output), so the next decision sees it before the workers report it; its prompt's
  keys count on their overlaps (`PrefixIndex.hold`) for as long;
- each decision is logged and kept for `describe_route` (the HTTP layer's response header).
"""
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import fields, replace

from pdserve.common.errors import WorkerUnavailableError
from pdserve.common.ids import BlockHash, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo
from pdserve.kvcache import hash_request_blocks
from pdserve.router.backend import GenerateBackend
from pdserve.router.routing.cluster import Cluster
from pdserve.router.routing.lora_catalog import LoraCatalog
from pdserve.router.routing.migration import MigrationPolicy, Progress, as_original, can_migrate, continuation
from pdserve.router.routing.planner import Planner, RouteDecision
from pdserve.router.routing.registration import DECODE_ROLES
from pdserve.router.routing.routing_metrics import RoutingCollector
from pdserve.router.routing.worker_load import Dispatch
from pdserve.router.routing.worker_pool import WorkerHandle

log = logging.getLogger(__name__)
MAX_KEPT_DECISIONS = 4096


def prompt_block_keys(request: GenerationRequest, tokens_per_block: int) -> list[BlockHash]:
    """The keys a worker would look up: full blocks, leaving the last prompt token to compute."""
    num_blocks = (len(request.prompt_token_ids) - 1) // tokens_per_block
    tokens = request.prompt_token_ids[:num_blocks * tokens_per_block]
    return hash_request_blocks(tokens, tokens_per_block, request.lora_id, request.multimodal, request.cache_salt)


class RoutedBackend:
    def __init__(self, cluster: Cluster, planner: Planner, info: ModelInfo, session_header: str | None = None,
                 migration: MigrationPolicy = MigrationPolicy()) -> None:
        self.session_header = session_header
        self._cluster = cluster
        self._pool = cluster.pool
        self._planner = planner
        self._info = info
        self._decisions: OrderedDict[RequestId, RouteDecision] = OrderedDict()
        self._live: dict[RequestId, tuple[RequestId, RouteDecision]] = {}  # client's id -> (worker's id, route)
        self._migration = migration

    async def generate(self, request: GenerationRequest, session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        keys = prompt_block_keys(request, self._info.tokens_per_block)
        failed: dict[WorkerId, WorkerUnavailableError] = {}  # decode workers that failed it, in order
        progress = Progress()
        attempt, unsent_text = request, ""  # the request a worker runs: the original or a continuation
        while True:
            try:
                decision = self._planner.plan(keys, len(attempt.prompt_token_ids), failed, session_id)
            except WorkerUnavailableError:
                if failed:  # the last worker's own failure says more than "none left"
                    raise list(failed.values())[-1] from None
                raise
            self._note(request.request_id, decision)
            has_output = False
            try:
                async with aclosing(self._dispatch(attempt, keys, decision, request.request_id)) as outputs:
                    async for output in outputs:
                        has_output = True
                        if attempt is not request:
                            output, unsent_text = as_original(output, request, unsent_text), ""
                        progress.add(output)
                        yield output
                return
            except WorkerUnavailableError as exc:
                worker = decision.decode.worker
                await self._pool.probe(worker)
                failed[worker] = exc
                if not has_output:
                    log.warning("request %s: worker %s failed before answering (%s); routing again",
                                request.request_id, worker, exc.reason)
                    self._cluster.counters.retries[worker] += 1
                    continue
                if not can_migrate(request, progress, self._migration):
                    raise
                unsent_text += progress.unsent_text(request, self._migration.decode)
                attempt = continuation(request, progress)
                progress.num_migrations += 1
                keys = prompt_block_keys(attempt, self._info.tokens_per_block)
                self._cluster.counters.migrations[worker] += 1
                log.warning("request %s: decode worker %s failed after %d tokens (%s); migrating it (%d of at "
                            "most %d)", request.request_id, worker, len(progress.token_ids), exc.reason,
                            progress.num_migrations, self._migration.limit)

    async def _dispatch(self, request: GenerationRequest, keys: Sequence[BlockHash], decision: RouteDecision,
                        client_id: RequestId) -> AsyncIterator[RequestOutput]:
        """Relay the decode worker's stream, with the decision's load and the prompt's `keys` on
        its workers meanwhile. `client_id`: the id the client knows the request by (`request`
        may be a continuation)."""
        pool, tpb, index = self._pool, self._info.tokens_per_block, self._cluster.index
        decode = pool.handles[decision.decode.worker]
        prefill = pool.handles[decision.prefill.worker] if decision.prefill else None
        prefiller_leg = decision.prefill or decision.decode
        num_new_tokens = max(len(request.prompt_token_ids) - prefiller_leg.overlap.num_blocks * tpb, 0)
        decode_load = pool.dispatch(decode, num_new_tokens if prefill is None else 0, decision.num_prompt_blocks)
        prefill_load = pool.dispatch(prefill, num_new_tokens, decision.num_prompt_blocks) if prefill else None
        index.hold(decode.address, keys)
        if prefill is not None:
            index.hold(prefill.address, keys)
        self._live[client_id] = (request.request_id, decision)
        try:
            sent = replace(request, block_keys=tuple(keys))  # hashed here once: the workers check the first
            outputs = decode.client.generate(sent, prefill.address if prefill else None,
                                             prefill.worker_id if prefill else None)
            async with aclosing(outputs):
                is_first = True
                async for output in outputs:
                    if is_first:  # the prompt is prefilled
                        is_first = False
                        pool.prefill_done(decode, decode_load)
                        self._finish(prefill, prefill_load, keys)
                        prefill = None  # its leg is over
                        self._note_prefill_path(client_id, decision, output.prefilled_by)
                    yield output
        finally:
            self._live.pop(client_id, None)
            pool.finish(decode, decode_load)
            index.release(decode.address, keys)
            self._finish(prefill, prefill_load, keys)

    def _finish(self, handle: WorkerHandle | None, entry: Dispatch | None, keys: Sequence[BlockHash]) -> None:
        """The prefill leg's end: its load and its hold on the prompt's keys."""
        if handle is not None and entry is not None:
            self._pool.finish(handle, entry)
            self._cluster.index.release(handle.address, keys)

    def _note(self, request_id: RequestId, decision: RouteDecision) -> None:
        counters = self._cluster.counters
        counters.count_route(decision.decode.worker, "decode", decision.num_prompt_blocks, decision.decode.overlap)
        if decision.prefill is not None:
            counters.count_route(decision.prefill.worker, "prefill", decision.num_prompt_blocks,
                                 decision.prefill.overlap)
        counters.num_decode_only_fallbacks += decision.is_decode_only_fallback
        counters.num_local_prefills_for_queue += decision.is_local_for_queue
        self._decisions[request_id] = decision
        self._decisions.move_to_end(request_id)
        while len(self._decisions) > MAX_KEPT_DECISIONS:
            self._decisions.popitem(last=False)
        log.info("route %s %s", request_id, decision.describe())

    def _note_prefill_path(self, request_id: RequestId, decision: RouteDecision, prefilled_by: str) -> None:
        """Keep the path that ran for `describe_route`; count a prefill worker that was chosen
        but not used (the decode worker prefilled locally: few tokens missing, peer down, ...)."""
        if not prefilled_by:  # an aggregated worker says nothing: it always prefills itself
            return
        if decision.prefill is not None and prefilled_by != decision.prefill.worker:
            self._cluster.counters.num_local_prefills_instead += 1
            log.info("route %s: decode worker %s prefilled locally instead of on %s", request_id,
                     decision.decode.worker, decision.prefill.worker)
        if request_id in self._decisions:
            self._decisions[request_id] = replace(decision, prefilled_by=prefilled_by)

    def describe_route(self, request_id: RequestId) -> str | None:
        """The request's latest decision (`RouteDecision.describe`), once; None if unknown."""
        decision = self._decisions.pop(request_id, None)
        return None if decision is None else decision.describe()

    def for_session(self, session_id: str) -> GenerateBackend:
        return _SessionBackend(self, session_id)

    def metrics_collector(self) -> RoutingCollector:
        return self._cluster.collector()

    async def abort(self, request_id: RequestId) -> None:
        live = self._live.get(request_id)
        if live is not None:
            worker_request_id, decision = live
            await self._pool.handles[decision.decode.worker].client.abort(worker_request_id)

    async def stats(self) -> EngineStats:
        """The sum over workers in rotation; WorkerUnavailableError, naming why each worker is out,
        if no decode worker is."""
        if not self._pool.up(DECODE_ROLES):
            raise WorkerUnavailableError("decode", f"no decode or aggregated worker is up ({self._pool.why_out()})")
        reports = [h.stats for h in self._pool.handles.values() if h.is_up and h.stats is not None]
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in reports) for f in fields(EngineStats)})

    async def info(self) -> ModelInfo:
        return self._info

    def lora_adapters(self) -> Sequence[LoraAdapterInfo]:
        return self._catalog().lora_adapters()

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        return await self._catalog().load(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._catalog().unload(name)

    def _catalog(self) -> LoraCatalog:
        assert self._cluster.loras is not None, "the cluster starts before the backend serves"
        return self._cluster.loras

    async def close(self) -> None:
        await self._cluster.close()


class _SessionBackend:
    """The routed backend, with every request of one session id."""

    def __init__(self, routed: RoutedBackend, session_id: str) -> None:
        self._routed = routed
        self._session_id = session_id

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self._routed.generate(request, self._session_id)

    async def abort(self, request_id: RequestId) -> None:
        await self._routed.abort(request_id)

    async def stats(self) -> EngineStats:
        return await self._routed.stats()

    async def info(self) -> ModelInfo:
        return await self._routed.info()

    async def close(self) -> None:
        """The app closes the routed backend itself; a session view owns nothing."""
