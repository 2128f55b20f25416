"""The router's workers: registration, health and load.

Registration is the router dialling each configured address: `GetInfo` gives the role, the
block-key parameters, the worker's id (named to decode workers with a prefill worker's address)
and its deployment, checked by `registration.py` (a worker of
another deployment is refused, with a logged reason, and asked again while it answers). Then each worker's stats are polled every
`poll_interval_s`. Contracts:
- a worker is *up* (in rotation) from a successful registration until `failure_threshold`
  polls in a row fail or `mark_down` is called (its stream broke); the listener hears both;
- a down worker is polled on; once it answers, it registers again (its info is re-checked:
  it may have restarted with other settings) and comes back up;
- `load` is the worker's last report corrected by this router's own dispatches (`worker_load.py`);
- membership may change while serving (`discovery.py`): `add` admits a worker through the same
  checks, `drain` takes one out of rotation at once (and out of the index, through the listener)
  but keeps it, and its client, until the streams already on it end (at most `drain_timeout_s`),
  then forgets it.
"""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.common.errors import ConfigError, PdserveError, WorkerUnavailableError
from pdserve.common.ids import DeploymentId, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo, WorkerInfo, WorkerRole
from pdserve.router.routing.cost import WorkerLoad
from pdserve.router.routing.registration import DECODE_ROLES, check_all, check_deployment, check_worker
from pdserve.router.routing.worker_load import Dispatch, LoadBook

log = logging.getLogger(__name__)
_RETRY_S = 0.5
_DRAIN_CHECK_S = 0.2


class WorkerClient(Protocol):
    """One worker's control calls (`GrpcBackend`); each bounded in time."""

    def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                 prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: RequestId) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def info(self) -> WorkerInfo: ...

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo: ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    async def close(self) -> None: ...


class PoolListener(Protocol):
    def worker_up(self, handle: "WorkerHandle") -> None: ...

    def worker_down(self, handle: "WorkerHandle") -> None: ...

    def worker_removed(self, handle: "WorkerHandle") -> None: ...


@dataclass(frozen=True, slots=True)
class PoolConfig:
    poll_interval_s: float = 0.5
    failure_threshold: int = 3
    wait_timeout_s: float = 60.0  # for the workers to answer at start
    deployment_id: DeploymentId | None = None  # admit only workers of this deployment; None: any
    drain_timeout_s: float = 3600.0  # how long a drained worker's streams may run on (a stream's deadline)


@dataclass(slots=True, eq=False)
class WorkerHandle:
    address: WorkerId
    client: WorkerClient
    info: ModelInfo | None = None  # last registration; None before the first
    deployment_id: DeploymentId | None = None  # as the worker reported it at its last registration
    worker_id: WorkerId | None = None  # likewise; None: it did not say
    is_up: bool = False
    num_failures: int = 0
    refusal: str | None = None  # why an answering worker is kept out
    down_reason: str | None = None  # why it was last taken out of rotation; None while up
    is_leaving: bool = False  # drained: never back in rotation; forgotten once its streams end
    book: LoadBook = field(default_factory=LoadBook)

    @property
    def role(self) -> WorkerRole | None:
        return None if self.info is None else self.info.role

    @property
    def stats(self) -> EngineStats | None:
        """The worker's last load report."""
        return self.book.report


