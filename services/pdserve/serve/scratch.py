"""`pdserve serve`'s scratch folder: its launch's private keys and the core-share table.

The folder is made owner-only under the system's temporary directory and removed when serve
exits. A serve killed with SIGKILL cannot remove it, so each folder names its serve (pid and
that process's start time), and every start first removes the folders of this user's serves
that are gone: no private key outlives its launch for longer than the next start.
"""
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "pdserve-serve-"
OWNER_FILE = "serve.pid"  # "<pid> <start time in clock ticks since boot>"


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the scratch folders under `root` (default: the temporary directory) that belong to
    this user and to a serve that is no longer running; returns them."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            info = folder.lstat()
            if not folder.is_dir() or folder.is_symlink() or info.st_uid != os.geteuid():
                continue
            pid, start = (folder / OWNER_FILE).read_text().split()
            if process_start(int(pid)) != start:
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


@contextlib.contextmanager
def scratch_folder(root: Path | None = None) -> Iterator[Path]:
    """A fresh owner-only folder naming this process, removed on the way out; stale ones first."""
    remove_stale(root)
    with tempfile.TemporaryDirectory(prefix=PREFIX, dir=root) as folder:
        (Path(folder) / OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid())}\n")
        yield Path(folder)
