"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, checked once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": 3}

As vLLM: a `model` without a `method` is a draft model, `"model": "ngram"` is n-gram lookup,
and n-gram lookup's window defaults to 5..5 when neither bound is given, else the bound given
for both. `disable_by_batch_size` (a no-op in vLLM today) works here: a step with at least that
many requests running or waiting drafts nothing, since verifying drafts stops paying once a
step's batch is large enough to keep the CPU busy.
"""
import json
from dataclasses import dataclass

from pdserve.common.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
METHOD_ALIASES = {"[ngram]": "ngram", "draft": "draft_model", "deepseek_mtp": "mtp"}
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # those that need a `model`
MAX_SPECULATIVE_TOKENS = 16
NGRAM_DEFAULT_WINDOW = 5
KNOWN_KEYS = frozenset({"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
                        "disable_by_batch_size", "draft_tensor_parallel_size", "quantization", "max_model_len",
                        "revision", "code_revision", "draft_dtype"})

FIELD = "speculative_config"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model or head checkpoint (draft_model, eagle, eagle3)
    prompt_lookup_min: int = NGRAM_DEFAULT_WINDOW
    prompt_lookup_max: int = NGRAM_DEFAULT_WINDOW
    disable_by_batch_size: int | None = None  # None: every step may draft

    def to_json(self) -> str:
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            fields["model"] = self.model
        if self.method == "ngram":
            fields |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.disable_by_batch_size is not None:
            fields["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(fields)


def parse_speculative_config(raw: object, target_model: str | None = None) -> SpeculativeConfig:
    """A JSON object (as text or already decoded) → SpeculativeConfig; ConfigError naming the
    first field it cannot take. MTP layers live in the target's checkpoint: without a `model`,
    an `mtp` config reads `target_model` (as vLLM's does)."""
    fields = _decode(raw)
    unknown = sorted(set(fields) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(FIELD, raw, f"unknown field {unknown[0]!r}; known: {', '.join(sorted(KNOWN_KEYS))}")
    method = _method(fields)
    model = fields.get("model")
    if method in MODEL_METHODS and not (isinstance(model, str) and model):
        raise ConfigError(f"{FIELD}.model", model, f"method {method!r} needs the checkpoint of its drafter")
    if fields.get("draft_tensor_parallel_size", 1) != 1:
        raise ConfigError(f"{FIELD}.draft_tensor_parallel_size", fields["draft_tensor_parallel_size"],
                          "only 1 (the drafter runs in the target's worker)")
    num = _int(fields, "num_speculative_tokens", None)
    if num is None:
        raise ConfigError(f"{FIELD}.num_speculative_tokens", None, "required")
    if not 1 <= num <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{FIELD}.num_speculative_tokens", num, f"must be in 1..{MAX_SPECULATIVE_TOKENS}")
    low, high = _int(fields, "prompt_lookup_min", None), _int(fields, "prompt_lookup_max", None)
    low, high = (low or high or NGRAM_DEFAULT_WINDOW), (high or low or NGRAM_DEFAULT_WINDOW)
    if method == "ngram" and not 1 <= low <= high:
        raise ConfigError(f"{FIELD}.prompt_lookup_min", low, f"must be >= 1 and <= prompt_lookup_max ({high})")
    disable = _int(fields, "disable_by_batch_size", None)
    if disable is not None and disable < 1:
        raise ConfigError(f"{FIELD}.disable_by_batch_size", disable, "must be >= 1")
    if method == "mtp" and not model:
        model = target_model
    return SpeculativeConfig(method, num, model if method != "ngram" else None, low, high, disable)


def _decode(raw: object) -> dict:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(FIELD, raw, f"not JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(FIELD, raw, "must be a JSON object")
    return raw


def _method(fields: dict) -> str:
    method, model = fields.get("method"), fields.get("model")
    if method is None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
    method = METHOD_ALIASES.get(method, method)
    if method not in METHODS:
        raise ConfigError(f"{FIELD}.method", fields.get("method"), f"choose from {', '.join(METHODS)}")
    return method


def _int(fields: dict, name: str, default: int | None) -> int | None:
    value = fields.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{FIELD}.{name}", value, "must be an integer")
    return value
