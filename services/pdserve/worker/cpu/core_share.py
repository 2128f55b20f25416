"""Cores shared by the workers of one machine: a worker with work also runs on its idle peers' cores.

`pdserve serve` on a small machine gives each of its workers a fixed part of the cores (one torch
thread each for a prefill and a decode worker on two cores). With a fixed split half the machine
waits whenever one worker has nothing to do: the prefill worker while the decode worker decodes
the tail of a burst, the decode worker while a lone prompt is prefilled. Workers given the same
`--core-share-file` each hold a slot of one small table in that file:

    slot i (4 int32): | pid | base threads | busy (has work) | threads in use |

Before each step a worker with work marks itself busy and takes its base threads plus its share
(by base) of the cores that busy workers' bases leave free (`threads_for`); then, before running,
it waits (at most `max_wait_s`) until the threads its peers still use fit beside its own
(`fits`): two OpenMP pools on one core spin at each other's barriers, and a step run that way
takes far longer than one that waited for the peer's step to end, while the waiting leaves no
core idle (the peer's step runs on them all). The bound is above the longest step a lender runs
(a 2,048-token prefill chunk on two threads takes ~1.3 s on the default model), so that only a
peer that stopped stepping is run beside oversubscribed. A worker without work marks
itself idle, with no threads in use.

A step's threads are chosen as it starts; a peer that goes idle while a long step runs (a
2,048-token prefill chunk on one thread) would leave its core idle until that step ends. With
`follow_mid_step` a watcher thread looks at the table while this worker steps and, when its
peers leave more cores than it runs on, raises the count in `threads_now` (and its threads in
use) at once; the native forward starts each layer on that count. A step never shrinks midway:
a peer that turns busy waits for the step's end, as it would for a step that began on them all,
and runs its caller's `while_waiting` between polls (its engine thread's commands: a decode
worker's remote first tokens go out then, not after the peer's step).

A slot is held by an exclusive record lock on its bytes, which the kernel drops when the process
dies: a slot whose lock can be taken is free, whatever its bytes still say. Record locks belong to
a process, and closing any descriptor of the file drops them all: a process holding a slot opens
the file through its `CoreShare` alone, and holds at most one.
"""
import array
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

NUM_SLOTS = 64
_FIELDS = 4  # pid, base, busy, in_use
_SLOT_BYTES = _FIELDS * 4
_FILE_BYTES = NUM_SLOTS * _SLOT_BYTES
_PID, _BASE, _BUSY, _IN_USE = range(_FIELDS)


@dataclass(frozen=True, slots=True)
class Peer:
    base: int
    is_busy: bool
    in_use: int


def threads_for(base: int, busy_peers: Sequence[Peer], num_cores: int) -> int:
    """A busy worker's threads: its base plus its share, by base, of the cores the busy workers'
    bases leave free (the cores of idle peers, and any no worker was given)."""
    busy_bases = base + sum(p.base for p in busy_peers)
    spare = num_cores - busy_bases
    return base + spare * base // busy_bases if spare > 0 else base


def fits(threads: int, base: int, peers: Sequence[Peer], num_cores: int) -> bool:
    """May a step on `threads` start beside what the peers use now? Yes when all of it fits on the
    cores, or when no one uses more than its base (bases that add up to more than the cores are
    the user's choice, not a lend to wait out)."""
    limit = max(num_cores, base + sum(p.base for p in peers if p.is_busy))
    return threads + sum(p.in_use for p in peers) <= limit


class FixedThreads:
    """No sharing: the engine keeps the threads it was built with (the null `CoreShare`)."""

    def before_step(self, while_waiting: Callable[[], None] = lambda: None) -> None:
        pass

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


