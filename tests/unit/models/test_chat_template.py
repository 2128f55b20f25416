"""ChatTemplate: sandboxed rendering with the helpers Hugging Face templates rely on."""
from datetime import datetime

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from pdserve.models.chat_template import ChatTemplate
from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.models.tokenizer import Tokenizer
from pdserve.models.tokenizer_files import TokenizerSpec

ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
)


def test_renders_messages_specials_and_generation_prompt():
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}", bos_token="<s>", eos_token="</s>")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(messages) == "<s>a</s>b</s>>"
    assert template.render(messages, add_generation_prompt=False) == "<s>a</s>b</s>"


def test_trims_blocks_like_transformers():
    template = ChatTemplate("{% for m in messages %}\n  {% if m %}{{ m['content'] }}{% endif %}\n{% endfor %}",
                            None, None)
    assert template.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]) == "xy"


def test_raise_exception_becomes_invalid_request_naming_messages():
    template = ChatTemplate(ALTERNATING, None, None)
    assert template.render([{"role": "user", "content": "hi"}]) == "[user]hi"
    with pytest.raises(InvalidRequestError) as err:
        template.render([{"role": "assistant", "content": "hi"}])
    assert err.value.param == "messages"
    assert "roles must alternate user/assistant" in str(err.value)


def test_strftime_now_tojson_and_loop_controls():
    template = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ tools | tojson }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
        None, None)
    rendered = template.render([{"content": "one"}, {"content": "two"}], tools=[{"name": "a<b>", "x": "é"}])
    assert rendered == f'{datetime.now().year}|[{{"name": "a<b>", "x": "é"}}]|one'


def test_sandbox_refuses_unsafe_attribute_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", None, None)
    with pytest.raises(InvalidRequestError):
        template.render([])


def test_invalid_jinja_raises_config_error():
    with pytest.raises(ConfigError) as err:
        ChatTemplate("{% for m in messages %}", None, None)
    assert err.value.field == "chat_template"


def test_tokenizer_without_template_refuses_chat():
    tokenizer = Tokenizer(Backend(BPE()), TokenizerSpec(None, (), None))
    with pytest.raises(InvalidRequestError) as err:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert err.value.param == "messages"
