"""Conversions between pdserve's own types and their protobuf messages.

Every `*_to_proto` / `*_from_proto` pair round-trips exactly: `x_from_proto(x_to_proto(v)) == v`.
A value protobuf cannot carry (a negative token id, a token id past 2**32) raises
`InvalidRequestError` naming the field, before anything is sent.
"""
import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

from google.protobuf.message import Message

from pdserve.common.errors import InvalidRequestError, WorkerError
from pdserve.common.ids import BlockHash, RequestId, WorkerId
from pdserve.common.request import (
    GenerationRequest,
    Guide,
    GuideKind,
    MultimodalSpan,
    PriorityRange,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from pdserve.common.stats import EngineStats, LoraAdapterInfo, ModelInfo, WorkerRole
from pdserve.rpc.gen import request_pb2 as rpb
from pdserve.rpc.gen import worker_pb2 as wpb

_FINISH_TO_PROTO = {
    None: rpb.FINISH_REASON_UNSPECIFIED,
    "stop": rpb.FINISH_REASON_STOP,
    "length": rpb.FINISH_REASON_LENGTH,
    "abort": rpb.FINISH_REASON_ABORT,
    "error": rpb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}

_GUIDE_TO_PROTO = {
    GuideKind.JSON_SCHEMA: rpb.GUIDE_KIND_JSON_SCHEMA,
    GuideKind.REGEX: rpb.GUIDE_KIND_REGEX,
    GuideKind.LARK: rpb.GUIDE_KIND_LARK,
}
_GUIDE_FROM_PROTO = {v: k for k, v in _GUIDE_TO_PROTO.items()}

_ROLE_TO_PROTO = {
    WorkerRole.BOTH: wpb.WORKER_ROLE_BOTH,
    WorkerRole.PREFILL: wpb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: wpb.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))

M = TypeVar("M", bound=Message)
K = TypeVar("K")


def _checked(build: Callable[..., M], field: str, **kwargs: object) -> M:
    """`build(**kwargs)`, with protobuf's range errors raised as InvalidRequestError."""
    try:
        return build(**kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{field}: {exc}", param=field) from exc


def _decode(table: Mapping[int, K], value: int, field: str) -> K:
    """A worker's enum value; one this build does not know is a malformed reply."""
    if value not in table:
        raise WorkerError(f"worker sent {field}={value}, which this router does not know")
    return table[value]


def sampling_to_proto(params: SamplingParams) -> rpb.SamplingParams:
    return _checked(
        rpb.SamplingParams, "sampling",
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, seed=params.seed, stop=params.stop,
        stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos, n=params.n,
        logprobs=params.logprobs, include_stop_str_in_output=params.include_stop_str_in_output,
        **_guide_to_proto(params.guide), **_guide_done_tokens(params),
        prompt_logprobs=params.prompt_logprobs, skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        **_processors_to_proto(params),
    )


def _processors_to_proto(params: SamplingParams) -> dict[str, object]:
    """The logits processors' fields (20..29) of `rpb.SamplingParams`."""
    return dict(
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        logit_bias=[_checked(rpb.SamplingParams.TokenBias, "logit_bias", token_id=t, bias=b)
                    for t, b in params.logit_bias],
        bad_words=[_checked(rpb.SamplingParams.TokenSequence, "bad_words", token_ids=word)
                   for word in params.bad_words],
    )


def _guide_to_proto(guide: Guide | None) -> dict[str, object]:
    if guide is None:
        return {}
    return {"guide_kind": _GUIDE_TO_PROTO[guide.kind], "guide": guide.text}


def _guide_done_tokens(params: SamplingParams) -> dict[str, object]:
    return {"guide_done_tokens": params.guide_done_tokens} if params.guide is not None else {}


def _guide_from_proto(msg: rpb.SamplingParams) -> Guide | None:
    if msg.guide_kind == rpb.GUIDE_KIND_UNSPECIFIED:
        return None
    if msg.guide_kind not in _GUIDE_FROM_PROTO:
        raise InvalidRequestError(f"guide kind {msg.guide_kind} is unknown to this worker", "guide")
    return Guide(_GUIDE_FROM_PROTO[msg.guide_kind], msg.guide)


def sampling_from_proto(msg: rpb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, n=msg.n,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output, guide=_guide_from_proto(msg),
        guide_done_tokens=msg.guide_done_tokens if msg.guide_kind != rpb.GUIDE_KIND_UNSPECIFIED else 0,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        skip_special_tokens=not msg.HasField("skip_special_tokens") or msg.skip_special_tokens,
        spaces_between_special_tokens=(not msg.HasField("spaces_between_special_tokens")
                                       or msg.spaces_between_special_tokens),
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias), min_tokens=msg.min_tokens,
        bad_words=tuple(tuple(word.token_ids) for word in msg.bad_words),
    )