class WorkerPool:
    def __init__(self, addresses: Sequence[str], connect: Callable[[str], WorkerClient], config: PoolConfig,
                 hash_algorithm: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.handles = {WorkerId(a): WorkerHandle(WorkerId(a), connect(a)) for a in addresses}
        self.listener: PoolListener | None = None
        self._config = config
        self._hash_algorithm = hash_algorithm
        self._clock = clock
        self._connect = connect
        self._reference: tuple[WorkerId, ModelInfo] | None = None
        self._watchers: dict[WorkerId, asyncio.Task] = {}
        self._drains: dict[WorkerId, asyncio.Task] = {}
        self._is_started = False

    # ---- start and stop ------------------------------------------------------------------------

    async def start(self, discover: Callable[[], Awaitable[object]] | None = None) -> dict[WorkerId, ModelInfo]:
        """Register every worker that answers within `wait_timeout_s`, bring them up, start polling.

        `discover` (DNS discovery's refresh) is called before each try: it may `add` and `drain`
        workers, and while it is given, the wait goes on until a decode-capable worker answered.
        Raises ConfigError naming the worker and field of a mismatch, and WorkerUnavailableError
        if no decode-capable worker answered (and was not refused for its deployment). Returns
        the registered workers' infos."""
        deadline = self._clock() + self._config.wait_timeout_s
        while True:
            if discover is not None:
                await discover()
            await asyncio.gather(*(self._ask_info(h) for h in self._unanswered()))
            if not self._is_waiting(can_grow=discover is not None) or self._clock() + _RETRY_S > deadline:
                break
            await asyncio.sleep(_RETRY_S)
        infos = self._answered()
        check_all(infos, self._hash_algorithm)
        if not any(i.role in DECODE_ROLES for i in infos.values()):
            refused = "".join(f"; refused {h.refusal}" for h in self.handles.values() if h.refusal)
            raise WorkerUnavailableError(",".join(self.handles) or "workers", f"no decode or aggregated worker "
                                         f"answered within {self._config.wait_timeout_s:g} s{refused}")
        self._reference = min(infos.items())
        for handle in self.handles.values():
            if handle.is_leaving:
                continue
            if handle.info is not None:
                self._bring_up(handle)
            elif handle.refusal is None:
                log.warning("worker %s did not answer at start; it joins when it does", handle.address)
        await asyncio.gather(*(self.poll(h) for h in self.handles.values() if h.is_up))  # first loads
        self._is_started = True
        for handle in self.handles.values():
            if not handle.is_leaving:
                self._watchers[handle.address] = asyncio.create_task(self._watch(handle), name=f"watch-{handle.address}")
        return infos

    def _unanswered(self) -> list[WorkerHandle]:
        return [h for h in self.handles.values() if h.info is None and h.refusal is None and not h.is_leaving]

    def _answered(self) -> dict[WorkerId, ModelInfo]:
        return {h.address: h.info for h in self.handles.values() if h.info is not None and not h.is_leaving}

    def _is_waiting(self, can_grow: bool) -> bool:
        """Whether start waits on: a worker has not answered yet, or (when more may join) no
        decode-capable worker has."""
        has_decode = any(i.role in DECODE_ROLES for i in self._answered().values())
        return bool(self._unanswered()) or (can_grow and not has_decode)

    async def close(self) -> None:
        running = [task for task in (*self._watchers.values(), *self._drains.values()) if not task.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.gather(*(h.client.close() for h in self.handles.values()), return_exceptions=True)

    # ---- queries -------------------------------------------------------------------------------

    def up(self, roles: Collection[WorkerRole], exclude: Collection[WorkerId] = ()) -> list[WorkerHandle]:
        return [h for h in self.handles.values() if h.is_up and h.role in roles and h.address not in exclude]

    @property
    def has_prefill_workers(self) -> bool:
        """Whether any worker registered as a prefill worker (up or not)."""
        return any(h.role == WorkerRole.PREFILL for h in self.handles.values())

    def why_out(self) -> str:
        """Why each worker out of rotation is out, e.g. "127.0.0.1:50052: ... draining: ...", for an error."""
        return "; ".join(f"{h.address}: {h.down_reason or h.refusal or 'never answered'}"
                         for h in self.handles.values() if not h.is_up)

    def load(self, handle: WorkerHandle) -> WorkerLoad:
        return handle.book.load()

    # ---- dispatch bookkeeping (see worker_load.py) ---------------------------------------------

    def dispatch(self, handle: WorkerHandle, num_prefill_tokens: int, num_blocks: int) -> Dispatch:
        return handle.book.dispatch(self._clock(), num_prefill_tokens, num_blocks)

    def prefill_done(self, handle: WorkerHandle, entry: Dispatch) -> None:
        handle.book.prefill_done(entry, self._clock())

    def finish(self, handle: WorkerHandle, entry: Dispatch) -> None:
        handle.book.finish(entry, self._clock())

    # ---- health --------------------------------------------------------------------------------

    def mark_down(self, address: WorkerId, reason: str) -> None:
        """Take the worker out of rotation now (a stream to it broke with UNAVAILABLE)."""
        handle = self.handles.get(address)
        if handle is None or not handle.is_up:
            return
        handle.is_up, handle.down_reason = False, reason
        handle.book.clear()
        log.warning("worker %s out of rotation: %s", address, reason)
        if self.listener is not None:
            self.listener.worker_down(handle)

    async def poll(self, handle: WorkerHandle) -> None:
        """One stats query; a failure counts towards `failure_threshold`, a success after
        being down re-registers the worker."""
        asked_at = self._clock()
        try:
            stats = await handle.client.stats()
        except PdserveError as exc:
            handle.num_failures += 1
            if handle.num_failures >= self._config.failure_threshold:
                self.mark_down(handle.address, f"{handle.num_failures} stats queries failed: {exc}")
            return
        handle.book.record_report(stats, asked_at)
        handle.num_failures = 0
        if not handle.is_up:
            await self._rejoin(handle)

    async def probe(self, address: WorkerId) -> bool:
        """One stats query now (a request to the worker just failed); a failure takes the
        worker out of rotation at once. True if the worker is up afterwards (False for a worker
        drained out and forgotten meanwhile)."""
        handle = self.handles.get(address)
        if handle is None:
            return False
        asked_at = self._clock()
        try:
            stats = await handle.client.stats()
        except PdserveError as exc:
            self.mark_down(address, f"a request failed and so did a stats query: {exc}")
            return False
        handle.book.record_report(stats, asked_at)
        return handle.is_up

    async def _watch(self, handle: WorkerHandle, poll_first: bool = False) -> None:
        if poll_first:
            await self.poll(handle)
        while True:
            await asyncio.sleep(self._config.poll_interval_s)
            await self.poll(handle)

    # ---- membership (see discovery.py) ---------------------------------------------------------

    def add(self, address: str) -> None:
        """Admit a worker found while serving: it joins on its first answer, once it passes the
        checks a `--worker` passes. A worker being drained is kept instead; one known is left be."""
        worker = WorkerId(address)
        handle = self.handles.get(worker)
        if handle is None:
            handle = self.handles[worker] = WorkerHandle(worker, self._connect(address))
        elif handle.is_leaving:
            self._drains.pop(worker).cancel()
            handle.is_leaving = False
            log.info("worker %s is back; it joins again on its next answer", worker)
        else:
            return
        if self._is_started:
            self._watchers[worker] = asyncio.create_task(self._watch(handle, poll_first=True), name=f"watch-{worker}")

    def drain(self, address: WorkerId, reason: str) -> None:
        """Route nothing new to the worker and drop its index entries now; forget it (close its
        client, tell the listener `worker_removed`) once the streams on it have ended."""
        handle = self.handles.get(address)
        if handle is None or handle.is_leaving:
            return
        watcher = self._watchers.pop(address, None)
        if watcher is not None:
            watcher.cancel()
        was_up = handle.is_up
        handle.is_up, handle.is_leaving, handle.down_reason = False, True, f"draining: {reason}"
        log.info("worker %s draining (%s): %d stream(s) on it finish first", address, reason, handle.book.num_live)
        if was_up and self.listener is not None:
            self.listener.worker_down(handle)
        self._drains[address] = asyncio.create_task(self._forget_when_idle(handle), name=f"drain-{address}")

    async def _forget_when_idle(self, handle: WorkerHandle) -> None:
        try:
            async with asyncio.timeout(self._config.drain_timeout_s):
                while handle.book.num_live:
                    await asyncio.sleep(_DRAIN_CHECK_S)
        except TimeoutError:
            log.warning("worker %s: %d stream(s) still running after %g s of draining; closing it",
                        handle.address, handle.book.num_live, self._config.drain_timeout_s)
        del self.handles[handle.address]
        self._drains.pop(handle.address, None)
        log.info("worker %s drained out", handle.address)
        await handle.client.close()
        if self.listener is not None:
            self.listener.worker_removed(handle)

    async def _ask_info(self, handle: WorkerHandle) -> None:
        try:
            reply = await handle.client.info()
            check_deployment(handle.address, reply.deployment_id, self._config.deployment_id)
        except ConfigError as exc:
            self._refuse(handle, exc)
            return
        except PdserveError as exc:
            log.debug("worker %s: no info yet: %s", handle.address, exc)
            return
        handle.info, handle.deployment_id, handle.worker_id = reply.model, reply.deployment_id, reply.worker_id

    async def _rejoin(self, handle: WorkerHandle) -> None:
        try:
            reply = await handle.client.info()
            check_deployment(handle.address, reply.deployment_id, self._config.deployment_id)
            check_worker(handle.address, reply.model, self._hash_algorithm, self._reference)
        except ConfigError as exc:
            self._refuse(handle, exc)
            return
        except PdserveError:
            return
        handle.info, handle.deployment_id, handle.worker_id = reply.model, reply.deployment_id, reply.worker_id
        self._bring_up(handle)

    def _refuse(self, handle: WorkerHandle, reason: ConfigError) -> None:
        """Keep an answering worker out; log why once per distinct reason."""
        if str(reason) != handle.refusal:
            handle.refusal = str(reason)
            log.error("worker %s refused: %s", handle.address, reason)

    def _bring_up(self, handle: WorkerHandle) -> None:
        if handle.is_leaving:
            return
        handle.is_up, handle.num_failures, handle.refusal, handle.down_reason = True, 0, None, None
        log.info("worker %s (%s, deployment %s) in rotation", handle.address, handle.role,
                 handle.deployment_id or "none")
        if self.listener is not None:
            self.listener.worker_up(handle)
