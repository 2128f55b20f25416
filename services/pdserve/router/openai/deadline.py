"""`Deadline`: the bound on each of a stream's waits, moved without making a timer per wait.

A per-token `asyncio.timeout` makes and cancels a timer for each output a stream waits for, and
for each SSE frame it sends: at 64 streams a py-spy profile of the router put ~7 % of its time
in them. Here each stream has one timer; moving the deadline is an assignment.
"""
import asyncio
import math


class Deadline:
    """A bound on one wait after another of a stream (`start` ... `pause`), as `asyncio.timeout`
    around each, but moved without a timer: the stream's one timer, firing before the deadline,
    re-arms itself for what is left. On expiry it cancels the task that waits, as
    `asyncio.timeout` does, and `has_expired` (in its `except CancelledError`) tells that from
    another cancel. Not thread-safe; one stream's waits, one at a time."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = math.inf
        self._expired = False

    def start(self, timeout_s: float) -> None:
        """Bound the current task's wait from now to `timeout_s` (the waiting task may change
        between waits: a consumer can read each output on a task of its own)."""
        self._task = asyncio.current_task()
        self._due = self._loop.time() + timeout_s
        if self._handle is None:
            self._handle = self._loop.call_at(self._due, self._fire)

    def pause(self) -> None:
        self._due = math.inf

    def has_expired(self) -> bool:
        """True (once) when this deadline cancelled the task, and nothing else did."""
        if not self._expired or self._task is None:
            return False
        self._expired = False
        return self._task.uncancel() == 0

    def close(self) -> None:
        self._due = math.inf
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if self._due == math.inf:
            return
        if self._loop.time() < self._due:
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        self._expired = True
        if self._task is not None:
            self._task.cancel()
