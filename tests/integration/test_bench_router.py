"""`pdserve bench` against pdserve's real HTTP router (uvicorn, SSE, real tokenizer).

The worker behind it is the deterministic `WordBackend`, so what the server reported is
known exactly: its `usage` counts are the request's prompt ids and the tokens it generated.
"""
import json
from collections.abc import Iterator

import pytest

from http_fakes import WordBackend, load_test_tokenizer, model_info, serve
from pdserve.bench.cli import main
from pdserve.bench.datasets import DatasetSpec, build_dataset
from pdserve.common.model_source import default_model_path
from pdserve.router.openai.app import create_app

pytestmark = pytest.mark.integration
RUN = ["--num-prompts", "8", "--random-input-len", "20", "--random-output-len", "5",
       "--random-range-ratio", "0.4", "--request-rate", "50", "--disable-tqdm",
       "--tokenizer", default_model_path()]  # the fake serves it under a name that is not a path


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WordBackend]]:
    tokenizer = load_test_tokenizer(tmp_path_factory.getbasetemp())
    backend = WordBackend(tokenizer)
    with serve(create_app(backend, tokenizer, model_info(tokenizer))) as url:
        yield url, backend


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_totals_match_what_the_router_reported(router, tmp_path, endpoint):
    url, backend = router
    backend.reset()
    out = tmp_path / "result.json"
    assert main(["--base-url", url, "--endpoint", endpoint, *RUN, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    prompt_lens = sorted(len(r.prompt_token_ids) for r in backend.requests)
    assert (result["completed"], result["failed"]) == (8, 0)
    assert sorted(result["input_lens"]) == prompt_lens
    assert result["total_output_tokens"] == sum(r.sampling.max_tokens for r in backend.requests)
    assert sorted(result["output_lens"]) == sorted(r.sampling.max_tokens for r in backend.requests)
    if endpoint == "/v1/completions":  # no template: the server counts exactly what bench built
        spec = DatasetSpec(num_prompts=8, random_input_len=20, random_output_len=5, random_range_ratio=0.4)
        built = build_dataset(spec, backend.tokenizer, seed=0)
        assert prompt_lens == sorted(c.turns[0].num_tokens for c in built)
        assert sorted(len(t) for t in result["itls"]) == sorted(n - 1 for n in result["output_lens"])


def test_failures_inside_the_stream_are_counted_not_fatal(router, tmp_path):
    url, backend = router
    backend.reset()
    backend.fail_after = 2  # every request fails after two tokens, inside an HTTP 200 stream
    out = tmp_path / "result.json"
    assert main(["--base-url", url, *RUN, "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (0, 8)
    assert all(error.startswith("error event: ") for error in result["errors"])
