"""When a sequence stops for a reason other than a stop string."""
from pdserve.engine.core.sequence import Sequence


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """The token ends the sequence as EOS (unless ignored) or as one of its stop token ids. Its
    text is left out of the output unless `include_stop_str_in_output`, as vLLM does; visible
    only with `skip_special_tokens` off, or for a stop token id that is an ordinary token."""
    sampling = seq.request.sampling
    return token_id in sampling.stop_token_ids or (token_id in eos_token_ids and not sampling.ignore_eos)


def finish_reason_after(seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
    """"stop" for EOS or a stop token id, "length" at max_tokens or the context limit, else None."""
    sampling = seq.request.sampling
    if token_id in sampling.stop_token_ids:
        return "stop"
    if token_id in eos_token_ids and not sampling.ignore_eos:
        return "stop"
    if seq.num_output_tokens >= sampling.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length"
    return None
