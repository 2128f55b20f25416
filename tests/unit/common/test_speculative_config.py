"""`--speculative-config`: vLLM's JSON, its defaults and inferences, and a named error for each
field it cannot take."""
import json

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.settings import WorkerSettings
from pdserve.common.speculative import SpeculativeConfig, parse_speculative_config


def test_ngram_window_defaults_as_vllms() -> None:
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "ngram", 3, None, 5, 5)
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_method_is_inferred_from_the_model_as_vllm_does() -> None:
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    draft = parse_speculative_config({"model": "/models/small", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "/models/small")
    assert parse_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"


@pytest.mark.parametrize("raw, field", [
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "speculative_config.draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config"),
])
def test_a_bad_field_is_named(raw, field) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_speculative_config(raw)
    assert caught.value.field == field


def test_the_worker_setting_keeps_one_normalised_json_that_round_trips() -> None:
    settings = WorkerSettings(speculative_config=None)
    assert settings.speculative_config is None
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                       "disable_by_batch_size": 8})
    assert parse_speculative_config(json.loads(config.to_json())) == config
