"""The model's default sampling values fill only what a request leaves unset or null; a request's
own value wins; a default max_tokens is capped to the context left, never refused."""
import pytest

from pdserve.common.errors import ConfigError
from pdserve.router.openai.body import parse_body
from pdserve.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.openai.sampling import checked_defaults, with_defaults

DEFAULTS = checked_defaults({"temperature": 0.6, "top_k": 20, "max_tokens": 300})


def test_unset_and_null_fields_take_the_default_set_fields_keep_theirs() -> None:
    unset = with_defaults(parse_body(b'{"prompt": "hi"}', CompletionRequest), DEFAULTS)
    null = with_defaults(parse_body(b'{"prompt": "hi", "temperature": null}', CompletionRequest), DEFAULTS)
    own = with_defaults(parse_body(b'{"prompt": "hi", "temperature": 0, "top_k": -1}', CompletionRequest), DEFAULTS)
    assert (unset.temperature, unset.top_k) == (null.temperature, null.top_k) == (0.6, 20)
    assert (own.temperature, own.top_k) == (0.0, -1)


def test_max_tokens_is_left_to_the_capped_default() -> None:
    body = with_defaults(parse_body(b'{"messages": [{"role": "user", "content": "x"}]}', ChatCompletionRequest),
                         DEFAULTS)
    assert body.max_tokens is None and body.temperature == 0.6


def test_a_default_no_request_could_send_stops_the_start() -> None:
    with pytest.raises(ConfigError):
        checked_defaults({"temperature": 7.0})


def test_a_default_this_api_has_no_field_for_is_left_out() -> None:
    assert checked_defaults({"min_p": 0.1, "top_p": 0.5}) == {"top_p": 0.5}
