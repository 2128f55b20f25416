"""A worker's adapters by name over a real engine thread: loads are idempotent for the same
files and refused for other files under a taken name, the base model's name or a worker without
LoRA; two names of the same files share one set of weights until both are unloaded; every change
shows in the worker's `ModelInfo`."""
import asyncio
import shutil

import pytest

from pdserve.common.errors import EngineWedgedError, InvalidRequestError, UnknownLoraAdapterError, WorkerDrainingError
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model.lora import LoraSettings
from pdserve.engine.model.runner import ModelRunner
from pdserve.kvcache import KvCacheConfig, KvCacheManager
from pdserve.worker.admission import BoundedEngine, entry_of
from pdserve.worker.async_engine import ThreadedEngine
from pdserve.worker.drain import DrainGate
from pdserve.worker.lora_registry import LoraRegistry
from tests.lora_builders import make_adapter
from tests.unit.engine.token_store_runner import CharTokenizer

INFO = ModelInfo("tiny", 128, 4, "sha256-v1", WorkerRole.BOTH, 300, (0,))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    model.save_pretrained(path)
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(model, path / name, seed=seed)
    return path


def _with_registry(folder, body, lora: LoraSettings | None = LoraSettings(max_loras=2, max_lora_rank=8),
                   roots: tuple[str, ...] | None = None) -> None:
    """`body(registry, engine)`; runtime loads allowed from `roots` (default: the model's folder)."""
    async def main():
        runner = ModelRunner.load(folder, "float32", "cpu", num_blocks=16, tokens_per_block=4, lora=lora)
        engine = ThreadedEngine(LLMEngine(runner, KvCacheManager(KvCacheConfig(tokens_per_block=4), 16),
                                          CharTokenizer(), SchedulerConfig(8, 256, 128)), INFO, idle_wait_s=0.005)
        engine.start()
        try:
            await body(LoraRegistry(engine, (str(folder),) if roots is None else roots), engine)
        finally:
            engine.stop()

    asyncio.run(main())


def test_loading_the_same_files_again_changes_nothing_and_other_files_are_refused(folder) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        first = await loras.load("a", str(folder / "a"))
        assert await loras.load("a", str(folder / "a")) == first
        with pytest.raises(InvalidRequestError, match="loaded already, from other files"):
            await loras.load("a", str(folder / "b"))
        assert engine.info().lora_adapters == (first,)

    _with_registry(folder, body)


@pytest.mark.parametrize("name, path, message", [
    ("tiny", "a", "the base model's name"),
    ("", "a", "1 to 256 printable characters"),
    ("x", "missing", "no adapter_config.json"),
])
def test_bad_loads_are_refused_naming_the_field(folder, name, path, message) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        with pytest.raises(InvalidRequestError, match=message):
            await loras.load(name, str(folder / path))
        assert engine.info().lora_adapters == () and len(engine.engine.runner.lora) == 0

    _with_registry(folder, body)


def test_two_names_of_the_same_files_share_their_weights_until_both_go(folder) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        a = await loras.load("a", str(folder / "a"))
        alias = await loras.load("alias", str(folder / "a"))
        assert alias.lora_id == a.lora_id and len(engine.engine.runner.lora) == 1
        await loras.unload("a")
        assert [x.name for x in engine.info().lora_adapters] == ["alias"]
        assert a.lora_id in engine.engine.runner.lora
        await loras.unload("alias")
        assert engine.info().lora_adapters == () and a.lora_id not in engine.engine.runner.lora
        with pytest.raises(UnknownLoraAdapterError):
            await loras.unload("alias")

    _with_registry(folder, body)


def test_more_adapters_than_max_loras_are_refused(folder) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        await loras.load("a", str(folder / "a"))
        with pytest.raises(InvalidRequestError, match="max_loras"):
            await loras.load("b", str(folder / "b"))
        assert [x.name for x in engine.info().lora_adapters] == ["a"]

    _with_registry(folder, body, LoraSettings(max_loras=1, max_lora_rank=8))


def test_a_worker_without_lora_refuses_loads(folder) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            await loras.load("a", str(folder / "a"))

    _with_registry(folder, body, lora=None)


def test_a_folder_outside_the_lora_dirs_is_refused_and_nothing_is_read(folder, tmp_path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(folder / "a", outside)
    escape = folder / "escape"  # a link inside the root to the folder outside
    escape.symlink_to(outside, target_is_directory=True)
    planted = folder / "planted"  # a folder inside whose weights file links outside
    planted.mkdir()
    shutil.copy(folder / "a" / "adapter_config.json", planted)
    (planted / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")

    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        for path in (outside, escape, planted, folder / ".." / outside.parent.name / "outside", "/etc"):
            with pytest.raises(InvalidRequestError, match="not in a --lora-dir folder"):
                await loras.load("x", str(path))
        assert engine.info().lora_adapters == () and len(engine.engine.runner.lora) == 0

    try:
        _with_registry(folder, body)
    finally:
        escape.unlink()
        shutil.rmtree(planted)


def test_without_lora_dirs_runtime_loads_are_refused(folder) -> None:
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        with pytest.raises(InvalidRequestError, match="start it with --lora-dir"):
            await loras.load("a", str(folder / "a"))

    _with_registry(folder, body, roots=())


def test_a_weights_file_larger_than_an_adapter_of_this_model_is_not_read(folder, tmp_path) -> None:
    big = tmp_path / "big"
    shutil.copytree(folder / "a", big)
    with open(big / "adapter_model.safetensors", "r+b") as f:
        f.truncate(64 << 20)  # sparse: no disk written

    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        with pytest.raises(InvalidRequestError, match="larger than an adapter of this model can be"):
            await loras.load("big", str(big))

    _with_registry(folder, body, roots=(str(tmp_path),))


class Wedged:
    def __init__(self) -> None:
        self.reason: str | None = None

    def wedged_reason(self) -> str | None:
        return self.reason


def test_loads_and_unloads_pass_the_drain_gate_and_the_wedge_check(folder) -> None:
    """As every request: refused once the worker drains or while its engine is wedged, changing
    nothing; a load under way holds the drain until it ends."""
    async def body(loras: LoraRegistry, engine: ThreadedEngine) -> None:
        wedge = Wedged()
        bounded = BoundedEngine(engine, max_waiting=4, wedge=wedge)
        gate = DrainGate(bounded)
        loras.entry = entry_of(gate, bounded, is_request=False)
        await loras.load("a", str(folder / "a"))
        wedge.reason = "engine wedged: a test"
        with pytest.raises(EngineWedgedError):
            await loras.load("b", str(folder / "b"))
        with pytest.raises(EngineWedgedError):
            await loras.unload("a")
        with pytest.raises(EngineWedgedError):
            await bounded.check_integrity()
        wedge.reason = None
        assert bounded.num_waiting == 0  # a load is no waiting request
        gate.close("the worker is stopping")
        with pytest.raises(WorkerDrainingError, match="stopping"):
            await loras.load("b", str(folder / "b"))
        with pytest.raises(WorkerDrainingError):
            await loras.unload("a")
        assert [a.name for a in engine.info().lora_adapters] == ["a"]  # nothing changed
        assert await gate.wait_idle(1.0)

    _with_registry(folder, body)
