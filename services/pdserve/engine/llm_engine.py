"""`LLMEngine`: one worker's synchronous step loop.

    step = schedule → forward → mark computed → sample → detokenize / stop → free finished

The scheduler decides what runs, the KV cache manager which memory, the model runner runs
the tensors, the sampler picks tokens; this module only wires them together per step.
"""
import itertools
from collections.abc import Sequence as Seq

import torch

from pdserve.common.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.common.errors import DuplicateRequestError, InvalidRequestError, OutOfBlocksError
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.engine.batch import ForwardBatch, SeqChunk
from pdserve.engine.sampler import Sampler, SamplingRow, make_generator
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence, SeqStatus
from pdserve.engine.stopping import finish_reason_after
from pdserve.kvcache import KvCacheManager


class LLMEngine:
    """Owns the sequences of every live request; not thread-safe (one thread drives it)."""

    def __init__(self, runner, kv: KvCacheManager, tokenizer, config: SchedulerConfig, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = Scheduler(config, kv)
        self.sampler = sampler or Sampler()
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.vocab_size = runner.config.vocab_size
        self._requests: dict[RequestId, list[Sequence]] = {}
        self._arrivals = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; InvalidRequestError / DuplicateRequestError leave the engine unchanged."""
        self._validate(request)
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids))
        seq.cache_request().validate()
        self._requests[request.request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: RequestId) -> list[RequestOutput]:
        """Stop every completion of the request and free its blocks; unknown ids are ignored."""
        seqs = self._requests.pop(request_id, [])
        outputs = []
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq)
                outputs.append(self._output(seq, (), "", "abort"))
        return outputs

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        batch = ForwardBatch(tuple(self._seq_chunk(c) for c in chunks))
        result = self.runner.forward(batch)
        sampled_rows: list[tuple[Sequence, object]] = []
        for chunk, seq_chunk, logits in zip(chunks, batch.chunks, result.logits):
            self.kv.mark_computed(chunk.seq.seq_id, chunk.num_tokens)
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if seq_chunk.needs_logits:
                sampled_rows += [(seq, logits[-1]) for seq in self._siblings_to_sample(chunk.seq)]
        return self._sample_and_emit(sampled_rows)

    # ---- internals -----------------------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        prompt = request.prompt_token_ids
        if request.request_id in self._requests:
            raise DuplicateRequestError(f"request {request.request_id!r} is already running")
        if not prompt:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt has token ids outside 0..{self.vocab_size - 1}", "prompt")
        max_len = self.config.max_model_len
        if len(prompt) + request.sampling.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds "
                f"max_model_len {max_len}", "max_tokens")
        if not 1 <= request.sampling.n <= self.config.max_num_seqs:
            raise InvalidRequestError(f"n={request.sampling.n}: must be in 1..{self.config.max_num_seqs}", "n")

    def _new_sequence(self, request: GenerationRequest, index: int, token_ids: list[int]) -> Sequence:
        seq_id = request.request_id if index == 0 else RequestId(f"{request.request_id}#{index}")
        sampling = request.sampling
        generator = None if sampling.seed is None else make_generator(sampling.seed, index, self.runner.device)
        return Sequence(
            seq_id, request, index, token_ids,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            StopChecker(sampling.stop, sampling.include_stop_str_in_output),
            next(self._arrivals), generator,
        )

    def _seq_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_tokens
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start:end]), start,
                        tuple(self.kv.block_ids(seq.seq_id)), needs_logits=end == len(seq.token_ids))

    def _siblings_to_sample(self, seq: Sequence) -> list[Sequence]:
        """`seq`, plus its n-1 siblings forked off it when its prompt has just been computed."""
        family = self._requests[seq.request.request_id]
        if seq.index != 0 or seq.num_output_tokens or len(family) >= seq.request.sampling.n:
            return [seq]
        forked = [seq]
        for index in range(1, seq.request.sampling.n):
            child = self._new_sequence(seq.request, index, list(seq.token_ids))
            family.append(child)
            try:
                _, copy = self.kv.fork(seq.seq_id, child.seq_id)
            except OutOfBlocksError:
                self.scheduler.add(child)  # no room to share now: recompute from the prefix cache later
                continue
            if copy is not None:
                self.runner.copy_blocks([copy[0]], [copy[1]])
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = seq.num_computed_tokens
            self.scheduler.running.append(child)
            forked.append(child)
        return forked

    def _sample_and_emit(self, rows: list[tuple[Sequence, object]]) -> list[RequestOutput]:
        if not rows:
            return []
        logits = torch.stack([r for _, r in rows])  # (B, vocab)
        sampled = self.sampler.sample(logits, [SamplingRow(s.request.sampling, s.generator) for s, _ in rows])
        outputs = []
        for (seq, _), token in zip(rows, sampled):
            outputs.append(self._advance(seq, token.token_id, token.logprob))
        return outputs

    def _advance(self, seq: Sequence, token_id: int, logprob) -> RequestOutput:
        seq.token_ids.append(token_id)
        self.kv.append_tokens(seq.seq_id, [token_id])
        piece = seq.stops.feed(seq.detokenizer.add([token_id]))
        reason = "stop" if piece.stopped else finish_reason_after(seq, token_id, self.eos_token_ids, self.config.max_model_len)
        text = piece.text
        if reason is not None and not piece.stopped:
            text += seq.stops.feed(seq.detokenizer.flush()).text + seq.stops.flush()
        if reason is not None:
            self._finish(seq)
        return self._output(seq, (token_id,), text, reason, (logprob,) if logprob is not None else ())

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        family = self._requests.get(seq.request.request_id, [])
        if family and all(s.status is SeqStatus.FINISHED for s in family) and len(family) >= seq.request.sampling.n:
            del self._requests[seq.request.request_id]

    def _output(self, seq: Sequence, token_ids: Seq[int], text: str, reason: str | None, logprobs=()) -> RequestOutput:
        return RequestOutput(seq.request.request_id, seq.index, tuple(token_ids), text, tuple(logprobs), reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens)
