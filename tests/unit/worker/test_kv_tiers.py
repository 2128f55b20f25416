"""The disk tier for real: a worker's engine built from its settings (`bootstrap`) with a host
tier and a disk folder, block files written and read through NIXL's POSIX back end. Blocks that
pass through host memory to disk come back with the same greedy tokens; a new engine over the
same folder (a restart) takes them over, and a corrupted file is a miss, counted, never KV."""
from pathlib import Path

import pytest

from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.kvcache import KvCacheConfig
from pdserve.transfer.kv_files import HEADER_BYTES
from pdserve.worker.bootstrap import EngineSpec, build_llm_engine
from tests.integration.stack import make_tiny_checkpoint

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, tokens, kv heads, head dim, float32
PROMPT = tuple(range(300, 370))  # 70 tokens: four full blocks
FLUSH = [tuple(range(1000 * i, 1000 * i + 100)) for i in range(1, 5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_model_len=256))


def engine(checkpoint: str, disk: Path):
    kv = KvCacheConfig(max_tokens=256, tokens_per_block=16, host_cache_size=8 * BLOCK_BYTES)
    spec = EngineSpec(model=checkpoint, served_model_name="tiny", dtype="float32", device="cpu", kv=kv,
                      scheduler=SchedulerConfig(8, 512, 256), kernels="torch", disk_cache_dir=str(disk),
                      disk_cache_size=64 * BLOCK_BYTES)
    return build_llm_engine(spec)


def generate(llm, prompt: tuple[int, ...], tag: str) -> tuple[list[int], int]:
    llm.add_request(GenerationRequest(RequestId(tag), prompt,
                                      SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    tokens, cached = [], None
    while llm.has_work:
        for output in llm.step():
            tokens += output.token_ids
            cached = output.num_cached_tokens if cached is None else cached
        llm.kv.check_integrity()
    return tokens, cached


def push_down(llm) -> None:
    for i, prompt in enumerate(FLUSH):
        generate(llm, prompt, f"flush-{i}")


def test_blocks_pushed_through_the_host_tier_to_disk_come_back_with_the_same_tokens(checkpoint, tmp_path):
    llm = engine(checkpoint, tmp_path)
    first, cached = generate(llm, PROMPT, "first")
    assert cached == 0
    push_down(llm)
    assert llm.kv.tiers.num_spilled >= 4 and list(tmp_path.rglob("*.kv"))
    again, cached = generate(llm, PROMPT, "again")
    assert again == first and cached == 64
    assert llm.kv.tiers.num_loaded >= 1


def test_a_restart_takes_the_blocks_over_and_a_corrupt_file_is_a_miss(checkpoint, tmp_path):
    llm = engine(checkpoint, tmp_path)
    first, _ = generate(llm, PROMPT, "first")
    push_down(llm)
    llm.tier_store.apply(llm.kv.spill_host_tier())  # the graceful stop
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) >= 4

    restarted = engine(checkpoint, tmp_path)
    assert len(restarted.kv.disk.entries) == len(files)
    again, cached = generate(restarted, PROMPT, "after-restart")
    assert (again, cached) == (first, 64)

    for path in files:  # flip one byte of every payload
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 5)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
    third = engine(checkpoint, tmp_path)
    tokens, cached = generate(third, PROMPT, "corrupt")
    assert (tokens, cached) == (first, 0)
    assert third.kv.tiers.num_corrupt == 1  # the first block of the prompt: the walk stops there


def test_files_of_other_weights_or_formats_are_left_alone(checkpoint, tmp_path):
    stranger = tmp_path / "notes.txt"
    stranger.write_text("not ours")
    other_model = tmp_path / "0123456789abcdef01234567"
    other_model.mkdir()
    (other_model / ("ab" * 32 + ".kv")).write_bytes(b"x" * 100)
    llm = engine(checkpoint, tmp_path)
    generate(llm, PROMPT, "p")
    push_down(llm)
    assert stranger.read_text() == "not ours" and (other_model / ("ab" * 32 + ".kv")).exists()


def test_a_block_file_gone_when_it_is_read_back_is_recomputed_not_served(checkpoint, tmp_path):
    llm = engine(checkpoint, tmp_path)
    first, _ = generate(llm, PROMPT, "first")
    push_down(llm)
    for path in tmp_path.rglob("*.kv"):  # written by this engine, so trusted without a check: yet gone
        path.unlink()
    again, cached = generate(llm, PROMPT, "again")
    assert again == first
    assert llm.kv.tiers.num_corrupt >= 1
    assert llm.kv.num_used_blocks == 0


def test_every_read_is_checked_a_file_changed_after_it_was_written_is_recomputed_and_removed(checkpoint, tmp_path):
    llm = engine(checkpoint, tmp_path)
    first, _ = generate(llm, PROMPT, "first")
    push_down(llm)
    files = sorted(tmp_path.rglob("*.kv"))
    for path in files:  # written by this engine, then changed behind its back
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 5)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
    again, cached = generate(llm, PROMPT, "again")
    assert again == first
    assert llm.kv.tiers.num_corrupt >= 1
    assert not all(path.exists() for path in files)  # what was read and failed is gone
    assert llm.kv.num_used_blocks == 0
