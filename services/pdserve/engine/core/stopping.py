"""When a sequence stops for a reason other than a stop string."""
from pdserve.engine.core.sequence import Sequence


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
