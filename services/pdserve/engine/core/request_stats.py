"""What the engine tells its metrics about requests: per-sequence timestamps, and the figures of
the steps since the worker last asked (`StepStats`), as vLLM's `IterationStats` does.

The engine only records (a few clock reads and list appends per step); the worker turns the
figures into Prometheus series (`worker/engine_metrics.py`). Each completion of a request is
one sequence and counts as one request here, as each of vLLM's `n` child requests does.

Who records what, so that summing a series over workers never counts a request twice:
- the worker that computes a prompt records its queue and prefill times and its prompt tokens
  (`prefills`), whether it then decodes the request or only prefills it for a peer;
- the worker that emits a sequence's tokens records its first-token time, inter-token
  latencies, generated tokens and, when it ends, the request-level figures (`finished`).
  A prefill-only sequence emits nothing (its token goes to the decode worker, which emits it).
"""
from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqTimes:
    """One sequence's timestamps on the engine's clock. `scheduled_s` is when it first ran (or,
    prefilled by a peer, when its blocks were reserved); `prefilled_here` is False while its
    prompt's KV comes from a peer."""

    arrival_s: float
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    prefilled_here: bool = True


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """A prompt computed here: time waiting before it first ran, and from then to its token."""

    queue_s: float
    prefill_s: float
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class FinishedSeq:
    """A sequence that ended here. Phases it never reached are None (e.g. an abort while queued)."""

    finish_reason: str
    e2e_s: float
    inference_s: float | None  # first run to last token
    decode_s: float | None  # first token to last token
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class SpecCounts:
    """Speculative decoding's figures, as vLLM's `SpecDecodingStats`: sequence-steps that drafted,
    tokens drafted, drafts accepted, and drafts accepted at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_drafts)

    def drafted(self, num_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_tokens

    def accepted(self, position: int) -> None:
        self.num_accepted_tokens += 1
        if position >= len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (position + 1 - len(self.accepted_per_pos))
        self.accepted_per_pos[position] += 1


@dataclass(slots=True)
class StepStats:
    """The figures of the steps since the last `LLMEngine.take_step_stats()`."""

    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    prefills: list[PrefillDone] = field(default_factory=list)
    finished: list[FinishedSeq] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens each model step computed, prompt and decode
    spec: SpecCounts = field(default_factory=SpecCounts)

    def __bool__(self) -> bool:
        return bool(self.num_generation_tokens or self.prefills or self.finished or self.step_tokens or self.spec)

    def token(self, times: SeqTimes, num_prompt_tokens: int, emitted: bool, now: float) -> None:
        """A sequence got a token at `now`; `emitted` is False for a prefill-only sequence."""
        if times.first_token_s is None:
            times.first_token_s = now
            if times.prefilled_here:
                scheduled = now if times.scheduled_s is None else times.scheduled_s
                self.prefills.append(PrefillDone(scheduled - times.arrival_s, now - scheduled, num_prompt_tokens))
            if emitted:
                self.ttfts_s.append(now - times.arrival_s)
        elif emitted and times.last_token_s is not None and now != times.last_token_s:
            # One gap per step, as vLLM: the accepted drafts of a step come at its one time.
            self.inter_token_s.append(now - times.last_token_s)
        times.last_token_s = now
        self.num_generation_tokens += emitted

    def finish(self, times: SeqTimes, reason: str, num_prompt_tokens: int, num_output_tokens: int,
               now: float) -> None:
        first, last, scheduled = times.first_token_s, times.last_token_s, times.scheduled_s
        self.finished.append(FinishedSeq(
            reason, now - times.arrival_s,
            None if scheduled is None or last is None else last - scheduled,
            None if first is None or last is None else last - first,
            num_prompt_tokens, num_output_tokens))