def request_to_proto(request: GenerationRequest, prefill_worker: str | None = None,
                     prefill_worker_id: WorkerId | None = None) -> rpb.GenerateRequest:
    """`prefill_worker`: the address of the prefill worker a decode worker should use, and
    `prefill_worker_id` its id (None: not known)."""
    priorities = [_checked(rpb.PriorityRange, "priorities", start=p.start, end=p.end,
                           priority=p.priority, duration_s=p.duration_s)
                  for p in request.priorities]
    multimodal = [_checked(rpb.MultimodalSpan, "multimodal", content_hash=m.content_hash,
                           offset=m.offset, length=m.length)
                  for m in request.multimodal]
    return _checked(
        rpb.GenerateRequest, "prompt_token_ids",
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        cache_salt=request.cache_salt, lora_id=request.lora_id, priorities=priorities,
        multimodal=multimodal, sampling=sampling_to_proto(request.sampling), prefill_worker=prefill_worker,
        prefill_worker_id=prefill_worker_id, block_keys=request.block_keys,
    )


def prefill_worker_from_proto(msg: rpb.GenerateRequest) -> str | None:
    return msg.prefill_worker if msg.HasField("prefill_worker") else None


def prefill_worker_id_from_proto(msg: rpb.GenerateRequest) -> WorkerId | None:
    return WorkerId(msg.prefill_worker_id) if msg.HasField("prefill_worker_id") else None


def request_from_proto(msg: rpb.GenerateRequest) -> GenerationRequest:
    """A missing `sampling` message means SamplingParams' defaults, not protobuf's zeros."""
    sampling = sampling_from_proto(msg.sampling) if msg.HasField("sampling") else SamplingParams()
    return GenerationRequest(
        request_id=RequestId(msg.request_id),
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        lora_id=msg.lora_id if msg.HasField("lora_id") else None,
        priorities=tuple(
            PriorityRange(p.start, p.end, p.priority,
                          p.duration_s if p.HasField("duration_s") else None)
            for p in msg.priorities
        ),
        multimodal=tuple(MultimodalSpan(m.content_hash, m.offset, m.length) for m in msg.multimodal),
        block_keys=tuple(BlockHash(key) for key in msg.block_keys),
    )


def logprob_to_proto(lp: TokenLogprob) -> rpb.TokenLogprob:
    top = [rpb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return rpb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top)


def logprob_from_proto(msg: rpb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def output_to_proto(output: RequestOutput) -> rpb.RequestOutput:
    if output.finish_reason not in _FINISH_TO_PROTO:
        raise InvalidRequestError(f"unknown finish_reason {output.finish_reason!r}", "finish_reason")
    return _checked(
        rpb.RequestOutput, "token_ids",
        request_id=output.request_id, index=output.index, token_ids=output.token_ids,
        text=output.text, logprobs=[logprob_to_proto(lp) for lp in output.logprobs],
        finish_reason=_FINISH_TO_PROTO[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        error=output.error, error_param=output.error_param, prefilled_by=output.prefilled_by,
        prompt_logprobs=[logprob_to_proto(lp) for lp in output.prompt_logprobs],
    )


def output_from_proto(msg: rpb.RequestOutput) -> RequestOutput:
    return RequestOutput(
        request_id=RequestId(msg.request_id),
        index=msg.index,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        logprobs=tuple(logprob_from_proto(lp) for lp in msg.logprobs),
        finish_reason=_decode(_FINISH_FROM_PROTO, msg.finish_reason, "finish_reason"),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        error=msg.error if msg.HasField("error") else None,
        error_param=msg.error_param if msg.HasField("error_param") else None,
        prefilled_by=msg.prefilled_by,
        prompt_logprobs=tuple(logprob_from_proto(lp) for lp in msg.prompt_logprobs),
    )


def stats_to_proto(stats: EngineStats) -> wpb.EngineStats:
    return wpb.EngineStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_proto(msg: wpb.EngineStats) -> EngineStats:
    return EngineStats(**{name: getattr(msg, name) for name in _STATS_FIELDS})


def info_to_proto(info: ModelInfo) -> wpb.ModelInfo:
    return wpb.ModelInfo(
        model_name=info.model_name, max_model_len=info.max_model_len,
        tokens_per_block=info.tokens_per_block, block_hash_algorithm=info.block_hash_algorithm,
        role=_ROLE_TO_PROTO[info.role], vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids, lora_enabled=info.lora_enabled, max_loras=info.max_loras,
        lora_adapters=[lora_to_proto(a) for a in info.lora_adapters],
    )


def info_from_proto(msg: wpb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=msg.model_name, max_model_len=msg.max_model_len,
        tokens_per_block=msg.tokens_per_block, block_hash_algorithm=msg.block_hash_algorithm,
        role=_decode(_ROLE_FROM_PROTO, msg.role, "role"), vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids), lora_enabled=msg.lora_enabled, max_loras=msg.max_loras,
        lora_adapters=tuple(lora_from_proto(a) for a in msg.lora_adapters),
    )


def lora_to_proto(adapter: LoraAdapterInfo) -> wpb.LoraAdapter:
    return wpb.LoraAdapter(name=adapter.name, lora_id=adapter.lora_id, path=adapter.path)


def lora_from_proto(msg: wpb.LoraAdapter) -> LoraAdapterInfo:
    return LoraAdapterInfo(msg.name, msg.lora_id, msg.path)
