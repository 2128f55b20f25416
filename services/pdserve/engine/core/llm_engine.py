"""`LLMEngine`: one worker's synchronous step loop.

    step = schedule → forward → mark computed → sample → detokenize / stop → free finished

The scheduler decides what runs, the KV cache manager which memory, the model runner runs
the tensors, the sampler picks tokens; this module only wires them together per step. With a
host tier, the block copies the manager queues (offloads on eviction, onboards of host hits)
are made after every claim and before anything reads or writes those blocks.

Beside the step loop, each in a part of its own: the KV hand-off between a prefill and a decode
worker (`remote`, a `RemotePrefill`; the sequences in hand-off and their leases in `handoffs`),
the LoRA adapters' lifecycle (`adapters`) and the checks a request passes before it is admitted
(`validation`).
"""
import itertools
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace


from pdserve.engine.core.adapters import Adapters
from pdserve.engine.core.detokenizer import IncrementalDetokenizer, StopChecker, StopPiece
from pdserve.engine.core.handoff import Handoffs
from pdserve.engine.core.remote_prefill import RemotePrefill
from pdserve.engine.core.request_stats import SeqTimes, StepStats
from pdserve.common.errors import InvalidRequestError, OutOfBlocksError
from pdserve.common.ids import BlockId, RequestId
from pdserve.common.request import GenerationRequest, RequestOutput
from pdserve.engine.loading.lora_files import LoraCheckpoint
from pdserve.engine.model.batch import ForwardBatch, SeqChunk
from pdserve.engine.model.guided import GuideCompiler, GuideMatcher
from pdserve.engine.model.host_store import TierStore
from pdserve.engine.model.logits_processors import TokenHistory
from pdserve.engine.model.sampler import Sampler, SamplingRow, logit_batch, make_generator
from pdserve.engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from pdserve.engine.core.sequence import Sequence, SeqStatus
from pdserve.engine.core.speculation import NO_SPECULATION, Speculator, Verified
from pdserve.engine.core.stopping import finish_reason_after, is_stop_token
from pdserve.engine.core.validation import check_request, check_request_id
from pdserve.kvcache import BlockHashChain, KvCacheManager


