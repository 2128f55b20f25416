"""Where a conversion of a model file is kept, and how an entry is written so that no reader
ever sees half of one.

An entry's key covers what decides its content: the source file (real path, size, mtime),
the converter's version and whatever the caller adds (e.g. the dtype). Touching or replacing
the source gives a new key; stale entries are left for the user to delete. Each entry is
one file, written under a temporary name in the same directory and then renamed into place.
"""
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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

