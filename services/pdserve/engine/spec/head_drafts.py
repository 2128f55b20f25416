"""`HeadDrafts`: the proposer of every head the target's hidden states feed (EAGLE, EAGLE-3, MTP).

A head's row at position p reads the target's hidden state at p and the token at p + 1, and
predicts the token at p + 2 (vLLM's alignment). So its K/V at p can be written only once the
token after p is known:

    positions  | head K/V final (done) | target hidden kept, next token pending | drafts |
    written    | observe / propose     | propose: through the last computed one | chain  |

- `observe` (after each target forward) keeps the step's hidden rows and input tokens, and at
  once feeds every position whose next token is known for certain: one the target has since
  computed, or the next one in the same chunk where that chunk carries no drafts (a prompt
  chunk, a plain decode token). A long prompt is fed chunk by chunk, never buffered whole, and
  a sequence not drafted for keeps one pending row.
- `propose` feeds the rest for each sequence through its last computed position (the accepted
  drafts of the last step and the token it sampled; rows of rejected drafts are dropped), whose
  output gives the first draft; each draft is then fed with the head's own hidden state to give
  the next (greedy). Drafted positions' K/V is provisional: the next `propose` writes them again
  from the target's states.

A sequence the head did not watch from position 0 (a prefix the target found cached, a prompt a
peer prefilled on a decode worker, a recomputation after preemption) starts at the first
position it sees, its attention reading only what the head wrote for it from there
(`Span.first_key`): drafts come at once, from less context (see `eagle.py` for the measure).
Where the blocks before that position hold head K/V written whole for the same tokens
(`head_blocks.py`: a prefix cached on this worker, a system prompt, an earlier turn), it reads
them too. Drafts never change the output, only how many tokens a step gains.
"""
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.common.errors import OutOfBlocksError
from pdserve.common.ids import RequestId
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.model.batch import ForwardBatch, ForwardOutput, HiddenCapture, HiddenStates
from pdserve.engine.spec.head_blocks import BlockDigests, HeadBlocks
from pdserve.engine.spec.head_layer import HeadKv, HeadLayer, Span


class Head(Protocol):
    """What a head adds to the shared machinery: its inputs and its drafts."""

    capture: HiddenCapture  # the target's hidden states it reads
    layer: HeadLayer
    config: ModelConfig  # its layer's shape (heads, head_dim) and rope

    def target_hidden(self, hidden: HiddenStates) -> torch.Tensor:
        """The step's captured states -> (T, H): what the head reads for each target token."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (T,) -> the embeddings it reads (T, H): the target's, or its own."""

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of the next tokens (T, H), hidden states (T, H), positions (T,) -> the
        layer's attention input (T, X) and the residual stream it adds to (T, H)."""

    def draft(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output rows (R, H) -> greedy target token ids (R,) and the hidden state
        each feeds to the next draft (R, H)."""


@dataclass(slots=True)
class Track:
    """What the head holds for one sequence: final K/V for positions first..done-1, and the
    target's hidden rows and input tokens for positions done.. (each to be fed once the token
    after it is certain)."""

    first: int
    done: int
    rows: torch.Tensor  # (n, H)
    tokens: list[int]  # (n,): the target's input token at each of those positions
    digests: BlockDigests | None = None  # its tokens from 0 (None until known: first > 0, before a `propose`)
    recorded: int = 0  # blocks before this one are recorded in `HeadBlocks` (or could not be)

    @property
    def end(self) -> int:
        return self.done + self.rows.shape[0]


@dataclass(slots=True)
class Feed:
    """Rows of one head step for one sequence."""

    seq_id: RequestId
    start_pos: int
    token_ids: list[int]  # the token after each position
    hidden: torch.Tensor  # (len(token_ids), H)
    first_key: int
    block_table: tuple[int, ...]


@dataclass(slots=True)
class Chain:
    """One sequence's drafts in a `propose` call."""

    seq_id: RequestId
    budget: int
    next_pos: int  # where its last draft is fed
    first_key: int
    block_table: tuple[int, ...]
    drafts: list[int] = field(default_factory=list)
    carried: torch.Tensor | None = None  # (1, H): the hidden state fed with the last draft


