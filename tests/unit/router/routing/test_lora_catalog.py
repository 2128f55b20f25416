"""The router's LoRA catalog: seeded from the workers' reports, a load or unload reaches every
worker and changes the catalog only when all of them did it, a rejoining worker gets the adapters
loaded since; and the router's block keys (its prefix index's keys) are the adapter's own."""
import asyncio
import dataclasses

import pytest

from pdserve.common.errors import InvalidRequestError, UnknownLoraAdapterError, WorkerUnavailableError
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest
from pdserve.common.stats import LoraAdapterInfo
from pdserve.router.routing.lora_catalog import LoraCatalog
from pdserve.router.routing.routed_backend import prompt_block_keys
from pdserve.router.routing.worker_pool import WorkerPool
from tests.unit.router.routing.cluster_fakes import TPB, FakeWorker, info, make_pool

A, B = "127.0.0.1:1", "127.0.0.1:2"
SQL = LoraAdapterInfo("sql", 7, "/adapters/sql")


def catalog(**reported: tuple[LoraAdapterInfo, ...]) -> tuple[LoraCatalog, dict[str, FakeWorker], WorkerPool]:
    workers = {a: FakeWorker(a, dataclasses.replace(info(), lora_adapters=reported.get(n, ())))
               for n, a in (("a", A), ("b", B))}
    pool = make_pool(workers)
    infos = asyncio.run(pool.start())
    return LoraCatalog(pool, infos), workers, pool


def test_the_catalog_starts_with_what_the_workers_report() -> None:
    loras, _, _ = catalog(a=(SQL,), b=(SQL,))
    assert loras.lora_adapters() == (SQL,)


def test_a_load_reaches_every_worker() -> None:
    loras, workers, pool = catalog()
    adapter = asyncio.run(loras.load("chat", "/adapters/chat"))
    assert adapter == LoraAdapterInfo("chat", len("/adapters/chat"), "/adapters/chat")
    assert [list(w.loras) for w in workers.values()] == [["chat"], ["chat"]]
    assert loras.lora_adapters() == (adapter,)
    with pytest.raises(InvalidRequestError, match="already been loaded"):
        asyncio.run(loras.load("chat", "/adapters/other"))


def test_a_worker_out_of_rotation_is_left_to_its_rejoin() -> None:
    loras, workers, pool = catalog()
    workers[B].is_down = True
    pool.mark_down(WorkerId(B), "connection refused")
    asyncio.run(loras.load("chat", "/adapters/chat"))
    assert list(workers[A].loras) == ["chat"] and workers[B].loras == {}
    workers[B].is_down = False
    handle = pool.handles[WorkerId(B)]
    asyncio.run(loras.sync_worker(handle))
    assert list(workers[B].loras) == ["chat"]


def test_a_load_one_worker_refuses_is_not_served() -> None:
    loras, workers, pool = catalog()
    workers[B].lora_error = InvalidRequestError("rank 64 exceeds --max-lora-rank 16", "lora_path")
    with pytest.raises(InvalidRequestError, match="rank 64"):
        asyncio.run(loras.load("chat", "/adapters/chat"))
    assert loras.lora_adapters() == ()


def test_an_unload_reaches_every_worker_and_tolerates_one_that_lacks_it() -> None:
    loras, workers, pool = catalog(a=(SQL,))
    workers[A].loras["sql"] = SQL  # B never had it
    asyncio.run(loras.unload("sql"))
    assert loras.lora_adapters() == () and workers[A].loras == {}
    with pytest.raises(UnknownLoraAdapterError, match="cannot be found"):
        asyncio.run(loras.unload("sql"))


def test_an_unload_a_worker_fails_keeps_the_adapter() -> None:
    loras, workers, pool = catalog(a=(SQL,), b=(SQL,))
    workers[B].lora_error = WorkerUnavailableError(B, "connection refused")
    with pytest.raises(WorkerUnavailableError):
        asyncio.run(loras.unload("sql"))
    assert loras.lora_adapters() == (SQL,)


def test_a_rejoining_worker_gets_the_adapters_loaded_since_it_started() -> None:
    loras, workers, pool = catalog(a=(SQL,))
    asyncio.run(loras.sync_worker(pool.handles[WorkerId(B)]))
    assert list(workers[B].loras) == ["sql"]


def test_the_router_keys_a_prompt_under_each_adapter_apart() -> None:
    prompt = tuple(range(3, 3 + 4 * TPB + 1))
    keys = {lora_id: prompt_block_keys(GenerationRequest(RequestId("r"), prompt, lora_id=lora_id), TPB)
            for lora_id in (None, 7, 8)}
    assert all(len(k) == 4 for k in keys.values())
    assert len({k for ks in keys.values() for k in ks}) == 12  # no block shared between adapters