class LLMEngine:
    """Owns the sequences of every live request; not thread-safe (one thread drives it)."""

    def __init__(self, runner, kv: KvCacheManager, tokenizer, config: SchedulerConfig, sampler: Sampler | None = None,
                 clock: Callable[[], float] = time.monotonic, tier_store: TierStore | None = None,
                 speculator: Speculator | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.tier_store = tier_store
        self.tokenizer = tokenizer
        self.config = config
        self.scheduler = Scheduler(config, kv)
        self.speculator = speculator or NO_SPECULATION
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.sampler = sampler or Sampler(eos_token_ids=self.eos_token_ids)
        self.vocab_size = runner.config.vocab_size
        self._requests: dict[RequestId, list[Sequence]] = {}
        self._arrivals = itertools.count()
        self._clock = clock
        self.handoffs = Handoffs(kv, lambda: self._clock())  # sequences waiting on a KV transfer, with leases
        self._guides: GuideCompiler | None = None  # built from the tokenizer on the first guided request
        self._guides_lock = threading.Lock()
        self._step_stats = StepStats()
        self.adapters = Adapters(runner, self._loras_in_use)
        self.remote = RemotePrefill(self)  # the KV hand-off commands: reserve, complete, fail, release

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add_request(self, request: GenerationRequest, prefill_only: bool = False, hold_lease_s: float = 30.0,
                    arrival_s: float | None = None, start_by: float | None = None) -> None:
        """Queue a request; InvalidRequestError / DuplicateRequestError leave the engine unchanged.

        `prefill_only`: finish after the first token and keep the blocks (HELD) until
        `remote.release_held` or the lease ends, so a peer can receive the prompt's KV.
        `arrival_s`: when the worker received it, on this engine's clock (None: now).
        `start_by`: a request still queued then is ended with an error, nothing computed (a
        peer's prefill order bounds its wait so; this engine's clock).
        """
        self._validate(request)
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids), arrival_s)
        seq.prefill_only = prefill_only
        seq.hold_lease_s = hold_lease_s
        seq.start_by = start_by
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Queue a validated request's first sequence (its one sequence until it forks)."""
        seq.cache_request().validate()
        self._requests[seq.request.request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: RequestId) -> list[RequestOutput]:
        """Stop every completion of the request and free its blocks; unknown ids are ignored.

        Blocks a peer may still be writing (REMOTE_PREFILL) stay reserved until the transfer's
        outcome is reported or the lease ends; held blocks are released at once.
        """
        seqs = self._requests.pop(request_id, [])
        outputs = []
        handoff = self.handoffs.get(request_id)
        if handoff is not None and handoff.status is SeqStatus.HELD:
            self.handoffs.release(request_id)
        elif handoff is not None:
            handoff.aborted = True
            outputs.append(self._output(handoff, (), "", "abort"))
        for seq in seqs:
            if seq.status in (SeqStatus.WAITING, SeqStatus.RUNNING):
                self.scheduler.remove(seq)
                outputs.append(self._output(seq, (), "", "abort"))
        return outputs

    def step(self) -> list[RequestOutput]:
        self.adapters.drop_unused()
        started = self._clock()
        self.speculator.draft(self.scheduler.running, len(self.scheduler.waiting))
        chunks = self.scheduler.schedule()
        unread = self._move_between_tiers()
        if unread:
            chunks = self._recompute_unread(chunks, unread)
        if not chunks:
            return []
        batch = ForwardBatch(tuple(self._seq_chunk(c) for c in chunks))
        result = self.runner.forward(batch)
        self.speculator.observe(batch, result)
        self._step_stats.step_tokens.append(batch.num_tokens)
        sampled_rows: list[tuple[Sequence, object]] = []
        verified: list[Verified] = []
        for chunk, seq_chunk, logits in zip(chunks, batch.chunks, result.logits):
            if seq_chunk.all_logits:
                chunk.seq.record_prompt_logprobs(seq_chunk.start_pos, len(seq_chunk.token_ids), logits)
            self.kv.mark_computed(chunk.seq.seq_id, chunk.num_tokens)
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if chunk.seq.times.scheduled_s is None:
                chunk.seq.times.scheduled_s = started
            if chunk.drafts:
                verified.append((chunk.seq, chunk.drafts, logits))
            elif seq_chunk.needs_logits:
                sampled_rows += [(seq, logits[-1]) for seq in self._siblings_to_sample(chunk.seq)]
        outputs = self._sample_and_emit(sampled_rows)
        if verified:
            outputs += self.speculator.verify(verified, self._sample_and_emit, self._step_stats.spec)
        return outputs

    def take_step_stats(self) -> StepStats:
        """The request figures of the steps since the last call (for the worker's metrics)."""
        stats, self._step_stats = self._step_stats, StepStats()
        return stats

    def _move_between_tiers(self) -> set[BlockId]:
        """Make the queued copies between tiers; the device blocks whose copy back failed, which
        are no longer findable in the cache (their holders must recompute them)."""
        moves = self.kv.drain_tier_moves()
        if not moves:
            return set()
        assert self.tier_store is not None, "lower tiers in the KV cache manager need a tier store"
        unread = set(self.tier_store.apply(moves))
        for block_id in unread:
            self.kv.discard_unreadable(block_id)
        return unread

    def _recompute_unread(self, chunks: list[ScheduledChunk], unread: set[BlockId]) -> list[ScheduledChunk]:
        """Preempt every running sequence holding a block that could not be read back: it
        recomputes, and this step runs without it."""
        holders = set(self.kv.holders_of(unread))
        for seq in [s for s in self.scheduler.running if s.seq_id in holders]:
            self.scheduler.preempt(seq)
        return [c for c in chunks if c.seq.seq_id not in holders]

    # ---- LoRA adapters: the worker's two commands (`Adapters` keeps their lifecycle) -------------

    def add_lora(self, checkpoint: LoraCheckpoint) -> None:
        """Load an adapter (ConfigError, changing nothing, when it cannot be)."""
        self.adapters.add(checkpoint)

    def remove_lora(self, lora_id: int) -> None:
        """Refuse the adapter to new requests; its weights go once no live request uses them."""
        self.adapters.remove(lora_id)

    def _loras_in_use(self) -> set[int | None]:
        return {seqs[0].request.lora_id for seqs in self._requests.values() if seqs}

    # ---- internals -----------------------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        check_request_id(request.request_id, self._is_id_in_use)
        check_request(request, self.vocab_size, self.config)
        self.adapters.check_servable(request.lora_id)

    def _is_id_in_use(self, request_id: RequestId) -> bool:
        return bool(request_id in self._requests or self.handoffs.get(request_id) or self.kv.has_request(request_id))

    def _new_sequence(self, request: GenerationRequest, index: int, token_ids: list[int],
                      arrival_s: float | None = None) -> Sequence:
        """One of `request`'s sequences. The first (`index` 0) starts its block digests from the
        router's keys (`request.block_keys`, checked by their first block); a sibling takes
        its digests from its parent (`_siblings_to_sample`)."""
        seq_id = request.request_id if index == 0 else RequestId(f"{request.request_id}#{index}")
        sampling = request.sampling
        generator = None if sampling.seed is None else make_generator(sampling.seed, index, self.runner.device)
        seq = Sequence(
            seq_id, request, index, token_ids, self._detokenizer(request),
            StopChecker(sampling.stop, sampling.include_stop_str_in_output),
            next(self._arrivals), SeqTimes(self._clock() if arrival_s is None else arrival_s), generator,
            self._guide_matcher(request),
        )
        if index == 0 and request.block_keys:
            seq.hash_chain = BlockHashChain.from_keys(request.block_keys, token_ids, self.kv.tokens_per_block,
                                                      request.lora_id, request.multimodal, request.cache_salt)
        return seq

    def _guide_matcher(self, request: GenerationRequest) -> GuideMatcher | None:
        """A fresh grammar state for one of `request`'s sequences; InvalidRequestError for a
        guide that does not compile (raised before the request is admitted)."""
        guide, done = request.sampling.guide, request.sampling.guide_done_tokens
        if guide is None:
            return None
        prompt = request.prompt_token_ids
        if not 0 <= done <= len(prompt):
            raise InvalidRequestError(f"guide_done_tokens={done} is outside the prompt's {len(prompt)} tokens",
                                      "guide_done_tokens")
        return self.guide_compiler().matcher(guide, prompt[len(prompt) - done:])

    def guide_compiler(self) -> GuideCompiler:
        """The worker's guide compiler, built at its first use (from any thread)."""
        with self._guides_lock:
            if self._guides is None:
                self._guides = GuideCompiler(self.tokenizer.to_json(), self.vocab_size, self.tokenizer.eos_token_ids)
            return self._guides

    def _detokenizer(self, request: GenerationRequest) -> IncrementalDetokenizer:
        sampling = request.sampling
        joins_added = not (sampling.skip_special_tokens or sampling.spaces_between_special_tokens)
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sampling.skip_special_tokens,
                                      sampling.spaces_between_special_tokens,
                                      self.tokenizer.added_token_ids if joins_added else frozenset())

    def _seq_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_tokens
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start:end]) + chunk.drafts, start,
                        tuple(self.kv.block_ids(seq.seq_id)), needs_logits=end == len(seq.token_ids),
                        all_logits=seq.wants_prompt_logprobs or bool(chunk.drafts), lora_id=seq.request.lora_id,
                        is_prompt=start < seq.num_prompt_tokens)

    def _siblings_to_sample(self, seq: Sequence) -> list[Sequence]:
        """`seq`, plus its n-1 siblings forked off it when its prompt has just been computed."""
        family = self._requests[seq.request.request_id]
        if seq.prefill_only or seq.index != 0 or seq.num_output_tokens or len(family) >= seq.request.sampling.n:
            return [seq]
        forked = [seq]
        for index in range(1, seq.request.sampling.n):
            child = self._new_sequence(seq.request, index, list(seq.token_ids), seq.times.arrival_s)
            child.prompt_logprobs = seq.prompt_logprobs
            child.hash_chain = seq.hash_chain.prefix(len(child.token_ids))
            family.append(child)
            try:
                _, copy = self.kv.fork(seq.seq_id, child.cache_request())
            except OutOfBlocksError:
                self.scheduler.add(child)  # no room to share now: recompute from the prefix cache later
                continue
            self._move_between_tiers()
            if copy is not None:
                self.runner.copy_blocks([copy[0]], [copy[1]])
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = seq.num_computed_tokens
            child.times.scheduled_s = seq.times.scheduled_s
            self.scheduler.running.append(child)
            forked.append(child)
        return forked

    def _sample_and_emit(self, rows: list[tuple[Sequence, object]]) -> list[RequestOutput]:
        if not rows:
            return []
        logits = logit_batch([r for _, r in rows])  # (B, vocab)
        sampled = self.sampler.sample(logits, [SamplingRow(s.request.sampling, s.generator, s.guide,
                                                           TokenHistory(s.token_ids, s.num_prompt_tokens))
                                               for s, _ in rows])
        now = self._clock()
        return [self._advance(seq, token.token_id, token.logprob, now) for (seq, _), token in zip(rows, sampled)]

    def _advance(self, seq: Sequence, token_id: int, logprob, now: float) -> RequestOutput:
        self._step_stats.token(seq.times, seq.num_prompt_tokens, not seq.prefill_only, now)
        self.kv.append_tokens(seq.seq_id, [token_id])  # onto seq.token_ids: the KV manager's list too
        sampling = seq.request.sampling
        is_text = sampling.include_stop_str_in_output or not is_stop_token(seq, token_id, self.eos_token_ids)
        delta = seq.detokenizer.add([token_id]) if is_text else ""
        # As vLLM: no stop string is looked for in the text of the first min_tokens tokens.
        is_past_min = seq.num_output_tokens > sampling.min_tokens
        piece = seq.stops.feed(delta) if is_past_min else StopPiece(delta, False)
        reason = "stop" if piece.stopped else finish_reason_after(seq, token_id, self.eos_token_ids, self.config.max_model_len)
        guide_error = None if seq.guide is None else seq.guide.advance(token_id)  # whoever sampled it
        if guide_error is not None:
            reason = "error"
        elif reason is None and seq.guide is not None and seq.guide.is_finished:
            reason = "stop"  # the guided output is complete
        if seq.prefill_only and reason is None:
            reason = "length"
        text = piece.text
        if reason is not None and not piece.stopped:
            text += seq.stops.feed(seq.detokenizer.flush()).text + seq.stops.flush()
        if reason is not None:
            self._finish(seq)
        output = self._output(seq, (token_id,), text, reason, (logprob,) if logprob is not None else ())
        if guide_error is not None:
            output = replace(output, error=guide_error, error_param="guide")  # the request's guide, not us
        if seq.num_output_tokens == 1 and sampling.prompt_logprobs is not None:
            output = replace(output, prompt_logprobs=seq.known_prompt_logprobs())
        return output

    def _finish(self, seq: Sequence) -> None:
        if seq.prefill_only:
            self._hold(seq)
            return
        self.scheduler.remove(seq)
        family = self._requests.get(seq.request.request_id, [])
        if family and all(s.status is SeqStatus.FINISHED for s in family) and len(family) >= seq.request.sampling.n:
            del self._requests[seq.request.request_id]

    def _hold(self, seq: Sequence) -> None:
        self.scheduler.detach(seq)
        self.handoffs.hold(seq)
        self._requests.pop(seq.request.request_id, None)

    def _output(self, seq: Sequence, token_ids: Seq[int], text: str, reason: str | None, logprobs=()) -> RequestOutput:
        if reason is not None and not seq.prefill_only:  # a prefill-only sequence ends on the decode worker
            self._step_stats.finish(seq.times, reason, seq.num_prompt_tokens, seq.num_output_tokens, self._clock())
        held = tuple(self.kv.block_ids(seq.seq_id)) if seq.status is SeqStatus.HELD else ()
        return RequestOutput(seq.request.request_id, seq.index, tuple(token_ids), text, tuple(logprobs), reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, held_block_ids=held)
