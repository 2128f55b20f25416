"""The LoRA adapters the router serves, by name, kept in step with its workers.

At start it takes the adapters the workers report (`--lora-modules`); a runtime load or unload
goes to every worker in rotation at once and changes the catalog only once all of them have done
it, so the router never names an adapter that a worker it routes to lacks. A worker that
(re)joins gets the adapters loaded meanwhile (`sync_worker`), so a worker restarted by
`pdserve serve`, or down during a load, serves the same adapters as the others.
"""
import asyncio
import logging
from collections.abc import Mapping, Sequence

from pdserve.common.errors import InvalidRequestError, PdserveError, UnknownLoraAdapterError, WorkerUnavailableError
from pdserve.common.ids import WorkerId
from pdserve.common.stats import LoraAdapterInfo, ModelInfo
from pdserve.router.routing.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)


class LoraCatalog:
    def __init__(self, pool: WorkerPool, infos: Mapping[WorkerId, ModelInfo]) -> None:
        self._pool = pool
        self._adapters: dict[str, LoraAdapterInfo] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        for address in sorted(infos):
            for adapter in infos[address].lora_adapters:
                known = self._adapters.setdefault(adapter.name, adapter)
                if known.lora_id != adapter.lora_id:
                    log.warning("worker %s serves LoRA adapter %r from other files (%s) than another worker (%s)",
                                address, adapter.name, adapter.path, known.path)

    def lora_adapters(self) -> Sequence[LoraAdapterInfo]:
        return tuple(self._adapters.values())

    async def load(self, name: str, path: str) -> LoraAdapterInfo:
        async with self._lock:
            if name in self._adapters:
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            results = await self._on_every_worker(lambda h: h.client.load_lora_adapter(name, path))
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0]
            adapter = results[0]
            self._adapters[name] = adapter
        log.info("LoRA adapter %r loaded on %d worker(s) from %s", name, len(results), path)
        return adapter

    async def unload(self, name: str) -> None:
        async with self._lock:
            if name not in self._adapters:
                raise UnknownLoraAdapterError(f"The lora adapter '{name}' cannot be found.")
            results = await self._on_every_worker(lambda h: h.client.unload_lora_adapter(name))
            failures = [r for r in results if isinstance(r, BaseException)
                        and not isinstance(r, UnknownLoraAdapterError)]  # gone there already
            if failures:
                raise failures[0]
            del self._adapters[name]
        log.info("LoRA adapter %r unloaded", name)

    async def sync_worker(self, handle: WorkerHandle) -> None:
        """Load on a (re)joining worker the adapters it lacks (failures are logged)."""
        held = {a.name for a in handle.info.lora_adapters} if handle.info else set()
        for adapter in [a for a in self._adapters.values() if a.name not in held]:
            try:
                await handle.client.load_lora_adapter(adapter.name, adapter.path)
            except PdserveError as exc:
                log.warning("worker %s could not load LoRA adapter %r: %s", handle.address, adapter.name, exc)

    async def _on_every_worker(self, call) -> list:
        """`call(handle)` on every worker in rotation at once; results or exceptions, in order."""
        handles = [h for h in self._pool.handles.values() if h.is_up]
        if not handles:
            raise WorkerUnavailableError(",".join(self._pool.handles), f"no worker is up ({self._pool.why_out()})")
        return await asyncio.gather(*(call(h) for h in handles), return_exceptions=True)
