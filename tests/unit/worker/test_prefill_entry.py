"""A prefill worker's orders pass the policies every Generate stream passes (`admission.entry_of`):
refused while the worker drains, while its engine is wedged and when the waiting bound is full,
before anything is computed; the decode worker then prefills the prompt itself. Real engines and
the real KvTransfer service over gRPC, the fake transport between them (test_disagg_failures.py)."""
import pytest

from pdserve.common.errors import EngineWedgedError, OverloadedError, WorkerDrainingError
from pdserve.worker.admission import BoundedEngine, entry_of
from pdserve.worker.drain import DrainGate
from tests.unit.worker.test_disagg_failures import _collect, _request, _run, _until, checkpoint  # noqa: F401


class Wedge:
    reason: str | None = None

    def wedged_reason(self) -> str | None:
        return self.reason


def test_a_prefill_order_passes_the_drain_gate_the_wedge_check_and_the_waiting_bound(checkpoint):
    async def body(pair, address):
        wedge = Wedge()
        bounded = BoundedEngine(pair.p, 1, wedge)
        gate = DrainGate(bounded)
        pair.service.entry = entry_of(gate, bounded)
        local = [o.token_ids for o in await _collect(pair.d.generate(_request("local")))]

        async def answer(rid: str) -> str:
            outputs = await _collect(pair.decode.generate(_request(rid), address))
            assert [o.token_ids for o in outputs] == local  # the same tokens, wherever prefilled
            return outputs[0].prefilled_by

        assert await answer("open") == address
        assert await _until(lambda: pair.used() == (0, 0))
        computed, writes = pair.p.stats().prefix_cache_queried_tokens, len(pair.tp.posted)
        async with bounded.waiting():  # the one waiting slot is taken
            assert await answer("full") == "local"
        wedge.reason = "engine wedged: its thread has not finished a step for 61 s"
        assert await answer("wedged") == "local"
        wedge.reason = None
        gate.close("draining: shutting down")
        assert await answer("draining") == "local"
        assert (pair.p.stats().prefix_cache_queried_tokens, len(pair.tp.posted)) == (computed, writes)
        assert pair.metrics.failures.labels("received")._value.get() == 3
        assert gate.num_running == 0 and bounded.num_waiting == 0

    _run(checkpoint, body, recompute=True)


@pytest.mark.parametrize("state, error", [("draining", WorkerDrainingError), ("wedged", EngineWedgedError),
                                          ("full", OverloadedError)])
def test_the_prefill_service_refuses_with_the_policys_own_error(checkpoint, state, error):
    async def body(pair, address):
        wedge = Wedge()
        bounded = BoundedEngine(pair.p, 1, wedge)
        gate = DrainGate(bounded)
        pair.service.entry = entry_of(gate, bounded)
        if state == "draining":
            gate.close("draining: shutting down")
        elif state == "wedged":
            wedge.reason = "engine wedged"
        else:
            await bounded.waiting().__aenter__()
        with pytest.raises(error):
            await pair.service.prefill(None)  # refused before the order is even read

    _run(checkpoint, body)
