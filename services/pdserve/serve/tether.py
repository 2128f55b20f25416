"""A child of `pdserve serve` that dies with it, even when serve itself is SIGKILLed.

`python -m pdserve.serve.tether PARENT_PID GRACE_S <command> [flags]` runs `pdserve <command>
[flags]` in this very process, tied to PARENT_PID (serve runs each child in its own session,
so nothing else would end it):
- on Linux the kernel sends SIGTERM the moment the parent dies (PR_SET_PDEATHSIG, as SGLang's
  launcher does), and the child stops as on Ctrl-C (a worker drains, closes its KV transport);
- a watchdog thread sees the parent gone (this process re-parented) within WATCH_INTERVAL_S;
  where the kernel sent no signal (another OS, or a parent gone before the tether was set) it
  sends the SIGTERM itself; either way a process still alive GRACE_S later is SIGKILLed.
"""
import ctypes
import os
import signal
import sys
import threading
import time

from pdserve.cli import main as pdserve_main

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 0.5


def set_parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def watch_parent(parent_pid: int, grace_s: float, is_signalled_by_kernel: bool,
                 interval_s: float = WATCH_INTERVAL_S) -> None:
    """Return only by ending this process: once `parent_pid` is no longer its parent, SIGTERM
    (unless the kernel sent it), then SIGKILL after `grace_s`."""
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    if not is_signalled_by_kernel:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def tether(parent_pid: int, grace_s: float) -> None:
    """Tie this process's life to `parent_pid` (see the module's contract)."""
    has_death_signal = set_parent_death_signal(signal.SIGTERM)
    # Checked after the prctl: a parent that died before it sent nothing.
    is_signalled_by_kernel = has_death_signal and os.getppid() == parent_pid
    watchdog = threading.Thread(target=watch_parent, args=(parent_pid, grace_s, is_signalled_by_kernel),
                                name="parent-watchdog", daemon=True)
    watchdog.start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print("usage: python -m pdserve.serve.tether PARENT_PID GRACE_S <command> [flags]", file=sys.stderr)
        return 2
    tether(int(args[0]), float(args[1]))
    return pdserve_main(args[2:])


if __name__ == "__main__":
    sys.exit(main())
