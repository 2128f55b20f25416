"""Where a conversion of a model file is kept, and how an entry is written so that no reader
ever sees half of one.

An entry's key covers what decides its content: the source file (real path, size, mtime),
the converter's version and whatever the caller adds (e.g. the dtype). Touching or replacing
the source gives a new key; stale entries are left for the user to delete. Each entry is
one file, written under a temporary name in the same directory and then renamed into place.
Processes that would make the same entry at once (`pdserve serve`'s workers at their first
start) take turns through `one_at_a_time`: the first converts, the others read its entry.
"""
import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_WAIT_S = 300.0  # the longest a process waits for a peer's conversion before making its own
_POLL_S = 0.05
_log = logging.getLogger(__name__)


def cache_key(source: str, *parts: object) -> str:
    """A short hex digest of `source`'s identity (real path, size, mtime) and `parts`."""
    stat = os.stat(source)
    text = "|".join(map(str, (os.path.realpath(source), stat.st_size, stat.st_mtime_ns, *parts)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def write_file_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Call `write(scratch)` on a fresh file next to `target`, then rename it to `target`.

    Concurrent writers each rename a complete file; the last one wins. On any error the
    scratch file is removed and `target` is left as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(scratch))
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise



@contextlib.contextmanager
def one_at_a_time(target: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold `target`'s lock file (`.<name>.lock` beside it) for the block: a process that
    finds it held waits up to `wait_s` (the kernel frees the lock of a process that dies), then
    goes on without it. Where the lock cannot be made (a read-only cache) there is no waiting."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    _log.warning("%s: a peer held its lock for %g s; converting without it", target, wait_s)
                    break
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock
