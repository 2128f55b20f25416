"""benchmarks/router_scale.py at a tiny size, so the script cannot rot: the real router classes
ingest the synthetic streams to the exact block count and decide every prompt. No timing is
asserted."""
import asyncio
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import router_scale  # noqa: E402
from router_scale_workload import MAX_PROMPT_BLOCKS, MIN_PROMPT_BLOCKS, WorkloadShape, build_workload  # noqa: E402


def test_the_workload_leaves_each_worker_its_share_and_prompts_in_range() -> None:
    workload = build_workload(WorkloadShape(num_workers=3, num_blocks=1000, num_prompts=20))
    assert len(workload.streams) == 3
    assert workload.num_events > 1000  # churn and offloads come on top of the stores
    assert all(MIN_PROMPT_BLOCKS <= len(p.block_hashes) <= MAX_PROMPT_BLOCKS for p in workload.prompts[:14])
    assert all(len(p.block_hashes) * 16 < p.num_tokens <= (len(p.block_hashes) + 1) * 16 for p in workload.prompts)


def test_one_cell_ingests_every_stream_and_decides_every_prompt() -> None:
    args = router_scale.parse_args(["--num-prompts", "12", "--repeats", "2"])
    row = asyncio.run(router_scale.measure_cell(WorkloadShape(4, 1000, num_prompts=12), args))
    assert (row["workers"], row["indexed_blocks"], row["num_decisions"], row["all_synced"]) == (4, 1000, 12, True)
    assert row["unique_blocks"] <= 1000
    assert 0 < row["decode_overlap_share"] <= 1  # next turns of cached conversations find their worker


def test_the_report_has_one_row_per_cell_and_no_paths(tmp_path) -> None:
    out = tmp_path / "router-scale.json"
    assert router_scale.main(["--workers", "1", "2", "--blocks", "500", "--num-prompts", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["workers"], r["indexed_blocks"]) for r in report["results"]] == [(1, 500), (2, 500)]
    assert {"cpu", "cores"} <= report["machine"].keys() and "plan_p50_largest_over_smallest" in report["ratios"]
    assert str(tmp_path) not in out.read_text()
