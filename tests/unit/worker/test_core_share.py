"""CoreShare: the workers of one machine lend each other the cores they leave idle.

The slot locks belong to a process, so each peer here is a process of its own."""
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pdserve.common.errors import ConfigError
from pdserve.worker.bootstrap import core_share
from pdserve.worker.cpu.core_share import CoreShare, Peer, fits, threads_for

PEER = textwrap.dedent("""
    import sys
    from pdserve.worker.cpu.core_share import CoreShare
    threads = []
    share = CoreShare(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), threads.append, max_wait_s=float(sys.argv[4]))
    print("slot", share.slot, flush=True)
    for line in sys.stdin:
        getattr(share, line.strip())()
        print("threads", threads[-1] if threads else int(sys.argv[2]), flush=True)
""")


class PeerProcess:
    """Another worker's CoreShare in its own process, driven a command at a time."""

    def __init__(self, path, base=1, num_cores=2, max_wait_s=0.1):
        self.process = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(base), str(num_cores),
                                         str(max_wait_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.slot = int(self._line("slot"))

    def do(self, command: str) -> int:
        """`before_step` or `idle`; the threads the peer runs on after it."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return int(self._line("threads"))

    def _line(self, key: str) -> str:
        name, value = self.process.stdout.readline().split()
        assert name == key
        return value

    def kill(self):
        self.process.kill()
        self.process.wait(timeout=10)


def wait_until_busy(share: CoreShare, slot: int) -> None:
    """Until `share`'s table says `slot` is busy, for at most 10 s. (Read through `share`: closing
    another descriptor of the file would drop this process's lock on its slot.)"""
    deadline = time.monotonic() + 10
    while not share.slot_state(slot).is_busy:
        assert time.monotonic() < deadline, "the peer never marked itself busy"
        time.sleep(0.01)


@pytest.fixture
def peers():
    started = []
    yield lambda *args, **kwargs: started.append(PeerProcess(*args, **kwargs)) or started[-1]
    for peer in started:
        peer.kill()


@pytest.mark.parametrize("base, busy_bases, cores, expected", [
    (1, [], 2, 2),  # the peer is idle: both cores
    (1, [1], 2, 1),  # both busy: one each
    (1, [1], 4, 2),  # two cores no one was given, shared
    (1, [1, 1], 3, 1),
    (2, [1], 5, 3),  # spare cores go by base: 2 + 2 * 2 // 3 here, 1 + 2 * 1 // 3 for the peer
    (2, [2], 2, 2),  # bases beyond the cores: each keeps its own
])
def test_threads_for_a_busy_worker(base, busy_bases, cores, expected):
    assert threads_for(base, [Peer(b, True, b) for b in busy_bases], cores) == expected


def test_a_step_waits_only_for_threads_lent_beyond_the_cores():
    lending = Peer(1, False, 2)  # went idle between steps, its last step still on two threads
    assert not fits(1, 1, [lending], 2)
    assert fits(1, 1, [Peer(1, True, 1)], 2)
    assert fits(2, 1, [Peer(1, False, 0)], 2)
    assert fits(2, 2, [Peer(2, True, 2)], 2)  # the user's bases oversubscribe; no one borrowed


def test_a_worker_runs_on_an_idle_peers_core_and_gives_it_back(tmp_path, peers):
    path = tmp_path / "cores"
    threads = []
    share = CoreShare(str(path), 1, 2, threads.append, max_wait_s=5.0)
    peer = peers(path)
    assert peer.slot != share.slot
    share.before_step()
    assert threads == [2]  # the peer has no work: torch is told two threads
    waited = threading.Thread(target=peer.do, args=("before_step",))
    waited.start()  # the peer turns busy and waits for the core this worker still uses...
    wait_until_busy(share, peer.slot)
    share.before_step()  # ...which this worker's next step gives back
    waited.join(timeout=10)
    assert threads == [2, 1]
    assert peer.do("before_step") == 1
    peer.do("idle")
    share.before_step()
    assert threads == [2, 1, 2]
    share.close()


def until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_step_grows_onto_the_core_a_peer_leaves_idle_while_it_runs(tmp_path, peers):
    path = tmp_path / "cores"
    threads = []
    share = CoreShare(str(path), 1, 2, threads.append, max_wait_s=5.0)
    count = share.follow_mid_step()
    peer = peers(path, max_wait_s=5.0)

    def peer_turns_busy() -> threading.Thread:
        """The peer's next step, which waits for the core this worker's running step holds."""
        waited = threading.Thread(target=peer.do, args=("before_step",))
        waited.start()
        wait_until_busy(share, peer.slot)
        time.sleep(0.05)
        assert waited.is_alive()
        return waited

    share.before_step()
    waited = peer_turns_busy()
    share.before_step()  # both busy: one core each
    waited.join(timeout=10)
    assert (count[0], share.threads, threads) == (1, 1, [2, 1])
    peer.do("idle")  # ...and now this worker's running step may take the peer's core at its next layer
    assert until(lambda: count[0] == 2), "the running step was never given the idle core"
    assert share.slot_state(share.slot) == Peer(1, True, 2) and threads == [2, 1]  # torch is told on the engine's thread
    waited = peer_turns_busy()  # it waits for this step to end, as for one begun on both cores
    share.before_step()
    waited.join(timeout=10)
    assert (count[0], threads) == (1, [2, 1, 1])
    share.idle()
    peer.do("idle")
    time.sleep(0.05)
    assert count[0] == 1  # no step runs: nothing grows
    share.before_step()
    assert (count[0], threads) == (2, [2, 1, 1, 2])
    share.close()
    assert not share._watcher.is_alive()


def beside_a_borrowing_peer(path, peers) -> tuple[PeerProcess, CoreShare, list[int]]:
    """A peer that took both cores and steps no more; then this worker's first step, which waits
    0.05 s at most for the lent core and runs on its own thread."""
    peer = peers(path)
    assert peer.do("before_step") == 2
    threads = []
    share = CoreShare(str(path), 1, 2, threads.append, max_wait_s=0.05)
    share.before_step()
    assert (share.threads, threads) == (1, [])  # its own thread, as built, though it did not fit
    return peer, share, threads


def test_a_wait_for_a_peer_that_does_not_give_back_is_bounded(tmp_path, peers):
    _, share, _ = beside_a_borrowing_peer(tmp_path / "cores", peers)
    polls = []
    share.before_step(lambda: polls.append(threading.current_thread()))  # again: bounded every step
    assert share.threads == 1
    assert polls and set(polls) == {threading.current_thread()}  # the caller's work ran while it waited
    share.close()


def test_a_step_that_fits_at_once_runs_nothing_while_waiting(tmp_path, peers):
    share = CoreShare(str(tmp_path / "cores"), 1, 2, lambda n: None, max_wait_s=5.0)
    peers(tmp_path / "cores")  # idle
    share.before_step(lambda: pytest.fail("waited though both cores were free"))
    assert share.threads == 2
    share.close()


def test_the_slot_of_a_worker_that_died_is_freed(tmp_path, peers):
    path = tmp_path / "cores"
    peer, share, threads = beside_a_borrowing_peer(path, peers)
    peer.kill()  # busy, two threads in use: only its lock, gone with it, says it is dead
    share.before_step()
    assert threads == [2]
    assert share.slot_state(peer.slot) == Peer(0, False, 0)
    assert peers(path).slot == peer.slot  # a restarted worker takes the slot again
    share.close()


def test_a_closed_slot_is_taken_again(tmp_path):
    path = tmp_path / "cores"
    first = CoreShare(str(path), 1, 2, lambda n: None)
    slot = first.slot
    first.close()
    second = CoreShare(str(path), 1, 2, lambda n: None)
    assert second.slot == slot
    second.close()


def test_a_table_that_cannot_be_opened_is_a_config_error_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError) as caught:
        core_share(str(tmp_path / "missing" / "cores"), 1)
    assert caught.value.field == "core_share_file"
    assert core_share(None, 1) is None
