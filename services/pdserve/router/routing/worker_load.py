"""One worker's load as the router sees it: the worker's last report, corrected by what this
router dispatched to it.

    load = max(report − settled, 0) + unreported      (per figure: requests, blocks, prefill tokens)

- unreported: live dispatches made after the report was asked for (the report cannot hold them);
- settled: what dispatches made before the report was asked for gave back after it was asked
  (a finished request its blocks, a request past its first output its prefill tokens): the
  report still holds them.

So the next decision sees a dispatch, and its end, at once, without waiting for the worker's
next report, whatever order reports and ends arrive in. A dispatch's blocks are its prompt's,
an estimate of what it holds. Every decision asks every worker's load, and loads change far less
often than that: the figure is kept until the next report, dispatch or end.
"""
import math
from dataclasses import dataclass, field

from pdserve.common.stats import EngineStats
from pdserve.router.routing.cost import WorkerLoad


@dataclass(slots=True, eq=False)
class Dispatch:
    dispatched_at: float
    num_prefill_tokens: int  # zero once its first output arrived (prefill done)
    num_blocks: int


@dataclass(frozen=True, slots=True)
class _GivenBack:
    dispatched_at: float
    at: float
    figures: tuple[int, int, int]  # requests, blocks, prefill tokens


@dataclass(slots=True)
class LoadBook:
    report: EngineStats | None = None
    asked_at: float = -math.inf  # when the query that produced `report` was sent
    _dispatches: set[Dispatch] = field(default_factory=set)
    _given_back: list[_GivenBack] = field(default_factory=list)
    _load: WorkerLoad | None = None  # `load()` until something changes it

    def record_report(self, report: EngineStats, asked_at: float) -> None:
        self.report, self.asked_at, self._load = report, asked_at, None
        self._given_back = [g for g in self._given_back if g.at >= asked_at]  # older ones are in the report

    def dispatch(self, now: float, num_prefill_tokens: int, num_blocks: int) -> Dispatch:
        entry = Dispatch(now, num_prefill_tokens, num_blocks)
        self._dispatches.add(entry)
        self._load = None
        return entry

    def prefill_done(self, entry: Dispatch, now: float) -> None:
        if entry in self._dispatches:
            self._given_back.append(_GivenBack(entry.dispatched_at, now, (0, 0, entry.num_prefill_tokens)))
        entry.num_prefill_tokens = 0
        self._load = None

    def finish(self, entry: Dispatch, now: float) -> None:
        """The request ended; a second call for the same entry changes nothing."""
        if entry not in self._dispatches:
            return
        self._dispatches.discard(entry)
        self._given_back.append(_GivenBack(entry.dispatched_at, now, (1, entry.num_blocks, entry.num_prefill_tokens)))
        self._load = None

    @property
    def num_live(self) -> int:
        """Dispatches not finished yet (the streams on the worker)."""
        return len(self._dispatches)

    def clear(self) -> None:
        """Forget every dispatch (the worker went away, and its requests with it)."""
        self._dispatches.clear()
        self._given_back.clear()
        self._load = None

    def load(self) -> WorkerLoad:
        if self._load is None:
            self._load = self._compute_load()
        return self._load

    def _compute_load(self) -> WorkerLoad:
        r = self.report
        figures = [r.num_running + r.num_waiting, r.num_used_blocks, r.num_prefill_tokens_queued] if r else [0, 0, 0]
        for given in self._given_back:
            if given.dispatched_at < self.asked_at:
                figures = [f - g for f, g in zip(figures, given.figures, strict=True)]
        figures = [max(f, 0) for f in figures]
        for d in self._dispatches:
            if d.dispatched_at >= self.asked_at:
                figures = [figures[0] + 1, figures[1] + d.num_blocks, figures[2] + d.num_prefill_tokens]
        return WorkerLoad(*figures)