class CoreShare:
    """This process's slot in a shared table; call `before_step` and `idle` on the engine's thread,
    which owns the OpenMP pool that `set_threads` sizes."""

    def __init__(self, path: str, base: int, num_cores: int, set_threads: Callable[[int], None],
                 max_wait_s: float = 5.0, poll_s: float = 0.001, grow_poll_s: float = 0.005) -> None:
        self._base, self._num_cores, self._set_threads = base, num_cores, set_threads
        self._max_wait_s, self._poll_s, self._grow_poll_s = max_wait_s, poll_s, grow_poll_s
        self._threads = base
        self.threads_now = array.array("i", [base])  # what a step follows between layers
        self._lock = threading.Lock()  # the step state below, between the engine's thread and the watcher
        self._stepping = threading.Event()
        self._grown = False  # threads raised mid-step: torch is told again before the next step
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size < _FILE_BYTES:
                os.ftruncate(self._fd, _FILE_BYTES)
            self._map = mmap.mmap(self._fd, _FILE_BYTES)
            self._table = memoryview(self._map).cast("i")
            self.slot = self._claim()
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def threads(self) -> int:
        """The torch threads this worker's engine runs on now."""
        return self._threads

    def slot_state(self, slot: int) -> Peer:
        """What the table says of `slot` (a worker's base, whether it is busy, its threads in use)."""
        return Peer(self._field(slot, _BASE), bool(self._field(slot, _BUSY)), self._field(slot, _IN_USE))

    def follow_mid_step(self) -> array.array:
        """Let a step grow onto cores its peers leave idle while it runs: start the watcher and
        return the one-int buffer the step reads its thread count from between layers."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="core-share", daemon=True)
            self._watcher.start()
        return self.threads_now

    def before_step(self, while_waiting: Callable[[], None] = lambda: None) -> None:
        """Mark this worker busy, size its threads, and wait (bounded) until they fit beside the peers';
        `while_waiting` runs between polls, so work that needs no forward (a remote prefill's first
        token, an abort) is not held up for the peer's step."""
        with self._lock:
            self._stepping.clear()
            if self._grown:  # the step may have ended before following the raise: tell torch again
                self._threads, self._grown = 0, False
        self._write(_BUSY, 1)
        deadline = time.monotonic() + self._max_wait_s
        while True:
            peers = self._live_peers()
            threads = threads_for(self._base, [p for p in peers if p.is_busy], self._num_cores)
            self._use(threads)
            if fits(threads, self._base, peers, self._num_cores) or time.monotonic() >= deadline:
                self._stepping.set()
                return
            while_waiting()
            time.sleep(self._poll_s)

    def idle(self) -> None:
        with self._lock:
            self._stepping.clear()
        if self._field(self.slot, _BUSY) or self._field(self.slot, _IN_USE):
            self._write(_BUSY, 0)
            self._write(_IN_USE, 0)

    def close(self) -> None:
        """Give the slot back (the lock goes with the descriptor)."""
        self._closing.set()
        self._stepping.set()  # wakes the watcher to see it
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        for field in range(_FIELDS):
            self._write(field, 0)
        self._table.release()
        self._map.close()
        os.close(self._fd)

    def _claim(self) -> int:
        for slot in range(NUM_SLOTS):
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT_BYTES, slot * _SLOT_BYTES)
            except OSError:
                continue
            self.slot = slot
            for field, value in ((_BUSY, 0), (_IN_USE, 0), (_BASE, self._base), (_PID, os.getpid())):
                self._write(field, value)
            return slot
        raise OSError(f"all {NUM_SLOTS} slots of the core-share table are held")

    def _use(self, threads: int) -> None:
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads
        self.threads_now[0] = threads
        self._write(_IN_USE, threads)

    def _watch(self) -> None:
        """While a step runs on fewer threads than the cores, raise its count as soon as the
        peers leave the cores for more (never beyond what fits beside their threads in use)."""
        while True:
            self._stepping.wait()
            if self._closing.is_set():
                return
            with self._lock:
                if self._stepping.is_set() and self._threads < self._num_cores:
                    peers = self._live_peers()
                    threads = threads_for(self._base, [p for p in peers if p.is_busy], self._num_cores)
                    if threads > self._threads and fits(threads, self._base, peers, self._num_cores):
                        self._threads, self._grown = threads, True
                        self.threads_now[0] = threads
                        self._write(_IN_USE, threads)
            time.sleep(self._grow_poll_s)

    def _live_peers(self) -> list[Peer]:
        peers = []
        for slot in range(NUM_SLOTS):
            if slot == self.slot or not self._field(slot, _PID):
                continue
            peer = self.slot_state(slot)
            if (peer.is_busy or peer.in_use) and self._is_abandoned(slot):
                continue
            peers.append(peer)
        return peers

    def _is_abandoned(self, slot: int) -> bool:
        """True when no process holds `slot`'s lock (its owner died): its bytes are cleared."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB, _SLOT_BYTES, slot * _SLOT_BYTES)
        except OSError:
            return False
        for field in range(_FIELDS):
            self._table[slot * _FIELDS + field] = 0
        fcntl.lockf(self._fd, fcntl.LOCK_UN, _SLOT_BYTES, slot * _SLOT_BYTES)
        log.info("core share: slot %d's worker is gone; its cores are free", slot)
        return True

    def _field(self, slot: int, field: int) -> int:
        return self._table[slot * _FIELDS + field]

    def _write(self, field: int, value: int) -> None:
        self._table[self.slot * _FIELDS + field] = value
