"""The model's tokenizer: text ↔ token ids, special tokens, and the chat template.

Torch-free (the router imports it). Loaded from either model format `--model` accepts:
an HF checkpoint directory (tokenizer.json and friends) or a GGUF file (rebuilt from its
metadata, optionally cached). Rendering a chat gives text that already holds every special
token the model expects, so encode it with `add_special_tokens=False`.
"""
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from pdserve.models.chat_template import ChatTemplate
from pdserve.common.errors import InvalidRequestError
from pdserve.models.gguf_tokenizer import read_gguf_tokenizer
from pdserve.common.model_source import ModelFormat, resolve_model
from pdserve.models.tokenizer_files import TokenizerSpec, read_hf_tokenizer


RELEASE_LOCK_CHARS = 16 << 10  # texts longer than this are tokenized with the interpreter lock released


class Tokenizer:
    """A `tokenizers` backend plus what the checkpoint says about bos/eos and chat."""

    def __init__(self, backend: BackendTokenizer, spec: TokenizerSpec) -> None:
        self._backend = backend
        self._spec = spec
        self._chat: ChatTemplate | None = None
        self._added_ids: frozenset[int] | None = None
        if spec.chat_template is not None:
            self._chat = ChatTemplate(spec.chat_template, self._token(spec.bos_token_id), self._eos_token())

    @property
    def bos_token_id(self) -> int | None:
        return self._spec.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (eos, end-of-turn), in the checkpoint's order."""
        return self._spec.eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the tokens added to the vocabulary (special or not), as vLLM's detokenizer
        tells them apart for `spaces_between_special_tokens`."""
        if self._added_ids is None:
            self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
        return self._added_ids

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (e.g. BOS).
        A long text goes through the batch call, the same ids, which lets go of the interpreter
        lock while it works (the single call holds it: 8 MiB took 9 s), so a caller on a worker
        thread leaves an event loop free."""
        if len(text) > RELEASE_LOCK_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. An incomplete UTF-8 sequence decodes to U+FFFD. Many ids go
        through the batch call, which lets go of the interpreter lock, as `encode`."""
        if len(token_ids) > RELEASE_LOCK_CHARS // 4:
            return self._backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling for BPE), or None for an unknown id."""
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for a chat. Raises InvalidRequestError when the model has no
        template or the template rejects the messages."""
        if self._chat is None:
            raise InvalidRequestError("this model has no chat template; use the completions API", param="messages")
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizers` JSON (a grammar library builds its token trie from it)."""
        return self._backend.to_str()

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def _eos_token(self) -> str | None:
        return self._token(self._spec.eos_token_ids[0]) if self._spec.eos_token_ids else None


def load_tokenizer(model_path: str | None, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or HF checkpoint dir (None: the default model).

    `cache_dir`, for GGUF only, keeps the converted tokenizer so later loads skip reading
    the file's metadata. Raises ConfigError for paths or tokenizers it cannot load.
    """
    source = resolve_model(model_path)
    if source.format is ModelFormat.GGUF:
        backend, spec = read_gguf_tokenizer(source.path, cache_dir)
    else:
        backend, spec = read_hf_tokenizer(source.path)
    return Tokenizer(backend, spec)
