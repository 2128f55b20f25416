"""A tethered child dies with its parent: a parent killed with SIGKILL leaves no child behind,
whether the child stops on SIGTERM, ignores it, or gets no signal from the kernel."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.serve import tether

WAIT_S = 20.0

# The child: tethered to its parent, it writes its pid to READY, then sleeps (60 s at most, so a
# failed test leaves nothing behind). On SIGTERM it writes "stopped" to READY.stop and exits 0.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from pdserve.serve import tether
    ready, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "no-kernel-signal":
        tether.set_parent_death_signal = lambda sig: False
    def stop(*_):
        ready.with_suffix(".stop").write_text("stopped")
        sys.exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-sigterm" else stop)
    tether.tether(os.getppid(), grace_s=1.0)
    ready.with_suffix(".partial").write_text(str(os.getpid()))
    ready.with_suffix(".partial").rename(ready)
    time.sleep(60)
""")

# The parent: starts the child in a session of its own (as serve does), then sleeps.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True)
    time.sleep(60)
""")


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap a re-parented child)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def start_family(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], int]:
    ready = tmp_path / "child.ready"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(ready), mode])
    wait_until(ready.exists, "the child never became ready")
    return parent, int(ready.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("mode", "stopped_by_sigterm"), [
    ("stop-on-sigterm", True),  # the kernel's parent-death signal
    ("no-kernel-signal", True),  # the watchdog's SIGTERM
    ("ignore-sigterm", False),  # the watchdog's SIGKILL, after the grace period
])
def test_a_parent_killed_with_sigkill_takes_its_tethered_child(tmp_path: Path, mode: str,
                                                               stopped_by_sigterm: bool) -> None:
    parent, child = start_family(tmp_path, mode)
    try:
        parent.kill()
        parent.wait(WAIT_S)
        wait_until(lambda: not is_running(child), f"child {child} outlived its parent")
    finally:
        if is_running(child):
            os.kill(child, signal.SIGKILL)
    assert (tmp_path / "child.stop").exists() == stopped_by_sigterm


def test_a_child_whose_parent_is_gone_before_the_tether_gets_sigterm_from_the_watchdog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(tether.time, "sleep", lambda s: None)
    tether.watch_parent(parent_pid=-1, grace_s=5.0, is_signalled_by_kernel=False)
    assert sent == [signal.SIGTERM, signal.SIGKILL]


def test_the_kernel_signal_is_not_sent_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(tether.time, "sleep", lambda s: None)
    tether.watch_parent(parent_pid=-1, grace_s=5.0, is_signalled_by_kernel=True)
    assert sent == [signal.SIGKILL]
