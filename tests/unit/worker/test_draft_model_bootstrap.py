"""A worker's engine with a draft model, built from its settings (`bootstrap`): the KV cache's
blocks are sized for both models' K/V, the draft's tensor has the target's blocks, and greedy
output is the output without speculation."""
import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig
from pdserve.worker.bootstrap import EngineSpec, build_llm_engine
from tests.draft_builders import make_draft_checkpoint
from tests.integration.stack import make_tiny_checkpoint

TPB = 16
# layers, K/V, tokens, kv heads, head dim: the target has 2 layers, the draft 1
TARGET_ELEMENTS, DRAFT_ELEMENTS = 2 * 2 * TPB * 2 * 32, 1 * 2 * TPB * 2 * 32
PROMPT = tuple(range(300, 340))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_checkpoint(root / "target", max_model_len=256, hidden_size=128)
    return str(target), str(make_draft_checkpoint(root / "draft", target))


def _engine(models, speculative: bool, kv_cache_dtype: str, max_total_bytes: int):
    target, draft = models
    kv = KvCacheConfig(max_total_bytes=max_total_bytes, tokens_per_block=TPB)
    spec = EngineSpec(model=target, served_model_name="tiny", dtype="float32", device="cpu",
                      kv_cache_dtype=kv_cache_dtype, kv=kv,
                      scheduler=SchedulerConfig(8, 512, 256), kernels="torch",
                      speculative=SpeculativeConfig("draft_model", 3, model=draft) if speculative else None)
    return build_llm_engine(spec)


def _generate(engine) -> list[int]:
    engine.add_request(GenerationRequest(RequestId("r"), PROMPT,
                                         SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
    tokens = []
    while engine.has_work:
        for output in engine.step():
            tokens += output.token_ids
        engine.kv.check_integrity()
    return tokens


@pytest.mark.parametrize("kv_cache_dtype,itemsize", [("auto", 4), ("fp8", 1)])
def test_the_kv_cache_is_sized_for_both_models(models, kv_cache_dtype, itemsize):
    per_block = (TARGET_ELEMENTS + DRAFT_ELEMENTS) * itemsize
    engine = _engine(models, True, kv_cache_dtype, 40 * per_block + per_block // 2)
    assert engine.kv.num_blocks == engine.runner.num_blocks == 40
    draft = engine.speculator.proposer.runner
    assert draft.kv_tensor.shape[0] == 40
    assert draft.kv_tensor.dtype == engine.runner.kv_tensor.dtype
    assert draft.kv_tensor.nbytes == 40 * DRAFT_ELEMENTS * itemsize
    assert engine.runner.kv_tensor.nbytes == 40 * TARGET_ELEMENTS * itemsize
    plain = _engine(models, False, kv_cache_dtype, 40 * per_block + per_block // 2)
    assert plain.kv.num_blocks == (40 * per_block + per_block // 2) // (TARGET_ELEMENTS * itemsize)
    assert _generate(engine) == _generate(plain)
    assert engine.take_step_stats().spec.num_drafts > 0