class HeadDrafts:
    """Drafts with a head over the target's hidden states (module docstring)."""

    def __init__(self, head: Head, target, kv) -> None:
        self.head = head
        self.target = target  # ModelRunner: its embedding, LM head and captured hidden states
        self.kv = kv  # the target's KvCacheManager: block tables and slot reservations
        self.head_kv = HeadKv(target.num_blocks, target.tokens_per_block, head.config, target.kv_tensor.dtype,
                              target.device)
        self.blocks = HeadBlocks(target.tokens_per_block)
        self._tracks: dict[RequestId, Track] = {}
        target.capture_hidden(head.capture)

    @torch.inference_mode()
    def observe(self, batch: ForwardBatch, output: ForwardOutput) -> None:
        rows = self.head.target_hidden(output.hidden)  # (T, H)
        feeds, first = [], 0
        for chunk in batch.chunks:
            num = len(chunk.token_ids)
            track = self._kept(self._tracks.get(chunk.request_id), chunk.start_pos, rows[first:first + num],
                               chunk.token_ids, chunk.lora_id)
            self._tracks[chunk.request_id] = track
            first += num
            # a chunk carrying drafts holds one token of the sequence's own: the rest may be rejected
            known = num if chunk.is_prompt or num == 1 else 1
            end = chunk.start_pos + known - 1  # positions before it have their next token certain
            if end > track.done:
                feeds.append(self._feed(chunk.request_id, track, track.tokens[1:end + 1 - track.done],
                                        chunk.block_table))
        for seq_id in [s for s in self._tracks if not self.kv.has_request(s)]:
            del self._tracks[seq_id]
        if feeds:
            self._run(feeds)

    @torch.inference_mode()
    def propose(self, seqs: Seq, num_tokens: Seq[int]) -> list[list[int]]:
        feeds, chains = [], []
        for seq, budget in zip(seqs, num_tokens):
            track = self._tracks.get(seq.seq_id)
            computed = seq.num_computed_tokens
            if (budget < 1 or track is None or not track.done < computed <= track.end
                    or not self._reserve(seq.seq_id, budget)):
                continue
            table = tuple(self.kv.block_ids(seq.seq_id))
            self._adopt_cached(seq, track, table)
            feeds.append(self._feed(seq.seq_id, track, list(seq.token_ids[track.done + 1:computed + 1]), table))
            chains.append(Chain(seq.seq_id, budget, computed, track.first, table))
        if feeds:
            self._first_drafts(feeds, chains)
            self._rest_of_drafts(chains)
        by_seq = {c.seq_id: c.drafts for c in chains}
        return [by_seq.get(seq.seq_id, []) for seq in seqs]

    def _adopt_cached(self, seq, track: Track, table: tuple[int, ...]) -> None:
        """At the first `propose` of a sequence first seen past position 0 (its tokens before
        known now): read from position 0 where every block before its first watched position
        holds head K/V written for its tokens; record the blocks it wrote whole since."""
        if track.digests is not None:
            return
        tpb = self.blocks.tokens_per_block
        track.digests = BlockDigests(seq.request.lora_id, list(seq.token_ids[:track.done + 1]))
        track.recorded = -(-track.first // tpb)
        if track.first % tpb == 0 and self.blocks.holds(track.digests, table, track.first // tpb):
            track.first = 0
        self._record(track, table)

    def _record(self, track: Track, table: tuple[int, ...]) -> None:
        """Record the blocks the head has now written whole for this sequence (the token after
        each block certain)."""
        end = track.done // self.blocks.tokens_per_block
        if track.digests is not None and end > track.recorded:
            self.blocks.record(track.digests, table, track.recorded, end)
            track.recorded = end

    @staticmethod
    def _kept(track: Track | None, start: int, rows: torch.Tensor, tokens: Seq[int], lora_id: int | None) -> Track:
        """The track after a target chunk at `start`: rows past it (rejected drafts) replaced; a
        sequence seen first, recomputed or out of step starts again here."""
        if track is None or not track.done <= start <= track.end:
            return Track(start, start, rows, list(tokens), BlockDigests(lora_id, [tokens[0]]) if start == 0 else None)
        kept = start - track.done
        return Track(track.first, track.done, torch.cat((track.rows[:kept], rows)), track.tokens[:kept] + list(tokens),
                     track.digests, track.recorded)

    def _feed(self, seq_id: RequestId, track: Track, tokens: list[int], table: tuple[int, ...]) -> Feed:
        return Feed(seq_id, track.done, tokens, track.rows[:len(tokens)], track.first, table)

    def _reserve(self, seq_id: RequestId, budget: int) -> bool:
        """Slots for the drafts' K/V and their verification (drafts never preempt anyone)."""
        try:
            self.kv.allocate_slots(seq_id, 1 + budget)
        except OutOfBlocksError:
            return False
        return True

    def _run(self, feeds: list[Feed]) -> torch.Tensor:
        """Feed each sequence's rows in one head step; their K/V becomes final. -> (T, H) outputs."""
        spans, first = [], 0
        for feed in feeds:
            spans.append(Span(first, len(feed.token_ids), feed.start_pos, feed.first_key, feed.block_table))
            first += len(feed.token_ids)
        positions = torch.cat([torch.arange(f.start_pos, f.start_pos + len(f.token_ids)) for f in feeds])
        out = self._step([t for f in feeds for t in f.token_ids], torch.cat([f.hidden for f in feeds]), positions, spans)
        for feed in feeds:
            track, num = self._tracks[feed.seq_id], len(feed.token_ids)
            track.done += num
            track.rows, track.tokens = track.rows[num:], track.tokens[num:]
            if track.digests is not None:
                track.digests.tokens += feed.token_ids
                self._record(track, feed.block_table)
        return out

    def _first_drafts(self, feeds: list[Feed], chains: list[Chain]) -> None:
        out = self._run(feeds)
        last = torch.tensor([len(f.token_ids) for f in feeds]).cumsum(0) - 1
        tokens, carried = self.head.draft(out.index_select(0, last))
        for i, chain in enumerate(chains):
            chain.drafts.append(int(tokens[i]))
            chain.carried = carried[i:i + 1]

    def _rest_of_drafts(self, chains: list[Chain]) -> None:
        """Feed each sequence's last draft with its hidden state, one row each, until each has its count."""
        while live := [c for c in chains if len(c.drafts) < c.budget]:
            spans = [Span(i, 1, c.next_pos, c.first_key, c.block_table) for i, c in enumerate(live)]
            positions = torch.tensor([c.next_pos for c in live])
            out = self._step([c.drafts[-1] for c in live], torch.cat([c.carried for c in live]), positions, spans)
            tokens, carried = self.head.draft(out)
            for i, chain in enumerate(live):
                chain.drafts.append(int(tokens[i]))
                chain.carried = carried[i:i + 1]
                chain.next_pos += 1

    def _step(self, token_ids: list[int], hidden: torch.Tensor, positions: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        tpb = self.blocks.tokens_per_block
        self.blocks.forget({s.block_table[p // tpb] for s in spans for p in range(s.start_pos, s.start_pos + s.num_rows)})
        embeds = self.head.embed_tokens(torch.tensor(token_ids, device=self.target.device))  # (T, H)
        positions = positions.to(self.target.device)
        x, residual = self.head.inputs(embeds, hidden, positions)
        return self.head.layer(x, residual, positions, spans, self.head_kv)
