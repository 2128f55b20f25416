"""What a request must be before the engine admits it: checks that change nothing.

Each raises a typed error: `InvalidRequestError` naming the offending parameter, or
`DuplicateRequestError` for an id in use. They run before anything is claimed, never left for a
step's batch to trip over.
"""
from collections.abc import Callable

from pdserve.common.errors import DuplicateRequestError, InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest
from pdserve.engine.core.scheduler import SchedulerConfig
from pdserve.engine.model.logits_processors import check_processor_params
from pdserve.engine.model.sampler import MAX_LOGPROBS, check_sampling_params

# Request ids never contain these: the engine derives its KV sequence ids from a request id with
# them (a sibling completion's "<id>#<index>", a retry's "<id>~<n>"), so no two requests' sequences
# can share an id inside a step's batch.
RESERVED_ID_MARKS = ("#", "~")
KEY_BYTES = 32  # a block key: a SHA-256 digest (kvcache/block_key.py)


def check_request_id(request_id: RequestId, is_in_use: Callable[[RequestId], bool]) -> None:
    """InvalidRequestError for an empty id or one with a reserved mark; DuplicateRequestError
    while `is_in_use` (a live request, or blocks the KV manager still holds under the id: kept
    for a peer, or a transfer not yet settled)."""
    if not request_id:
        raise InvalidRequestError("request id must not be empty", "request_id")
    if any(mark in request_id for mark in RESERVED_ID_MARKS):
        raise InvalidRequestError(f"request id {request_id!r} contains one of {''.join(RESERVED_ID_MARKS)!r}, "
                                  "reserved for the engine's own sequence ids", "request_id")
    if is_in_use(request_id):
        raise DuplicateRequestError(f"request id {request_id!r} is in use on this worker (a live request, "
                                    "or KV blocks still held under it)")


def check_request(request: GenerationRequest, vocab_size: int, config: SchedulerConfig) -> None:
    """The prompt, its length with max_tokens, n, and every sampling and logits-processor parameter."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise InvalidRequestError(f"prompt has token ids outside 0..{vocab_size - 1}", "prompt")
    max_len = config.max_model_len
    if len(prompt) + request.sampling.max_tokens > max_len:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds "
            f"max_model_len {max_len}", "max_tokens")
    if not 1 <= request.sampling.n <= config.max_num_seqs:
        raise InvalidRequestError(f"n={request.sampling.n}: must be in 1..{config.max_num_seqs}", "n")
    check_sampling_params(request.sampling)  # here, not first in a step that samples it with others
    num_top = request.sampling.prompt_logprobs
    if num_top is not None and not 0 <= num_top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"prompt_logprobs={num_top!r} must be in 0..{MAX_LOGPROBS}", "prompt_logprobs")
    check_processor_params(request.sampling, vocab_size)
    if any(len(key) != KEY_BYTES for key in request.block_keys) or len(request.block_keys) > len(prompt):
        raise InvalidRequestError(f"block_keys must be {KEY_BYTES}-byte digests, at most one per prompt token",
                                  "block_keys")
