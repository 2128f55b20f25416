"""One completion being generated: its tokens, progress, and text state.

A request with `n` completions becomes `n` sequences; they share the prompt's blocks
(the first is forked after its prefill).
"""
import enum
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.core.request_stats import SeqTimes
from pdserve.common.ids import RequestId
from pdserve.common.request import GenerationRequest, TokenLogprob
from pdserve.engine.model.prompt_logprobs import prompt_token_logprobs
from pdserve.kvcache import BlockHashChain, CacheRequest


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE_PREFILL = "remote_prefill"  # blocks reserved; the prompt's KV is arriving from a peer
    HELD = "held"  # prefill done; blocks kept for a peer to receive
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: RequestId  # the KV cache manager's id: request id, "<request id>#<index>", or "…~<n>" when
    # recomputed after a failed remote prefill (the first id's blocks are quarantined)
    request: GenerationRequest
    index: int
    token_ids: list[int]  # prompt, then generated tokens
    detokenizer: IncrementalDetokenizer
    stops: StopChecker
    arrival: int  # admission order; the latest arrival is preempted first
    times: SeqTimes  # for the metrics: arrival, first run, first and last token
    generator: object | None = None  # torch.Generator for a seeded request
    guide: object | None = None  # GuideMatcher over the output tokens, when the output is guided
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    prefill_only: bool = False  # stop after the first token and hold the blocks for a peer
    hold_lease_s: float = 30.0  # how long HELD blocks wait for the peer
    lease_deadline: float | None = None  # REMOTE_PREFILL / HELD blocks are freed after this
    start_by: float | None = None  # still WAITING then (never run): ended with an error
    aborted: bool = False
    # Prompt logprobs by prompt position (1..), filled chunk by chunk while the prompt is computed;
    # siblings forked after the prefill share the first sequence's.
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    hash_chain: BlockHashChain = field(default_factory=BlockHashChain)  # its block digests, hashed once
    draft_tokens: tuple[int, ...] = ()  # speculative tokens to verify after its next token (this step only)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_output_tokens == 0

    def cache_request(self, num_claim_tokens: int | None = None) -> CacheRequest:
        """The KV cache's view of this sequence: its token list (not a copy: a claimed sequence's
        tokens are appended through the KV manager) and its block digests.
        A prompt whose logprobs are wanted is computed whole, never taken from the cache."""
        r = self.request
        return CacheRequest(self.seq_id, self.token_ids, r.lora_id, r.cache_salt, r.multimodal,
                            r.priorities, num_claim_tokens=num_claim_tokens,
                            reuse_cached_prefix=not self.wants_prompt_logprobs, hash_chain=self.hash_chain)

    def record_prompt_logprobs(self, start_pos: int, num_tokens: int, logits: torch.Tensor) -> None:
        """Keep the logprobs of the prompt tokens a chunk's rows predict: row i, at position
        start_pos + i, predicts prompt token start_pos + i + 1."""
        num_rows = min(num_tokens, self.num_prompt_tokens - 1 - start_pos)
        if num_rows <= 0:
            return
        first = start_pos + 1
        next_ids = self.token_ids[first:first + num_rows]
        entries = prompt_token_logprobs(logits[:num_rows], next_ids, self.request.sampling.prompt_logprobs or 0)
        self.prompt_logprobs.update(zip(range(first, first + num_rows), entries))

    def known_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's logprobs, tokens 1.. in order; () where they were not computed here (a
        prompt a peer prefilled: the decode worker keeps such requests local, so never in practice)."""
        positions = range(1, self.num_prompt_tokens)
        known = self.prompt_logprobs
        return tuple(known[p] for p in positions) if all(p in known for p in positions) else ()

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not all known yet (the prompt is still to compute)."""
        return (self.request.sampling.prompt_logprobs is not None and self.is_prefilling
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)
