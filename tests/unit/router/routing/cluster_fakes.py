"""Scripted workers for unit tests of the router's failure paths: a `WorkerClient` whose
answers (info, stats, a generation stream) and failures are set by the test."""
from collections.abc import AsyncIterator

from pdserve.common.errors import UnknownLoraAdapterError, WorkerUnavailableError
from pdserve.common.ids import DeploymentId, RequestId, WorkerId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo, WorkerInfo, WorkerRole
from pdserve.router.routing.worker_pool import PoolConfig, WorkerPool

TPB = 4
HASH = "sha256-v1"


def info(role: WorkerRole = WorkerRole.BOTH, model: str = "toy", tpb: int = TPB, algorithm: str = HASH,
         max_len: int = 128) -> ModelInfo:
    return ModelInfo(model, max_len, tpb, algorithm, role, 97, (0,))


def stats(running: int = 0, waiting: int = 0, used: int = 0, queued: int = 0) -> EngineStats:
    return EngineStats(running, waiting, 100 - used, 100, used, queued, 0, 0, 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWorker:
    """`WorkerClient`. `is_down`: every call fails as unreachable. `fail_generate_after`: the
    stream yields that many outputs, then fails as unreachable. Told a prefill worker, its first
    output reports it, or "local" when `prefills_locally`. `worker_id`: the id its info gives."""

    def __init__(self, address: str, model_info: ModelInfo, report: EngineStats | None = None,
                 deployment_id: DeploymentId | None = None, worker_id: WorkerId | None = None) -> None:
        self.address = address
        self.model_info = model_info
        self.deployment_id = deployment_id
        self.worker_id = worker_id
        self.report = report or stats()
        self.is_down = False
        self.fail_generate_after: int | None = None
        self.prefills_locally = False
        self.generated: list[tuple[RequestId, str | None]] = []  # (request id, prefill worker)
        self.prefill_worker_ids: list[WorkerId | None] = []  # the prefill worker's id, per generate call
        self.block_keys: list[tuple] = []  # the prompt's keys the router sent, per generate call
        self.aborted: list[RequestId] = []
        self.loras: dict[str, LoraAdapterInfo] = {}  # loaded through the router
        self.lora_error: Exception | None = None  # raised by the next load or unload

    def _check(self) -> None:
        if self.is_down:
            raise WorkerUnavailableError(self.address, "connection refused")

    async def info(self) -> WorkerInfo:
        self._check()
        return WorkerInfo(self.model_info, self.deployment_id, self.worker_id)

    async def stats(self) -> EngineStats:
        self._check()
        return self.report

    async def generate(self, request: GenerationRequest, prefill_worker: str | None = None,
                       prefill_worker_id: WorkerId | None = None) -> AsyncIterator[RequestOutput]:
        self._check()
        self.generated.append((request.request_id, prefill_worker))
        self.prefill_worker_ids.append(prefill_worker_id)
        self.block_keys.append(request.block_keys)
        for i in range(2):
            if self.fail_generate_after == i:
                raise WorkerUnavailableError(self.address, "stream broke")
            prefilled_by = "" if i or prefill_worker is None else "local" if self.prefills_locally else prefill_worker
            yield RequestOutput(request.request_id, 0, (i,), f"t{i}", finish_reason="length" if i == 1 else None,
                                prefilled_by=prefilled_by)

    async def abort(self, request_id: RequestId) -> None:
        self.aborted.append(request_id)

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        self._check()
        if self.lora_error is not None:
            raise self.lora_error
        self.loras[name] = LoraAdapterInfo(name, len(path), path)
        return self.loras[name]

    async def unload_lora_adapter(self, name: str) -> None:
        self._check()
        if self.lora_error is not None:
            raise self.lora_error
        if self.loras.pop(name, None) is None:
            raise UnknownLoraAdapterError(f"no LoRA adapter named {name!r} is loaded")

    async def close(self) -> None:
        pass


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, WorkerId]] = []

    def worker_up(self, handle) -> None:
        self.events.append(("up", handle.address))

    def worker_down(self, handle) -> None:
        self.events.append(("down", handle.address))

    def worker_removed(self, handle) -> None:
        self.events.append(("removed", handle.address))


def make_pool(workers: dict[str, FakeWorker], clock: FakeClock | None = None, threshold: int = 2,
              wait_s: float = 0.0, deployment_id: DeploymentId | None = None) -> WorkerPool:
    config = PoolConfig(poll_interval_s=3600.0, failure_threshold=threshold, wait_timeout_s=wait_s,
                        deployment_id=deployment_id)
    return WorkerPool(list(workers), workers.__getitem__, config, HASH, clock or FakeClock())
