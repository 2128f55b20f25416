"""The launcher's blocking probe: a serving worker is ready, but only as the deployment it names."""
import asyncio

from pdserve.common.ids import DeploymentId
from pdserve.rpc.probe import is_worker_serving
from pdserve.worker.server import WorkerServer
from tests.unit.worker.fake_engine import FakeEngine

SHOP_A, SHOP_B = DeploymentId("shop-a"), DeploymentId("shop-b")


def test_a_serving_worker_is_ready_only_as_its_own_deployment() -> None:
    async def scenario() -> list[bool]:
        server = WorkerServer(FakeEngine(), "127.0.0.1", 0, deployment_id=SHOP_A)
        address = f"127.0.0.1:{await server.start()}"
        try:
            answers = [await asyncio.to_thread(is_worker_serving, address, 5.0, deployment)
                       for deployment in (None, SHOP_A, SHOP_B)]
        finally:
            await server.stop(0)
        return answers + [await asyncio.to_thread(is_worker_serving, address, 1.0, SHOP_A)]

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [True, True, False, False]  # last: stopped
